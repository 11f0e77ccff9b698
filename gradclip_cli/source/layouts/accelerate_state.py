"""accelerate's ``save_state`` folder without FSDP: ``model.safetensors`` beside ``optimizer.bin``.

``Accelerator.save_state(dir)`` (``accelerate.checkpointing.save_accelerator_state``)
writes, for the models, optimizers and schedulers it prepared:

- ``model.safetensors`` (``pytorch_model.bin`` with ``safe_serialization=False``):
  the model's ``state_dict()``; ``model_1.safetensors`` for a second model;
- ``optimizer.bin``: ``torch.save`` of the optimizer's ``state_dict()``
  (state keyed by parameter id, ids in the order the optimizer was given
  the parameters; ``param_names`` only when it was given named ones);
- ``scheduler.bin``, ``sampler.bin``: a scheduler's state, a pickled sampler;
- ``random_states_<rank>.pkl``: a plain pickle of Python's, numpy's and
  torch's RNG states and accelerate's step counter.

With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` each save is a
folder ``checkpoints/checkpoint_<i>``, ``i`` counting saves (not steps).

Recognised by content: a folder holding ``optimizer.bin`` or
``random_states_0.pkl`` beside a model file, with none of the Trainer's own
files (``trainer_state.json``, ``optimizer.pt``). Only the model and the
optimizer files are read, through the weights-only readers; the pickles
(``random_states_*.pkl``, ``sampler.bin``) and ``scheduler.bin`` are never
opened. The step is the optimizer's own ``step`` count, where every
parameter's state agrees on it.

Optimizer ids are mapped to names through ``param_names``, else through the
model's parameter order: ``pytorch_model.bin`` keeps it (``torch.save`` of
a state dict), ``model.safetensors`` does not (its header sorts names). Then
the optimizer state is measured under its ids (``state.0``, ...), exactly,
and the report says why it carries no names: guessing an order from sorted
names would give a wrong layer its norm.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.interface import Contents, stored
from gradclip_cli.source.vocabulary import step_value

from .dcp_frameworks import refuse_key
from .draft import Draft
from .facts import FILES, Found, NoGradients, wording
from .paths import member
from .torch_optim import optimizer_state

KIND = "accelerate"
MODEL_FILES = ("model.safetensors", "pytorch_model.bin")  # accelerate's SAFE_/WEIGHTS_NAME
OPTIMIZER = "optimizer.bin"
RANDOM_STATES = "random_states_0.pkl"
# The Trainer's own files: a checkpoint-N/ folder is the Trainer's layout (hf_trainer).
_TRAINER_FILES = ("trainer_state.json", "optimizer.pt")
_SAID = "an accelerate save_state folder"
_NUMBERED = re.compile(r"(model|pytorch_model|optimizer)_(\d+)\.(safetensors|bin)")


def _names(path: Path) -> set[str]:
    try:
        return set(os.listdir(path)) if os.path.isdir(path) else set()
    except OSError:
        return set()


def recognises(path: Path) -> bool:
    names = _names(path)
    return (any(n in names for n in MODEL_FILES)
            and (OPTIMIZER in names or RANDOM_STATES in names)
            and not any(n in names for n in _TRAINER_FILES))


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "an accelerate save_state folder")
    names = _names(path)
    more = sorted(n for n in names if _NUMBERED.fullmatch(n))
    if more:
        raise InputError(
            f"{path}: an accelerate save_state folder of several models or optimizers "
            f"({', '.join(more)}); gradclip reads one model and its optimizer: "
            "give the file to read")
    contents = Draft(path=path, kind=KIND)
    model_name = next(n for n in MODEL_FILES if n in names)
    model_file = member(path, model_name)
    ckpt = load_checkpoint(model_file, trust_pickle=trust_pickle, verify=verify)
    if not isinstance(ckpt.root, dict):
        raise InputError(f"{model_file}: model weights should be name -> tensor")
    contents.weights = stored({str(k): v for k, v in ckpt.root.items()}, model_file)
    # torch.save of a state_dict keeps module order; a safetensors header sorts names.
    contents.weights_sorted = ckpt.format == "safetensors"
    contents.say(wording(Found(roles.WEIGHT, FILES, (model_name,), _SAID)))
    contents.files.append(model_file)
    contents.trusted_pickle |= ckpt.trusted_pickle
    read = [model_name]
    if OPTIMIZER in names:
        optimizer_file = member(path, OPTIMIZER)
        opt_ckpt = load_checkpoint(optimizer_file, trust_pickle=trust_pickle, verify=verify)
        opt = optimizer_state(opt_ckpt.root, optimizer_file, "the file")
        contents.optimizers.append(opt)
        contents.say(wording(Found(roles.OPTIMIZER_STATE, FILES, (OPTIMIZER,), _SAID)))
        contents.files.append(optimizer_file)
        contents.trusted_pickle |= opt_ckpt.trusted_pickle
        contents.step = _optimizer_step(opt.state)
        read.append(OPTIMIZER)
        if opt.param_names is None and contents.weights_sorted:
            # The report words it (what.named_by_id), as for every layout.
            contents.missing[roles.PARAMETER_NAMES] = f"{visible(model_name)} sorts its names"

    contents.say(wording(NoGradients(path, _SAID)))
    step = f" at step {contents.step}" if contents.step is not None else ""
    unread = sorted(n for n in names if n not in read and n.endswith((".bin", ".pkl")))
    contents.description.append(
        f"accelerate save_state folder{step}: {', '.join(read)}"
        + (f" ({visible(', '.join(unread))} not read)" if unread else ""))
    return contents.finish()


def _optimizer_step(state: dict) -> int | None:
    """The optimizer's step count: every parameter's ``step``, where all agree (Adam's
    family counts per parameter; SGD keeps none)."""
    steps = {step_value(entry.get("step")) for entry in state.values()}
    if len(steps) == 1:
        return steps.pop()
    return None
