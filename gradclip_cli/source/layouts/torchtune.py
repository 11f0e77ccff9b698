"""torchtune output folders: ``epoch_N/`` model shards beside ``recipe_state/recipe_state.pt``.

torchtune's recipes (``full_finetune_single_device`` and the others) save
through a checkpointer at the end of every epoch:

* ``<output_dir>/epoch_N/``: the model. ``FullModelTorchTuneCheckpointer``
  and ``FullModelMetaCheckpointer`` write ``model-00001-of-00001.bin``
  (``torch.save`` of the state dict, in the model's order);
  ``FullModelHFCheckpointer`` writes Hugging Face shards
  (``model-0000K-of-0000M.safetensors`` or ``.bin``) with their index, under
  Hugging Face names, in no model order. Files of the base checkpoint's
  folder (tokenizer, ``config.json``) are copied beside them. The shards are
  written one by one and the index last: an epoch lacking a shard that the
  shards' names count (``-of-0000M``) is refused, naming it;
* ``<output_dir>/recipe_state/recipe_state.pt``: at every epoch but the
  last, overwritten each time: ``optimizer`` (the optimizer's
  ``state_dict()``; with ``optimizer_in_bwd`` one state dict per parameter,
  keyed by its name), ``seed``, ``epochs_run``, ``total_epochs``,
  ``max_steps_per_epoch``, ``dataloader`` (and ``steps_run`` in later
  releases). It is read with the weights-only unpickler, nothing constructed.

The recipe state belongs to the epoch whose save wrote it: ``epoch_N`` with
``epochs_run == N + 1``. torchtune's own resume pairs it with the largest
``epoch_N``; here the pairing is checked, and a recipe state of another
epoch is named, not measured against these weights. An epoch folder given
alone is read with its output folder's recipe state (the two make one
checkpoint; both files stay inside the output folder); the output folder
stands for its largest epoch, as torchtune's resume reads it.

A LoRA recipe's epoch also holds ``adapter_model.pt`` (the adapter's
weights; the model shard has them merged in), and its optimizer covers every
parameter of the LoRA model, with state for the adapter's alone: the
model's order with the adapter's tensors in place names them
(``_read_adapter``).

Saved with ``save_adapter_weights_only``, an epoch holds the adapter alone
(``adapter_model.pt``, and from ``FullModelHFCheckpointer`` the same tensors
under PEFT's names in ``adapter_model.safetensors`` with
``adapter_config.json``), no model shard: ``--what weights`` measures the
adapter's weights, said to be the adapter's, not the model's; the optimizer,
whose ids count every parameter of the LoRA model, has no model here to name
them, and is measured exactly under its ids, the report saying why
(``_adapter_alone``).

The step: torchtune counts ``global_step = epochs_run * steps_per_epoch``
(``full_finetune_single_device.py``, every epoch the same length), and the
recipe state says how many optimizer steps ran (``steps_run``, else the
optimizer's own ``step``, the same for every parameter), so epoch ``N`` is at
step ``(N + 1) * steps_per_epoch``. Without a recipe state the step is not
known (``trend`` orders by the epoch's number).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import Contents, OptimizerState, StoredTensor, stored
from gradclip_cli.source.vocabulary import step_value

from . import dcp_frameworks as frameworks
from . import hf_sharded
from .draft import Draft
from .facts import FILES, Found, NoGradients, wording
from .paths import inside
from .torch_optim import is_optimizer_state, optimizer_state

KIND = "torchtune"
RECIPE_STATE = "recipe_state/recipe_state.pt"
_SAID = "torchtune's"
_EPOCH = re.compile(r"epoch_(\d+)")
_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.(bin|safetensors|pt)")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
ADAPTER = "adapter_model.pt"
ADAPTERS = "the LoRA adapter's"


def recognises(path: Path) -> bool:
    return _epoch_number(path) is not None or bool(_epoch_folders(path))


def _names(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    except OSError:
        return []


def _epoch_number(path: Path) -> int | None:
    """N of a folder named ``epoch_N`` that holds a torchtune model shard (or, saved with
    ``save_adapter_weights_only``, the LoRA adapter alone), else None."""
    named = _EPOCH.fullmatch(os.path.basename(os.path.abspath(path)))
    names = _names(path)
    if named is None or not (any(_SHARD.fullmatch(n) for n in names) or ADAPTER in names):
        return None
    return int(named.group(1))


def _epoch_folders(path: Path) -> list[tuple[int, Path]]:
    """``(N, epoch_N)`` of an output folder, in epoch order; empty when it is none."""
    found = []
    for name in _names(path):
        child = path / name
        number = _epoch_number(child) if _EPOCH.fullmatch(name) else None
        if number is not None:
            found.append((number, child))
    return sorted(found)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    frameworks.refuse_key(path, key, "a torchtune checkpoint")
    number = _epoch_number(path)
    if number is not None:
        epoch, output = path, Path(os.path.abspath(path)).parent
    else:
        number, epoch = _epoch_folders(path)[-1]
        output = path
    contents = Draft(path=path, kind=KIND)
    checkpointer = _read_weights(contents, epoch, trust_pickle=trust_pickle, verify=verify)
    lines = [f"torchtune epoch_{number}{checkpointer}"]
    recipe_file = output / RECIPE_STATE
    if os.path.exists(recipe_file):
        inside(output, RECIPE_STATE, named_by=output)
        ckpt = load_checkpoint(recipe_file, trust_pickle=trust_pickle, verify=verify)
        contents.files.append(recipe_file)
        contents.trusted_pickle |= ckpt.trusted_pickle
        recipe = ckpt.root
        if not isinstance(recipe, Mapping):
            raise InputError(f"{recipe_file}: not a torchtune recipe state: not a mapping")
        epochs_run = _count(recipe, "epochs_run", recipe_file)
        optimizer = _optimizer(recipe, recipe_file)
        per_epoch = _steps_per_epoch(recipe, epochs_run, optimizer, recipe_file)
        if per_epoch is not None:
            contents.step = (number + 1) * per_epoch
        if epochs_run == number + 1:
            if optimizer is not None:
                contents.optimizers.append(optimizer)
                contents.say(wording(Found(roles.OPTIMIZER_STATE, FILES, (RECIPE_STATE,),
                                           _SAID, f"epochs_run {epochs_run}")))
            total = recipe.get("total_epochs")
            of = f" of {total}" if isinstance(total, int) else ""
            lines.append(f"with {RECIPE_STATE} (epochs_run {epochs_run}{of})")
        else:
            lines.append(
                f"without an optimizer: {RECIPE_STATE} is epoch_{epochs_run - 1}'s "
                f"(epochs_run {epochs_run}); inspect that epoch's folder for it"
            )
    else:
        lines.append(
            f"without an optimizer: no {RECIPE_STATE} (torchtune writes one at every "
            "epoch but the last)"
        )
    adapter_only = contents.weights_of != ""
    if os.path.isfile(epoch / ADAPTER) and not adapter_only:
        lines.append(_read_adapter(contents, epoch, trust_pickle=trust_pickle, verify=verify))
    step = f" at step {contents.step}" if contents.step is not None else ""
    contents.description.append(f"{lines[0]}{step} {', '.join(lines[1:])}".rstrip())
    held = contents.optimizers[0] if contents.optimizers else None
    if held is not None and held.param_names is None and contents.weights_sorted \
            and not contents.order:
        # FullModelHFCheckpointer: Hugging Face's names, sorted, beside an optimizer of
        # torchtune's own model order: measured exactly under its ids, said why.
        contents.missing[roles.PARAMETER_NAMES] = (
            f"{visible(epoch.name)} holds the LoRA adapter's weights alone "
            "(save_adapter_weights_only), no model to give the optimizer's ids, which count "
            "every parameter of the LoRA model, their names" if adapter_only else
            f"{visible(epoch.name)}'s Hugging Face shards sort their names and the optimizer "
            f"in {RECIPE_STATE} is in torchtune's own model order"
        )  # worded in the report by what.named_by_id, as for every layout
    weights = f"{ADAPTERS} weights" if adapter_only else "the model's weights"
    contents.say(wording(NoGradients(path, "a torchtune checkpoint", (
        weights, f"and the optimizer in {RECIPE_STATE}"))))
    return contents.finish()


def _read_weights(contents: Draft, epoch: Path, *, trust_pickle: bool, verify: bool) -> str:
    """The epoch's model into ``contents``; what its files are, for the report."""
    for name in _INDEXES:
        if os.path.exists(epoch / name):
            index = inside(epoch, name, named_by=epoch)
            shards, tensors = hf_sharded.read_set(
                index, trust_pickle=trust_pickle, verify=verify, folder=epoch
            )
            contents.weights = tensors
            contents.weights_sorted = True  # Hugging Face names, in the index's order
            contents.files += [index, *(s.path for s in shards)]
            contents.trusted_pickle |= any(s.trusted_pickle for s in shards)
            contents.say(wording(Found(roles.WEIGHT, FILES, (f"{epoch.name}/{name}",), _SAID)))
            return " (Hugging Face shards)"
    shards = [n for n in _names(epoch) if _SHARD.fullmatch(n)]
    if not shards:
        return _adapter_alone(contents, epoch, trust_pickle=trust_pickle, verify=verify)
    _check_complete(epoch, shards)
    weights: dict[str, StoredTensor] = {}
    in_order = True
    for name in shards:
        file = inside(epoch, name, named_by=epoch)
        ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
        root = ckpt.root
        if not isinstance(root, Mapping):
            raise InputError(f"{file}: not a torchtune model shard: not name -> tensor")
        for k, v in stored(
            {str(k): v for k, v in root.items() if hasattr(v, "dtype")}, file
        ).items():
            if k in weights:
                raise InputError(
                    f"{file}: holds {k}, which {shards[0]} holds too"
                )
            weights[k] = v
        in_order &= ckpt.format != "safetensors" and len(shards) == 1
        contents.files.append(file)
        contents.trusted_pickle |= ckpt.trusted_pickle
    contents.weights = weights or None
    contents.weights_sorted = not in_order  # torch.save of one state dict keeps the model's order
    contents.say(wording(Found(roles.WEIGHT, FILES, (f"{epoch.name}/{', '.join(shards)}",),
                               _SAID)))
    return ""


