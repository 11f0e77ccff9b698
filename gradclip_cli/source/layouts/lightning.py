"""Lightning ``.ckpt`` files: one ``torch.save`` file with Lightning's keys.

``Trainer.save_checkpoint`` writes ``{"epoch", "global_step",
"pytorch-lightning_version", "state_dict": {name: tensor}, "optimizer_states":
[optimizer.state_dict(), ...], "lr_schedulers": [...], "callbacks": ...}``.
Recognised by those keys (``state_dict`` plus Lightning's version or its
``optimizer_states`` list), not by the ``.ckpt`` suffix. The model's
``state_dict`` is in module order, so optimizer state without
``param_names`` maps onto it (``source/what.py``). Gradients saved beside
(``GradMonitor`` / ``save_grads`` under ``grads``) are found by the usual
``--key`` rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.interface import Checkpoint, Contents, stored

from .torch_optim import optimizer_state

KIND = "lightning"
VERSION_KEY = "pytorch-lightning_version"


def claims(root: Any) -> bool:
    """True for a Lightning checkpoint's top level."""
    return (isinstance(root, Mapping) and isinstance(root.get("state_dict"), Mapping)
            and (VERSION_KEY in root or isinstance(root.get("optimizer_states"), list)))


def contents(ckpt: Checkpoint, *, key: str | None) -> Contents:
    from .single_file import fill_from_root

    root = ckpt.root
    path = ckpt.path
    out = Contents(path=path, kind=KIND, files=[path], checkpoint=ckpt,
                   trusted_pickle=ckpt.trusted_pickle)
    # Modules may keep non-tensor extra state in a state_dict; only tensors are weights.
    weights = {k: v for k, v in root["state_dict"].items() if isinstance(v, torch.Tensor)}
    # Gradients only where the file holds a gradient mapping: the state_dict
    # itself is the model, never taken for gradients.
    # An explicit --key reaches anywhere in the file (optimizer_states.0.state).
    rest = {k: v for k, v in root.items() if k not in ("state_dict", "optimizer_states")}
    fill_from_root(out, root if key is not None else rest, path, key)
    out.weights = stored({str(k): v for k, v in weights.items()}, path)
    out.optimizers = []
    states = root.get("optimizer_states", [])
    if not isinstance(states, list):
        raise InputError(f"{path}: Lightning 'optimizer_states' is not a list")
    for i, state in enumerate(states):
        out.optimizers.append(optimizer_state(state, path, f"optimizer_states[{i}]"))
    step = root.get("global_step")
    if step is not None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InputError(f"{path}: Lightning 'global_step' is {step!r}, not a step count")
        out.step = step
    version = root.get(VERSION_KEY)
    out.description.append(
        f"Lightning checkpoint{f' (Lightning {version})' if isinstance(version, str) else ''}: "
        f"{len(weights)} weights, {len(states)} optimizer state(s)")
    return out
