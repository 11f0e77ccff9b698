"""DeepSpeed universal checkpoints: what ``ds_to_universal`` writes from a ZeRO checkpoint.

DeepSpeed's converter (``python -m deepspeed.checkpoint.ds_to_universal
--input_folder global_stepN --output_folder OUT``, DeepSpeed 0.19) gathers every
ZeRO partition into one file per parameter and quantity, so that a run can
resume on another number of ranks:

* ``OUT/zero/<name>/fp32.pt``: ``{"param": the fp32 master weight, "cat_dim": ...}``,
  the whole tensor, for every parameter of the module (a frozen one, which has no
  optimizer state, and a buffer too: the converter writes one for each entry of
  the module that has none);
* ``OUT/zero/<name>/exp_avg.pt``, ``exp_avg_sq.pt``: Adam's moments, the same way;
  ``step.pt``: Adam's step, a 0-dim tensor;
* ``OUT/zero/optimizer_state.pt``: the optimizer's common state: ``param_groups``
  (the hyperparameters of each of DeepSpeed's flat groups), the loss scaler and
  the ZeRO stage (DeepSpeed's classes, read as inert stand-ins:
  ``files/deepspeed_pickle``);
* the original ``*model_states.pt`` files, copied: ``param_shapes`` (which
  parameters each group holds, in order), ``buffer_names``, ``global_steps`` and
  the module's tensors (its 16-bit weights under bf16 or fp16; empty under ZeRO 3);
* ``latest_universal`` beside ``OUT``, naming it.

What is measured: the fp32 masters as the weights (checked, where the module
holds a tensor, to round to it: ``master_copy.rounds_to``, the rule the other
mixed-precision layouts keep), and the moments as torch's AdamW state, each
parameter's group taken from ``param_shapes``. A universal checkpoint saves no
gradients. Recognised by content: a folder holding ``zero/optimizer_state.pt``
and a DeepSpeed model state file, or one holding ``latest_universal`` beside
such a folder. A tensor-parallel checkpoint (several ``mp_rank_XX``) is refused:
its ``param_shapes`` give one rank's slices, and which slice the merged tensor
holds where is the converter's ``cat_dim``, not checked here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.interface import Checkpoint, Contents, OptimizerState, StoredTensor

from ..dcp_frameworks import refuse_key
from ..master_copy import rounds_to
from ..paths import inside
from .facts import UNIVERSAL, DeepSpeedFacts, worded
from .reader import (
    MODEL_STATES,
    Reader,
    follow_latest,
    module_state,
    param_shapes,
    recognises_folder,
    shape_group,
)

KIND = "deepspeed-universal"
LATEST = "latest_universal"
_ZERO, _COMMON = "zero", "optimizer_state.pt"
_MOMENTS = ("exp_avg", "exp_avg_sq")
_HOLDS = f"universal checkpoint ({_ZERO}/{_COMMON} beside a DeepSpeed model state file)"


def _is_step_folder(path: Path) -> bool:
    try:
        return os.path.isfile(path / _ZERO / _COMMON) and any(
            MODEL_STATES.fullmatch(n) for n in os.listdir(path)
        )
    except OSError:
        return False


def recognises(path: Path) -> bool:
    """A converted folder, or the folder holding ``latest_universal`` beside one."""
    return recognises_folder(path, LATEST, _is_step_folder)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "a DeepSpeed universal checkpoint")
    named = not _is_step_folder(path)
    folder = follow_latest(path, LATEST, _is_step_folder, _HOLDS) if named else path
    reader = _Universal(folder, trust_pickle=trust_pickle, verify=verify)
    model = reader.model_states()
    groups = reader.hyperparameters()
    shapes = param_shapes(model)
    if len(shapes) != len(groups):
        raise InputError(
            f"{model.path}: param_shapes lists {len(shapes)} groups, the optimizer's "
            f"{_ZERO}/{_COMMON} {len(groups)}: which parameters each group holds cannot be told"
        )
    module, buffers = module_state(model, optional=True)
    ids = {n: i for i, n in enumerate(n for group in shapes for n in group)}
    every = {n: torch.Size(s) for group in shapes for n, s in group.items()}
    # The frozen parameters: ZeRO 2 and 3 list them, ZeRO 1 keeps them in the module alone.
    listed = model.root.get("frozen_param_shapes")
    listed = {} if listed is None else shape_group(listed, model, "frozen_param_shapes", set())
    frozen = {n: torch.Size(s) for n, s in listed.items() if n not in ids}
    frozen.update((n, t.shape) for n, t in module.items() if n not in every and n not in frozen)
    # Converted from ZeRO 3 (an empty module), a frozen parameter has no master written.
    unsaved = [n for n in frozen if not reader.has(n, "fp32")]
    every.update((n, s) for n, s in frozen.items() if n not in unsaved)
    order = [n for n in module if n in every]
    order += [n for n in every if n not in order]  # names a module without them lacks
    weights = {n: reader.master(n, every[n], module.get(n)) for n in order}
    group_of = {n: g for g, group in enumerate(shapes) for n in group}
    optimizer = OptimizerState(
        param_groups=[
            {**hyper, "params": [ids[n] for n in group]} for hyper, group in zip(groups, shapes)
        ],
        state={i: reader.moments(n, every[n], group_of[n]) for n, i in ids.items()},
        param_names={i: n for n, i in ids.items()},
        file=reader.common,
    )
    contents = reader.contents(path, KIND)
    contents.weights = weights
    contents.buffers = buffers or None
    contents.optimizers = [optimizer]
    return worded(contents, DeepSpeedFacts(
        UNIVERSAL, **reader.saved(model), parameters=len(ids), frozen=len(frozen),
        model_files=(model.path.name,), unsaved=tuple(unsaved), named_by=LATEST if named else "",
    ))


class _Universal(Reader):
    """One converted folder: DeepSpeed's reader, with the converter's files by name."""

    def __init__(self, folder: Path, *, trust_pickle: bool, verify: bool):
        super().__init__(folder, trust_pickle=trust_pickle, verify=verify)
        self.common = folder / _ZERO / _COMMON

    def model_states(self) -> Checkpoint:
        found = sorted(
            (m for n in os.listdir(self.folder) if (m := MODEL_STATES.fullmatch(n))),
            key=lambda m: m.group(0),
        )
        if {m.group(2) for m in found} != {"00"}:
            raise InputError(
                f"{self.folder}: holds the model state files of several tensor-parallel ranks "
                "(mp_rank_XX); gradclip reads universal checkpoints of one model-parallel rank"
            )
        return self.load(found[0].group(0))

    def hyperparameters(self) -> list[dict[str, Any]]:
        """The optimizer's groups, without their ``params`` (DeepSpeed's flat group ids)."""
        common = self.load(f"{_ZERO}/{_COMMON}", mapping=False)
        groups = common.root.get("param_groups") if isinstance(common.root, Mapping) else None
        if not isinstance(groups, list) or not groups or not all(
            isinstance(g, Mapping) and all(isinstance(k, str) for k in g) for g in groups
        ):
            raise InputError(f"{self.common}: holds no optimizer param_groups")
        # Converted from ZeRO 3, the files hold no step.pt: the step is each flat group's in
        # the first rank's optimizer state, which the converter keeps here whole.
        state = common.root.get("optimizer_state_dict")
        state = state.get("state") if isinstance(state, Mapping) else None
        self.group_steps = {
            g: entry["step"]
            for g, entry in (state.items() if isinstance(state, Mapping) else ())
            if isinstance(entry, Mapping) and _is_step(entry.get("step"))
        }
        return [{k: v for k, v in g.items() if k != "params"} for g in groups]

    def tensor(self, name: str, quantity: str, shape: torch.Size) -> StoredTensor:
        """``zero/<name>/<quantity>.pt``: an fp32 tensor of ``shape``, under ``param`` (from
        ZeRO 1 and 2), or bare and flat (from ZeRO 3: its elements in row-major order)."""
        ckpt = self.quantity(name, quantity)
        value = ckpt.root.get("param") if isinstance(ckpt.root, Mapping) else ckpt.root
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            raise InputError(f"{ckpt.path}: holds no fp32 tensor")
        if value.shape != shape and not (value.dim() == 1 and value.numel() == shape.numel()):
            raise InputError(
                f"{ckpt.path}: holds a tensor of shape {list(value.shape)}, where the model "
                f"state gives {name} the shape {list(shape)}"
            )
        return StoredTensor.whole(name, value.detach().view(shape), ckpt.path)

    def quantity(self, name: str, quantity: str) -> Checkpoint:
        """``zero/<name>/<quantity>.pt`` loaded (a name from ``param_shapes`` is data)."""
        return self.load(f"{_ZERO}/{name}/{quantity}.pt", named_by=self.folder / _ZERO,
                         mapping=False)

    def has(self, name: str, quantity: str) -> bool:
        file = f"{_ZERO}/{name}/{quantity}.pt"
        return os.path.isfile(inside(self.folder, file, named_by=self.folder / _ZERO))

    def master(self, name: str, shape: torch.Size, module: StoredTensor | None) -> StoredTensor:
        """The fp32 master of ``name``, which rounds to the module's tensor where it holds one
        (``master_copy.rounds_to``)."""
        master = self.tensor(name, "fp32", shape)
        if module is not None and module.numel() and not rounds_to(master.read(), module.read()):
            raise InputError(
                f"{master.pieces[0].file}: rounded to {str(module.dtype).removeprefix('torch.')} "
                f"is not {name} of the model state file: the masters and the module "
                "disagree"
            )
        return master

    def moments(self, name: str, shape: torch.Size, group: int) -> dict[str, Any]:
        state: dict[str, Any] = {q: self.tensor(name, q, shape) for q in _MOMENTS}
        if self.has(name, "step") or group not in self.group_steps:
            ckpt = self.quantity(name, "step")
            if not _is_step(ckpt.root):
                raise InputError(f"{ckpt.path}: holds no step count (a one-element tensor)")
            state["step"] = ckpt.root
        else:
            state["step"] = self.group_steps[group]
        return state


def _is_step(value: Any) -> bool:
    """Adam's step as DeepSpeed saves it: a one-element floating tensor."""
    return (
        isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point
    )