def _adapter_tensors(contents: Draft, epoch: Path, *, trust_pickle: bool,
                     verify: bool) -> Mapping[str, StoredTensor]:
    """The tensors of the epoch's ``adapter_model.pt``, its file among ``contents``'."""
    file = inside(epoch, ADAPTER, named_by=epoch)
    ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
    contents.files.append(file)
    contents.trusted_pickle |= ckpt.trusted_pickle
    if not isinstance(ckpt.root, Mapping):
        raise InputError(f"{file}: not a LoRA adapter: not name -> tensor")
    return stored({str(k): v for k, v in ckpt.root.items() if hasattr(v, "dtype")}, file)


def _adapter_alone(contents: Draft, epoch: Path, *, trust_pickle: bool, verify: bool) -> str:
    """``save_adapter_weights_only``: ``adapter_model.pt`` (torchtune's names; the Hugging
    Face checkpointer also writes ``adapter_model.safetensors``, the same tensors under
    PEFT's names) is all the epoch holds of the model: read as the adapter's weights, never
    the model's. No order maps the optimizer's ids (every parameter of the LoRA model) to
    them: the model's own names are not here."""
    adapter = _adapter_tensors(contents, epoch, trust_pickle=trust_pickle, verify=verify)
    contents.weights, contents.weights_of = adapter or None, ADAPTERS
    contents.weights_sorted = True  # the adapter's tensors, not the optimizer's model order
    contents.say(wording(Found(roles.WEIGHT, FILES, (f"{epoch.name}/{ADAPTER}",), _SAID,
                               "the LoRA adapter's tensors (lora_a, lora_b)")))
    return (f" ({ADAPTER}: {ADAPTERS} weights alone, {len(adapter)} tensors; "
            "save_adapter_weights_only: no model shard)")


