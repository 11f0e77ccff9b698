"""Hugging Face Trainer checkpoints: ``checkpoint-N/`` folders.

``Trainer._save_checkpoint`` writes the model (``model.safetensors``, or
sharded with an index, or ``pytorch_model.bin``), ``optimizer.pt`` (the
optimizer's ``state_dict()``: state keyed by index, no ``param_names``),
``trainer_state.json`` (``global_step``, ``log_history``), ``scheduler.pt``,
``rng_state.pth`` and ``training_args.bin``. Recognised by content: a folder
holding ``trainer_state.json`` or ``optimizer.pt`` beside model weights.

The Trainer gives the optimizer two param groups, decayed and not decayed,
each in model order. Mapping state to names needs the model's order, which a
safetensors file does not keep (its header sorts names). ``pytorch_model.bin``
keeps it; otherwise the order is rebuilt from ``config.json`` by constructing
the model on the meta device (no memory, no weights, no remote code), when
transformers is installed. Nothing else is trusted. ``training_args.bin`` is
a full pickle of ``TrainingArguments``: this layout does not open it; ``trend``
reads its ``max_grad_norm`` through the restricted unpickler, with inert
stand-ins for its classes (``source/files/training_args.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files.small_file import excerpt
from gradclip_cli.source.foreign import silenced
from gradclip_cli.source.interface import Contents, stored
from gradclip_cli.source.untrusted import is_int
from gradclip_cli.source.vocabulary import step_after, step_value

from . import hf_sharded
from .dcp_frameworks import refuse_key
from .draft import Draft
from .facts import FILES, Found, NoGradients, wording
from .paths import member, read_json
from .torch_optim import optimizer_state

KIND = "hf-trainer"
STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# The loggers transformers writes through (its own, and the hub client's it calls).
TRANSFORMERS_LOGGERS = ("transformers", "huggingface_hub")


def recognises(path: Path) -> bool:
    if not os.path.isdir(path):
        return False
    try:
        names = set(os.listdir(path))
    except OSError:
        return False
    has_weights = any(n in names for n in (*WEIGHT_FILES, *INDEX_FILES))
    return has_weights and (STATE in names or OPTIMIZER in names)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "a Trainer checkpoint")
    contents = Draft(path=path, kind=KIND)
    contents.step = global_step(path)
    _read_weights(contents, path, trust_pickle=trust_pickle, verify=verify)
    optimizer_file = member(path, OPTIMIZER) if os.path.exists(path / OPTIMIZER) else None
    if optimizer_file is not None:
        ckpt = load_checkpoint(optimizer_file, trust_pickle=trust_pickle, verify=verify)
        contents.optimizers.append(optimizer_state(ckpt.root, optimizer_file, "the file"))
        contents.say(wording(Found(roles.OPTIMIZER_STATE, FILES, (OPTIMIZER,), "the Trainer's")))
        contents.files.append(optimizer_file)
        contents.trusted_pickle |= ckpt.trusted_pickle
    if contents.optimizers and contents.optimizers[0].param_names is None \
            and contents.weights_sorted:
        contents.order = model_order_from_config(path, len(contents.weights or {}))
    contents.say(wording(NoGradients(path, "a Trainer checkpoint")))
    held = ", ".join(visible(p.name) for p in contents.files)
    step = f" at global_step {contents.step}" if contents.step is not None else ""
    contents.description.insert(0, f"Trainer checkpoint{step}: {held}")
    return contents.finish()


def global_step(folder: Path) -> int | None:
    """``folder/trainer_state.json``'s ``global_step`` (None without the file), checked
    against the folder's ``checkpoint-N`` name."""
    state_file = folder / STATE
    if not os.path.exists(state_file):
        return None
    state = read_json(state_file, what="a Trainer state", folder=folder)
    if not isinstance(state, dict):
        raise InputError(f"{state_file}: not a Trainer state: not a JSON object")
    step = step_value(state.get("global_step"))
    if step is None:
        raise InputError(f"{state_file}: not a Trainer state: global_step is "
                         f"{excerpt(state.get('global_step'))}, not a step count")
    named = step_after(folder.resolve().name, "checkpoint-")
    if named is not None and named != step:
        raise InputError(f"{state_file}: says global_step {step}, but the folder is "
                         f"{folder.resolve().name}")
    return step


