"""The files of a DeepSpeed checkpoint folder, read alike by the ZeRO and universal layouts
(``ds_to_universal`` keeps DeepSpeed's model state files): their names, the restricted
reader they go through, and the model state file's records (``param_shapes``,
``frozen_param_shapes``, the module with ``buffer_names``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files import megatron_pickle
from gradclip_cli.source.files.deepspeed_pickle import GLOBALS
from gradclip_cli.source.files.small_file import excerpt, quoted
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import Checkpoint, StoredTensor
from gradclip_cli.source.untrusted import is_count
from gradclip_cli.source.vocabulary import step_value

from ..draft import Draft
from ..paths import inside, tagged_folder

# A model-parallel rank's model states (``zero_pp_rank_R_`` before it under ZeRO 3):
# group 1 the data-parallel rank, group 2 the model-parallel one.
MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
# A ZeRO optimizer partition. bf16 mixed precision (DeepSpeed's BF16_Optimizer) names its
# rank files bf16_zero_pp_rank_*, with the same content.
OPTIM_STATES = re.compile(r"(?:(bf16_))?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# Without ZeRO (stage 0) a model-parallel rank's one file holds the module and the optimizer.
PLAIN_STATES = re.compile(r"mp_rank_(\d+)_model_states\.pt")
# Pipeline parallelism (deepspeed.pipe.PipelineModule) saves each layer's weights apart: its
# layer index (global, as the module names the layer) and the tensor-parallel rank
# (``-model_XX``, DeepSpeed's topology's rank name) where there is one.
LAYER_STATES = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
# Megatron-DeepSpeed passes Megatron's client state (``args``, an ``argparse.Namespace``;
# numpy RNG state) to ``save_checkpoint``, which keeps it in the model state files: read as
# inert data, as Megatron's own checkpoints are.
PICKLED = {**megatron_pickle.GLOBALS, **GLOBALS}

Shapes = dict[str, tuple[int, ...]]


class Reader:
    """One checkpoint folder: its files, loaded (memory-mapped) and checked, and the list of
    every file read, for the ``Contents`` it becomes."""

    def __init__(self, folder: Path, *, trust_pickle: bool, verify: bool):
        self.folder = folder
        self.trust_pickle = trust_pickle
        self.verify = verify
        self.files: list[Path] = []
        self.trusted = False

    def load(self, name: str, *, named_by: Path | None = None, mapping: bool = True) -> Checkpoint:
        """The file ``name`` in the folder (a name from a file is data: ``named_by`` gave it),
        a dict at the top unless ``mapping`` is False."""
        file = inside(self.folder, name, named_by=named_by or self.folder)
        if not os.path.exists(file):
            raise InputError(f"{file}: missing (the checkpoint's other files expect it)")
        with allowing(PICKLED):
            ckpt = load_checkpoint(file, trust_pickle=self.trust_pickle, verify=self.verify)
        if mapping and not isinstance(ckpt.root, Mapping):
            raise InputError(f"{file}: not a DeepSpeed state file: not a dict")
        self.files.append(file)
        self.trusted |= ckpt.trusted_pickle
        return ckpt

    def saved(self, model: Checkpoint) -> dict[str, Any]:
        """The facts of the folder and of its model state file ``model``: the folder's name,
        DeepSpeed's step (``global_steps``) and version (``ds_version``)."""
        version = model.root.get("ds_version")
        return {"folder": self.folder.name, "step": step_value(model.root.get("global_steps")),
                "version": version if isinstance(version, str) else None}

    def contents(self, given: Path, kind: str) -> Draft:
        """An empty ``Draft`` of ``kind`` for ``given``, naming every file read so far."""
        return Draft(path=given, kind=kind, files=list(self.files), trusted_pickle=self.trusted)


def recognises_folder(path: Path, latest: str, is_step_folder: Callable[[Path], bool]) -> bool:
    """Whether ``path`` is a checkpoint folder (``is_step_folder``) or holds the tag file
    ``latest`` beside one."""
    if not os.path.isdir(path):
        return False
    if is_step_folder(path):
        return True
    try:
        if not os.path.isfile(path / latest):
            return False
        with os.scandir(path) as entries:
            return any(e.is_dir() and is_step_folder(Path(e.path)) for e in entries)
    except OSError:
        return False