def _check_complete(epoch: Path, shards: list[str]) -> None:
    """Every shard that the shards' own names count (``model-0000K-of-0000M``: K from 1 to
    M) is there. ``FullModelHFCheckpointer`` writes its shards one by one and the index
    last, so a save that did not finish leaves the first shards and no index: read as
    they are, they would pass for the whole model."""
    for name in shards:
        _, total, suffix = _SHARD.fullmatch(name).groups()
        for k in range(1, int(total) + 1):
            wanted = f"model-{k:05d}-of-{total}.{suffix}"
            if wanted not in shards:
                raise InputError(
                    f"{epoch / wanted}: missing: {name} is one of {int(total)} "
                    "shards and this one is not there (a save that did not finish: "
                    "torchtune writes the shards one by one, then their index)"
                )


def _read_adapter(contents: Draft, epoch: Path, *, trust_pickle: bool, verify: bool) -> str:
    """LoRA's ``adapter_model.pt`` (``get_adapter_state_dict``: the adapter's weights in the
    model's order): the weights of the parameters LoRA trains, which the model shard holds
    merged into its own. Its optimizer was given every parameter of the LoRA model, in
    ``named_parameters()`` order, where a ``LoRALinear``'s ``lora_a`` and ``lora_b`` follow
    its own ``weight`` (and ``bias``): that order is rebuilt here, so the optimizer's ids
    map by position, and the adapter's weights give ``ratio``."""
    adapter = _adapter_tensors(contents, epoch, trust_pickle=trust_pickle, verify=verify)
    contents.fused_weights = adapter
    base = list(contents.weights or {})
    by_module: dict[str, list[str]] = {}
    for name in adapter:
        module, found, _ = name.partition(".lora_")
        if not found:
            return f"{ADAPTER} ({len(adapter)} adapter tensors, not all lora_a/lora_b: unplaced)"
        by_module.setdefault(module, []).append(name)
    last = {n.rsplit(".", 1)[0]: i for i, n in enumerate(base)}
    if not set(by_module) <= set(last):
        return f"{ADAPTER} ({len(adapter)} adapter tensors of modules the model lacks)"
    order: list[str] = []
    for i, name in enumerate(base):
        order.append(name)
        module = name.rsplit(".", 1)[0]
        if last[module] == i:
            order += by_module.get(module, [])
    contents.order = order
    return f"{ADAPTER} (LoRA: {len(adapter)} adapter tensors, merged into the model shard)"


