"""Lightning checkpoints: a ``.ckpt`` file, or a sharded ``.ckpt`` folder.

``Trainer.save_checkpoint`` writes ``{"epoch", "global_step",
"pytorch-lightning_version", "state_dict": {name: tensor}, "optimizer_states":
[optimizer.state_dict(), ...], "lr_schedulers": [...], "callbacks": ...}``.
Recognised by those keys (``state_dict`` plus Lightning's version or its
``optimizer_states`` list), not by the ``.ckpt`` suffix. The model's
``state_dict`` is in module order, so optimizer state without
``param_names`` maps onto it (``source/what.py``). Several optimizers (a
GAN's) are measured together where one rule serves them all; of different
kinds (Adam beside SGD), ``--key optimizer_states.N`` measures the N-th
alone, still mapped onto the model's names. Gradients saved beside
(``GradMonitor`` / ``save_grads`` under ``grads``) are found by the usual
``--key`` rule.

A strategy that shards the model (``ModelParallelStrategy``, FSDP with
``state_dict_type="sharded"``) saves a folder instead: a DCP checkpoint of
``state_dict.<fqn>`` and ``optimizer_<i>.state.<fqn>.exp_avg``... (read by
the ``dcp`` layout, which finds both), plus ``meta.pt``, the rest of the
checkpoint (``global_step``, loops, callbacks) as a small ``torch.save``
file, read by the restricted reader for its step. Recognised by content:
``.metadata`` and ``meta.pt`` side by side.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint, locate, roles
from gradclip_cli.source.files.small_file import excerpt
from gradclip_cli.source.interface import Checkpoint, Contents, stored
from gradclip_cli.source.vocabulary import step_value

from . import dcp
from .draft import Draft
from .facts import FILES, Found, wording
from .paths import member
from .single_file import fill_from_root
from .torch_optim import optimizer_state

KIND = "lightning"
VERSION_KEY = "pytorch-lightning_version"
META = "meta.pt"


def recognises(path: Path) -> bool:
    """A sharded Lightning checkpoint: a DCP folder with Lightning's ``meta.pt`` beside."""
    return os.path.isdir(path) and os.path.isfile(path / META) and dcp.recognises(path)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    """A sharded ``.ckpt`` folder: the DCP checkpoint, with the step from ``meta.pt``."""
    out = dcp.open_as(path, f"a Lightning sharded checkpoint ({META} beside DCP's .metadata)",
                      key=key, trust_pickle=trust_pickle, verify=verify)
    meta_file = member(path, META)
    meta = load_checkpoint(meta_file, trust_pickle=trust_pickle, verify=verify)
    if not isinstance(meta.root, Mapping):
        raise InputError(f"{meta_file}: not Lightning's checkpoint metadata: holds a "
                         f"{type(meta.root).__name__}, not a dict")
    out.kind = KIND
    out.files.append(meta_file)
    out.trusted_pickle |= meta.trusted_pickle
    out.step = _global_step(meta.root, meta_file)
    version = meta.root.get(VERSION_KEY)
    out.description.insert(
        0, f"Lightning sharded checkpoint"
        f"{f' (Lightning {version})' if isinstance(version, str) else ''}: "
        f"{len(out.weights or {})} weights, {len(out.optimizers)} optimizer state(s)")
    return out.finish()


def write_back(contents: Contents):
    """For clip: a sharded folder is written back as the DCP folder it is (a ``.ckpt`` file
    as a file, as ``layouts.write_back`` does for any)."""
    return dcp.write_back(contents)


def _global_step(root: Mapping, path: Path) -> int | None:
    value = root.get("global_step")
    step = step_value(value)
    if value is not None and step is None:
        raise InputError(f"{path}: Lightning 'global_step' is {excerpt(value)}, not a step count")
    return step


def claims(root: Any) -> bool:
    """True for a Lightning checkpoint's top level."""
    return (isinstance(root, Mapping) and isinstance(root.get("state_dict"), Mapping)
            and (VERSION_KEY in root or isinstance(root.get("optimizer_states"), list)))


def contents(ckpt: Checkpoint, *, key: str | None) -> Draft:
    root = ckpt.root
    path = ckpt.path
    out = Draft(path=path, kind=KIND, files=[path], checkpoint=ckpt,
                trusted_pickle=ckpt.trusted_pickle)
    # Modules may keep non-tensor extra state in a state_dict; only tensors are weights.
    weights = {k: v for k, v in root["state_dict"].items() if isinstance(v, torch.Tensor)}
    # Gradients only where the file holds a gradient mapping: the state_dict
    # itself is the model, never taken for gradients.
    # An explicit --key reaches anywhere in the file (optimizer_states.0.state).
    rest = {k: v for k, v in root.items() if k not in ("state_dict", "optimizer_states")}
    fill_from_root(out, root if key is not None else rest, path, key)
    out.weights = stored({str(k): v for k, v in weights.items()}, path)
    states = root.get("optimizer_states", [])
    if not isinstance(states, list):
        raise InputError(f"{path}: Lightning 'optimizer_states' is not a list")
    if out.keyed != roles.OPTIMIZER_STATE:
        # Every optimizer, each named by the --key that measures it alone (a GAN's two of
        # different kinds, which no one rule measures together); --key optimizer_states.N
        # keeps the one fill_from_root took, mapped onto the model's names all the same.
        out.optimizers = [
            optimizer_state(state, path, f"optimizer_states[{i}]",
                            key if locate.names_alone(root, key, state) else None)
            for i, state in enumerate(states) for key in [f"optimizer_states.{i}"]]
    out.step = _global_step(root, path)
    out.say(wording(*(Found(role, FILES, (entry,), "Lightning's") for role, entry in (
        (roles.WEIGHT, "state_dict"), (roles.OPTIMIZER_STATE, "optimizer_states"))
        if role not in out.evidence)))
    version = root.get(VERSION_KEY)
    out.description.append(
        f"Lightning checkpoint{f' (Lightning {version})' if isinstance(version, str) else ''}: "
        f"{len(weights)} weights, {len(states)} optimizer state(s)")
    return out
