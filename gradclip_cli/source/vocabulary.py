"""The names training scripts and frameworks give things inside a checkpoint, in one place.

Every layout and command reads keys and steps through this module, so
``inspect`` and ``trend`` agree on what a key means and on a checkpoint's step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Top-level entries that hold gradients (the contract's --key rule).
GRADIENT_KEYS = ("grads", "gradients", "grad")
# ... the model's parameters (torch scripts, timm's CheckpointSaver, litgpt, Lightning).
WEIGHT_KEYS = ("model", "model_state_dict", "state_dict", "module", "state_dict_ema")
# ... the optimizer's state dict.
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_state")
# ... the training step, most specific first: Lightning and HF ``global_step``, a
# script's ``step``, litgpt's ``step_count`` / ``iter_num``, Megatron's ``iteration``.
STEP_KEYS = ("global_step", "step", "step_count", "iter_num", "iteration")


def step_value(value: Any) -> int | None:
    """``value`` as a step count: a non-negative int, an integral float, or a one-element
    integer (or integral) tensor; None for anything else."""
    if hasattr(value, "numel") and hasattr(value, "dtype"):
        if value.numel() != 1 or value.dtype.is_complex or str(value.dtype) == "torch.bool":
            return None
        value = value.item()
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= 0:
        return value
    return None


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