def follow_latest(
    parent: Path, latest: str, is_step_folder: Callable[[Path], bool], holds: str
) -> Path:
    """The folder that the tag file ``parent/latest`` names (its content is data, checked like
    any name), refused unless ``is_step_folder``: it should hold ``holds``, in words."""
    file = parent / latest
    tag, folder = tagged_folder(parent, latest)
    if not os.path.isdir(folder):
        raise InputError(f"{file}: names {excerpt(tag)}, which is not a folder here")
    if not is_step_folder(folder):
        raise InputError(f"{file}: names {excerpt(tag)}, which holds no {holds}")
    return folder


def param_shapes(model: Checkpoint) -> list[Shapes]:
    """``param_shapes``: each param group's parameters, in the order DeepSpeed flattened
    them, with their shapes; a name at most once over all groups."""
    raw = model.root.get("param_shapes")
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise InputError(f"{model.path}: not a DeepSpeed model state: no 'param_shapes'")
    seen: set[str] = set()
    return [shape_group(group, model, "param_shapes", seen) for group in raw]


def shape_group(group: Any, model: Checkpoint, key: str, seen: set[str]) -> Shapes:
    """``{name: shape}`` of one group of ``key``, each name new to ``seen`` (then added)."""
    if not isinstance(group, Mapping):
        raise InputError(f"{model.path}: {key} holds a group that is not a mapping")
    shapes = {}
    for name, shape in group.items():
        if not isinstance(name, str) or name in seen:
            raise InputError(
                f"{model.path}: {key} names {quoted(name)} twice or not as a string"
            )
        if not isinstance(shape, (tuple, list)) or not all(
            is_count(d) and d < 1 << 62 for d in shape
        ):
            raise InputError(
                f"{model.path}: {key} gives {name} the shape {quoted(shape)}"
            )
        seen.add(name)
        shapes[name] = tuple(shape)
    return shapes


def module_state(
    model: Checkpoint, *, optional: bool = False
) -> tuple[dict[str, StoredTensor], dict[str, StoredTensor]]:
    """The ``module`` state dict as ``(parameters, buffers)`` (``named_tensors``). A module
    that is absent is refused, or, where ``optional``, read as empty."""
    module = model.root.get("module")
    if module is None and optional:
        return {}, {}
    if not isinstance(module, Mapping) or not (module or optional):
        raise InputError(f"{model.path}: not a DeepSpeed model state: no 'module' state dict")
    return named_tensors(module, buffer_names(model, "module's"), model.path,
                         "'module' holds {}, which is not a named tensor")


def buffer_names(model: Checkpoint, whose: str) -> set[str]:
    """``buffer_names``: which of the (``whose``) state dict's entries are buffers."""
    names = model.root.get("buffer_names")
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InputError(
            f"{model.path}: no buffer_names: which of the {whose} entries are buffers, "
            "not parameters, cannot be told"
        )
    return set(names)


def named_tensors(
    state: Mapping, buffers: set[str], file: Path, refusal: str, prefix: str = ""
) -> tuple[dict[str, StoredTensor], dict[str, StoredTensor]]:
    """A state dict's tensors, named ``prefix`` + key, as ``(parameters, buffers)``, each in
    its order: buffers are the names in ``buffers`` and any integer tensor. An entry that is
    not a named tensor is refused (``refusal``, its ``{}`` the key)."""
    params, held = {}, {}
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise InputError(f"{file}: " + refusal.format(quoted(key)[:60]))
        name = prefix + key
        tensor = StoredTensor.whole(name, value, file)
        if name in buffers or not value.dtype.is_floating_point:
            held[name] = tensor
        else:
            params[name] = tensor
    return params, held


def mp_name(rank: int) -> str:
    """A model-parallel rank as DeepSpeed names its files: ``mp_rank_00``."""
    return f"mp_rank_{rank:02d}"


def span(names: list[str]) -> str:
    """Names for a message: all of two, the first and last of more."""
    return ", ".join(names) if len(names) <= 2 else f"{names[0]} .. {names[-1]}"


def gap(numbers: list[int]) -> int | None:
    """The first of 0, 1, 2... that the sorted rank or stage ``numbers`` lack, where they
    are not exactly 0 .. n-1 (a duplicate counts as a gap after it); else None."""
    if numbers == list(range(len(numbers))):
        return None
    return next(r for r in range(len(numbers) + 1) if r not in numbers)


def complete(folder: Path, numbers: list[int], held: str, what: str) -> None:
    """Refused where the sorted ``numbers`` (``mp_rank_XX``) have a ``gap``: the folder holds
    ``held`` (its ``{}`` the ranks named) but not all of ``what``."""
    if (missing := gap(numbers)) is not None:
        raise InputError(
            f"{folder}: holds {held.format(', '.join(mp_name(r) for r in numbers))} "
            f"but no {mp_name(missing)}: the {what} are incomplete"
        )
