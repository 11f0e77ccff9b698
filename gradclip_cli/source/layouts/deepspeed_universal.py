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
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files import megatron_pickle
from gradclip_cli.source.files.deepspeed_pickle import GLOBALS
from gradclip_cli.source.files.small_file import excerpt
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import Checkpoint, Contents, OptimizerState, StoredTensor
from gradclip_cli.source.untrusted import is_count
from gradclip_cli.source.vocabulary import step_value

from .dcp_frameworks import refuse_key
from .master_copy import rounds_to
from .paths import inside, tagged_folder

KIND = "deepspeed-universal"
LATEST = "latest_universal"
_ZERO, _COMMON = "zero", "optimizer_state.pt"
_MODEL = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_PICKLED = {**megatron_pickle.GLOBALS, **GLOBALS}


def _is_step_folder(path: Path) -> bool:
    try:
        return os.path.isfile(path / _ZERO / _COMMON) and any(
            _MODEL.fullmatch(n) for n in os.listdir(path)
        )
    except OSError:
        return False


def recognises(path: Path) -> bool:
    """A converted folder, or the folder holding ``latest_universal`` beside one."""
    if not os.path.isdir(path):
        return False
    if _is_step_folder(path):
        return True
    try:
        if not os.path.isfile(path / LATEST):
            return False
        with os.scandir(path) as entries:
            return any(e.is_dir() and _is_step_folder(Path(e.path)) for e in entries)
    except OSError:
        return False


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "a DeepSpeed universal checkpoint")
    folder, named = (path, "") if _is_step_folder(path) else (_follow_latest(path), LATEST)
    reader = _Reader(folder, trust_pickle=trust_pickle, verify=verify)
    model = reader.model_states()
    groups = reader.hyperparameters()
    shapes = _param_shapes(model, len(groups))
    module, buffers = _module(model)
    ids = {n: i for i, n in enumerate(n for group in shapes for n in group)}
    every = {n: s for group in shapes for n, s in group.items()}
    # The frozen parameters: ZeRO 2 and 3 list them, ZeRO 1 keeps them in the module alone.
    frozen = {n: s for n, s in _frozen_shapes(model).items() if n not in ids}
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
    contents = Contents(
        path=path,
        kind=KIND,
        files=reader.files,
        weights=weights,
        buffers=buffers or None,
        optimizers=[optimizer],
        trusted_pickle=reader.trusted,
    )
    contents.step = step_value(model.root.get("global_steps"))
    contents.gradient_error = f"{path}: a DeepSpeed universal checkpoint holds no gradients"
    said = f"a DeepSpeed universal checkpoint: {_ZERO}/<name>/"
    contents.evidence[roles.WEIGHT] = f"{said}fp32.pt, the fp32 master weights"
    contents.evidence[roles.OPTIMIZER_STATE] = (
        f"{said}exp_avg.pt and exp_avg_sq.pt; the groups' hyperparameters from "
        f"{_ZERO}/{_COMMON}, their parameters from {model.path.name}'s param_shapes"
    )
    at = f" at global step {contents.step}" if contents.step is not None else ""
    by = f" (named by {LATEST})" if named else ""
    version = model.root.get("ds_version")
    made = f", DeepSpeed {visible(version)}" if isinstance(version, str) else ""
    contents.description.append(
        f"DeepSpeed universal checkpoint{at}: {visible(folder.name)}/{by}{made}; "
        f"{len(ids)} trained parameters with Adam's moments, {len(frozen)} frozen"
    )
    if unsaved:
        contents.description.append(
            f"{len(unsaved)} frozen parameters ({_span(unsaved)}) have no fp32.pt (the "
            "converter writes none for ZeRO 3's frozen parameters): the weights leave them out"
        )
    return contents


