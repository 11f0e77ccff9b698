"""The names training scripts and frameworks give things inside a checkpoint, in one place.

Every layout and command reads keys and steps through this module, so
``inspect`` and ``trend`` agree on what a key means and on a checkpoint's step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradclip_cli.escaping import visible
from gradclip_cli.source.untrusted import is_count

# Top-level entries that hold gradients (the contract's --key rule).
GRADIENT_KEYS = ("grads", "gradients", "grad")
# ... the model's parameters (torch scripts, timm's CheckpointSaver, litgpt, Lightning).
WEIGHT_KEYS = ("model", "model_state_dict", "state_dict", "module", "state_dict_ema")
# ... the optimizer's state dict.
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_state")
# ... the training step, most specific first: Lightning and HF ``global_step``, a
# script's ``step``, litgpt's ``step_count`` / ``iter_num``, Megatron's ``iteration``.
STEP_KEYS = ("global_step", "step", "step_count", "iter_num", "iteration")
# Folder and file names that number a checkpoint by its training step: the HF Trainer's
# checkpoint-N, DeepSpeed's global_stepN, verl's global_step_N, torchtitan's and litgpt's
# step-N, OLMo-core's stepN, Megatron's iter_0000003, GradMonitor's dumps step-N.pt. Not
# accelerate's checkpoint_N (it counts saves) nor torchtune's epoch_N (epochs): those
# number a checkpoint, not a step (trend still orders by them, as by any name's last number).
STEP_NAME = re.compile(r"(?:checkpoint-|global_step_?|step[-_]?|iter_)(\d+)")
# ... and the names a run's folder numbers its checkpoints by: those, and accelerate's
# checkpoint_N (it numbers saves).
NUMBERED_NAME = re.compile(rf"{STEP_NAME.pattern}|checkpoint_(\d+)")
# A shard of a sharded set, as Hugging Face names them (model-00002-of-00003.safetensors):
# its number K and the set's count M. The numbers count parts, not steps.
SHARD_NAME = re.compile(r".+-(\d+)-of-(\d+)\.(?:safetensors|bin|pt|pth)")
# The last number in a name: the order trend gives names STEP_NAME does not know.
LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


def step_value(value: Any) -> int | None:
    """``value`` as a step count: a non-negative int, an integral float, or a one-element
    integer (or integral) tensor; None for anything else."""
    if hasattr(value, "numel") and hasattr(value, "dtype"):
        if value.numel() != 1 or value.dtype.is_complex or str(value.dtype) == "torch.bool":
            return None
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if is_count(value) else None


def step_of(root: Any) -> int | None:
    """The step a checkpoint's top level records (``STEP_KEYS``, first found), or None."""
    if not isinstance(root, Mapping):
        return None
    for key in STEP_KEYS:
        if key in root:
            step = step_value(root[key])
            if step is not None:
                return step
    return None


def step_in_name(name: str) -> int | None:
    """N of a name that numbers a checkpoint by its step (``STEP_NAME``: ``checkpoint-5``,
    ``global_step5``, ``step-00000005``, ``step5``, ``iter_0000005``; a file's name up to
    its first dot, ``step-5.pt``), else None."""
    found = STEP_NAME.fullmatch(name.split(".", 1)[0])
    return int(found.group(1)) if found else None


def step_after(name: str, prefix: str) -> int | None:
    """N of a name that is exactly ``prefix`` then N, where ``prefix`` is one of
    ``STEP_NAME``'s forms (``checkpoint-``, ``global_step_``, ``step``, ``step-``, ``iter_``),
    else None:
    the one framework's folder name (``step-3`` is not OLMo-core's ``step3``)."""
    found = STEP_NAME.fullmatch(name)
    return int(found.group(1)) if found and name[:found.start(1)] == prefix else None


def last_number(name: str) -> int | None:
    """The last number in ``name`` (``step_19`` -> 19), else None."""
    found = LAST_NUMBER.search(name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class CheckpointStep:
    """A checkpoint's step and where it was read; ``note`` when its name says another."""

    step: int | None
    note: str | None = None


def checkpoint_step(stated: int | None, root: Any, path: Path | str) -> CheckpointStep:
    """The one step rule ``inspect`` and ``trend`` follow, for every layout.

    The step the checkpoint itself records, first: what its layout read
    (``stated``: a Trainer's ``global_step``, Megatron's ``iteration``, the
    optimizer's own count), else its top-level step entry (``step_of``). Else
    the step its name gives (``step_in_name``), else its folder's name (a file
    saved into ``checkpoint-5/``). Where the checkpoint records one step and
    its name another, the recorded one is the step (docs/reference/contract.md: "a
    step/global_step entry, ..., or the last number in the name") and the
    note names both.
    """
    path = Path(path)
    named = _named_step(path)
    recorded = stated if stated is not None else step_of(root)
    if recorded is None:
        if named is None or _epoch_of(root) == named[0]:
            # timm's CheckpointSaver names checkpoint-N.pth.tar by its epoch N:
            # a number the checkpoint records as its epoch counts epochs, not steps.
            return CheckpointStep(None)
        return CheckpointStep(named[0])
    if named is not None and named[0] != recorded:
        return CheckpointStep(recorded, f"step {recorded}, as the checkpoint records it; its "
                                        f"name {visible(named[1])} says {named[0]}")
    return CheckpointStep(recorded)


def _epoch_of(root: Any) -> int | None:
    """The epoch a checkpoint's top level records (an ``epoch`` entry), or None."""
    return step_value(root["epoch"]) if isinstance(root, Mapping) and "epoch" in root else None


def _named_step(path: Path) -> tuple[int, str] | None:
    """The step ``path``'s name gives, else its folder's (a file's), with the name."""
    full = os.path.abspath(path)  # "." and "run/" have their folder's name
    names = [os.path.basename(full)]
    if not os.path.isdir(path):
        names.append(os.path.basename(os.path.dirname(full)))
    for n in names:
        step = step_in_name(n)
        if step is not None:
            return step, n
    return None