def _count(recipe: Mapping, key: str, file: Path) -> int:
    value = step_value(recipe.get(key))
    if value is None or value == 0:
        raise InputError(
            f"{file}: not a torchtune recipe state: {key} is "
            f"{quoted(recipe.get(key))[:60]}, not a count of epochs"
        )
    return value


def _optimizer(recipe: Mapping, file: Path) -> OptimizerState | None:
    """``recipe["optimizer"]``: one state dict, or (``optimizer_in_bwd``) one per parameter
    keyed by its name, read as one optimizer whose groups hold a parameter each."""
    value = recipe.get("optimizer")
    if value is None:
        return None
    if is_optimizer_state(value):
        return optimizer_state(value, file, "'optimizer'")
    if not isinstance(value, Mapping) or not value:
        raise InputError(f"{file}: 'optimizer' is not an optimizer state dict")
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    for pid, (name, one) in enumerate(value.items()):
        where = f"'optimizer' of {name}"
        if not isinstance(name, str) or not is_optimizer_state(one):
            raise InputError(f"{file}: {where} is not an optimizer state dict")
        if len(one["param_groups"]) != 1 or len(one["param_groups"][0].get("params", ())) != 1:
            raise InputError(
                f"{file}: {where} holds more than one parameter; torchtune's "
                "optimizer_in_bwd keeps one per parameter"
            )
        own = one["param_groups"][0]["params"][0]
        if own in one["state"]:
            state[pid] = one["state"][own]
        groups.append({**one["param_groups"][0], "params": [pid], "param_names": [name]})
    return optimizer_state(
        {"state": state, "param_groups": groups}, file, "'optimizer' (one per parameter)"
    )


def _steps_per_epoch(
    recipe: Mapping, epochs_run: int, optimizer: OptimizerState | None, file: Path
) -> int | None:
    """Optimizer steps per epoch: ``steps_run`` (else the optimizer's ``step``, the same
    for every parameter) over ``epochs_run``; None when it is not a whole number."""
    done = step_value(recipe.get("steps_run"))
    if done is None and optimizer is not None:
        steps = {step_value(entry.get("step")) for entry in optimizer.state.values()}
        if len(steps) == 1 and None not in steps:
            done = steps.pop()
    if done is None or done % epochs_run:
        return None
    return done // epochs_run