def _span(names: list[str]) -> str:
    shown = ", ".join(visible(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _follow_latest(parent: Path) -> Path:
    """The folder ``parent/latest_universal`` names; its content is data, checked as a name."""
    latest = parent / LATEST
    tag, folder = tagged_folder(parent, LATEST)
    if not _is_step_folder(folder):
        raise InputError(
            f"{latest}: names {excerpt(tag)}, which holds no universal checkpoint "
            f"({_ZERO}/{_COMMON} beside a DeepSpeed model state file)"
        )
    return folder


class _Reader:
    """One converted folder: its files, loaded (mapped) and checked as they are read."""

    def __init__(self, folder: Path, *, trust_pickle: bool, verify: bool):
        self.folder = folder
        self.trust_pickle = trust_pickle
        self.verify = verify
        self.files: list[Path] = []
        self.trusted = False
        self.common = folder / _ZERO / _COMMON

    def load(self, name: str, *, named_by: Path) -> Checkpoint:
        file = inside(self.folder, name, named_by=named_by)
        if not os.path.isfile(file):
            raise InputError(f"{file}: missing (the universal checkpoint's other files expect it)")
        with allowing(_PICKLED):
            ckpt = load_checkpoint(file, trust_pickle=self.trust_pickle, verify=self.verify)
        self.files.append(file)
        self.trusted |= ckpt.trusted_pickle
        return ckpt

    def model_states(self) -> Checkpoint:
        found = sorted(
            (m for n in os.listdir(self.folder) if (m := _MODEL.fullmatch(n))),
            key=lambda m: m.group(0),
        )
        if {m.group(1) for m in found} != {"00"}:
            raise InputError(
                f"{self.folder}: holds the model state files of several tensor-parallel ranks "
                "(mp_rank_XX); gradclip reads universal checkpoints of one model-parallel rank"
            )
        model = self.load(found[0].group(0), named_by=self.folder)
        if not isinstance(model.root, Mapping):
            raise InputError(f"{model.path}: not a DeepSpeed model state: not a dict")
        return model

    def hyperparameters(self) -> list[dict[str, Any]]:
        """The optimizer's groups, without their ``params`` (DeepSpeed's flat group ids)."""
        common = self.load(f"{_ZERO}/{_COMMON}", named_by=self.folder)
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
        ckpt = self.load(f"{_ZERO}/{name}/{quantity}.pt", named_by=self.folder / _ZERO)
        value = ckpt.root.get("param") if isinstance(ckpt.root, Mapping) else ckpt.root
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
            raise InputError(f"{ckpt.path}: holds no fp32 tensor")
        if value.shape != shape and not (value.dim() == 1 and value.numel() == shape.numel()):
            raise InputError(
                f"{ckpt.path}: holds a tensor of shape {list(value.shape)}, where the model "
                f"state gives {visible(name)} the shape {list(shape)}"
            )
        return StoredTensor.whole(name, value.detach().view(shape), ckpt.path)

    def has(self, name: str, quantity: str) -> bool:
        return os.path.isfile(
            inside(self.folder, f"{_ZERO}/{name}/{quantity}.pt", named_by=self.folder / _ZERO)
        )

    def master(self, name: str, shape: torch.Size, module: torch.Tensor | None) -> StoredTensor:
        """The fp32 master of ``name``, which rounds to the module's tensor where it holds one."""
        master = self.tensor(name, "fp32", shape)
        if module is not None and module.numel() and not rounds_to(master.read(), module):
            raise InputError(
                f"{master.pieces[0].file}: rounded to {str(module.dtype).removeprefix('torch.')} "
                f"is not {visible(name)} of the model state file: the masters and the module "
                "disagree"
            )
        return master

    def moments(self, name: str, shape: torch.Size, group: int) -> dict[str, Any]:
        state: dict[str, Any] = {q: self.tensor(name, q, shape) for q in _MOMENTS}
        if self.has(name, "step") or group not in self.group_steps:
            ckpt = self.load(f"{_ZERO}/{name}/step.pt", named_by=self.folder / _ZERO)
            if not _is_step(ckpt.root):
                raise InputError(f"{ckpt.path}: holds no step count (a one-element tensor)")
            state["step"] = ckpt.root
        else:
            state["step"] = self.group_steps[group]
        return state


def _param_shapes(model: Checkpoint, groups: int) -> list[dict[str, torch.Size]]:
    """``param_shapes``: each optimizer group's parameters in order, with their shapes."""
    raw = model.root.get("param_shapes")
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise InputError(f"{model.path}: not a DeepSpeed model state: no 'param_shapes'")
    if len(raw) != groups:
        raise InputError(
            f"{model.path}: param_shapes lists {len(raw)} groups, the optimizer's "
            f"{_ZERO}/{_COMMON} {groups}: which parameters each group holds cannot be told"
        )
    seen: set[str] = set()
    out = []
    for group in raw:
        if not isinstance(group, Mapping):
            raise InputError(f"{model.path}: param_shapes holds a group that is not a mapping")
        shaped = {}
        for name, shape in group.items():
            if not isinstance(name, str) or not _is_shape(shape) or name in seen:
                raise InputError(
                    f"{model.path}: param_shapes holds {visible(repr(name))[:60]}, not a "
                    "parameter named once with its shape"
                )
            seen.add(name)
            shaped[name] = torch.Size(shape)
        out.append(shaped)
    return out


def _is_step(value: Any) -> bool:
    """Adam's step as DeepSpeed saves it: a one-element floating tensor."""
    return (
        isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype.is_floating_point
    )


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(is_count(d) for d in value)


def _frozen_shapes(model: Checkpoint) -> dict[str, torch.Size]:
    """The frozen parameters that ``frozen_param_shapes`` lists, with their shapes."""
    frozen = model.root.get("frozen_param_shapes")
    if frozen is None:
        return {}
    if not isinstance(frozen, Mapping) or not all(
        isinstance(n, str) and _is_shape(s) for n, s in frozen.items()
    ):
        raise InputError(f"{model.path}: frozen_param_shapes is not a mapping of names to shapes")
    return {n: torch.Size(s) for n, s in frozen.items()}


def _module(model: Checkpoint) -> tuple[dict[str, torch.Tensor], dict[str, StoredTensor]]:
    """The module's parameters (by name, in its order) and its buffers (``buffer_names``)."""
    module = model.root.get("module")
    if module is None:
        return {}, {}
    listed = model.root.get("buffer_names")
    if not isinstance(module, Mapping) or not isinstance(listed, (list, tuple)):
        raise InputError(f"{model.path}: not a DeepSpeed model state: no module and buffer_names")
    params, buffers = {}, {}
    for name, value in module.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise InputError(
                f"{model.path}: 'module' holds {visible(repr(name))[:60]}, which is not a "
                "named tensor"
            )
        if name in listed or not value.dtype.is_floating_point:
            buffers[name] = StoredTensor.whole(name, value, model.path)
        else:
            params[name] = value
    return params, buffers