def _read_weights(contents: Draft, folder: Path, *, trust_pickle: bool,
                  verify: bool) -> None:
    for name in INDEX_FILES:
        if os.path.exists(folder / name):
            index = member(folder, name)
            shards, tensors = hf_sharded.read_set(index, trust_pickle=trust_pickle, verify=verify,
                                                  folder=folder)
            contents.weights = tensors
            contents.say(wording(Found(roles.WEIGHT, FILES, (name,), "the Trainer's")))
            contents.weights_sorted = True  # an index sorts its names
            contents.files += [index, *(s.path for s in shards)]
            contents.trusted_pickle |= any(s.trusted_pickle for s in shards)
            return
    for name in WEIGHT_FILES:
        if os.path.exists(folder / name):
            file = member(folder, name)
            ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
            if not isinstance(ckpt.root, dict):
                raise InputError(f"{file}: model weights should be name -> tensor")
            contents.weights = stored({str(k): v for k, v in ckpt.root.items()}, file)
            contents.say(wording(Found(roles.WEIGHT, FILES, (name,), "the Trainer's")))
            # torch.save of a state_dict keeps module order; safetensors sorts names.
            contents.weights_sorted = ckpt.format == "safetensors"
            contents.files.append(file)
            contents.trusted_pickle |= ckpt.trusted_pickle
            return


def model_order_from_config(folder: Path, stored: int) -> list[str] | None:
    """The model's parameter names in ``named_parameters()`` order, rebuilt from config.json.

    The model is built on the meta device (shapes only) from transformers'
    own classes (``architectures`` must name one; ``trust_remote_code`` is
    never set), from the config as read here (the file is read once). None
    when transformers is missing or the model cannot be built; the mapping
    then says why it cannot proceed.

    The config is data: building it costs in proportion to the modules it
    asks for, whatever the weights hold (``n_layer: 3000`` in 757 bytes took
    120 s and 2.6 GB). ``stored``, the number of weight tensors the folder
    holds, bounds it first (``check_module_counts``).
    """
    config_file = folder / "config.json"
    if not os.path.exists(config_file):
        return None
    document = read_json(config_file, what="a model config", folder=folder)
    architectures = document.get("architectures") if isinstance(document, dict) else None
    if not (isinstance(architectures, list) and architectures
            and isinstance(architectures[0], str)):
        return None
    # What transformers says while it builds (config warnings, its log lines) is about
    # its own use of the config: none of it reaches gradclip's stderr. (Its import sets
    # its loggers' levels: they are silenced once it is imported.)
    with silenced():
        try:
            import torch
            import transformers
        except ImportError:
            return None
    with silenced(*TRANSFORMERS_LOGGERS):
        model_class = getattr(transformers, architectures[0], None)
        if not (isinstance(model_class, type)
                and issubclass(model_class, transformers.PreTrainedModel)):
            return None
        check_module_counts(config_file, document, stored)
        try:
            config = model_class.config_class.from_dict(document)
            with torch.device("meta"):
                model = model_class(config)
        except Exception:  # any failure to build: the order stays unknown, reported later
            return None
    return [name for name, _ in model.named_parameters()]


# Config keys that count modules, as transformers' configs name them: layers and
# experts. Each such module holds at least one parameter, so no count can exceed
# the number of stored weights.
MODULE_COUNT_KEYS = frozenset({
    "n_layer", "n_layers", "num_layers", "num_hidden_layers", "encoder_layers",
    "decoder_layers", "num_encoder_layers", "num_decoder_layers",
    "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
})


def check_module_counts(config_file: Path, document: object, stored: int) -> None:
    """``InputError`` naming ``config_file`` when a count of modules it gives
    (``MODULE_COUNT_KEYS``, nested configs included) exceeds ``stored``, the weight
    tensors the checkpoint holds: a model with more modules than stored tensors
    cannot be the one these weights belong to."""
    pending = [("", document)]
    while pending:
        prefix, node = pending.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                pending.append((f"{name}.", value))
            elif key in MODULE_COUNT_KEYS and is_int(value) and value > stored:
                raise InputError(
                    f"{config_file}: says {excerpt(name)} is {value}, more "
                    f"than the {stored} weight tensors the checkpoint holds; refusing to "
                    "build the model it describes")
