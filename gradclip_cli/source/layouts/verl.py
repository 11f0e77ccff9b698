"""verl's FSDP checkpoints: a folder as verl's ``FSDPCheckpointManager`` writes it.

``verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager.save_checkpoint``
(verl 0.9.1) has every rank of a world of ``W`` write its own files into one
folder (verl's trainer: ``global_step_N/actor/``):

* ``model_world_size_W_rank_R.pt``: ``torch.save`` of the model's sharded
  ``state_dict()``;
* ``optim_world_size_W_rank_R.pt``: of the optimizer's ``state_dict()`` (torch's
  ``{"state": {id: ...}, "param_groups": [...]}``);
* ``extra_state_world_size_W_rank_R.pt``: the LR scheduler and the RNG states
  (not read);

and rank 0 ``fsdp_config.json`` (``FSDP_version``, ``world_size``) and
``huggingface/`` (the model's config). Under FSDP2 (``fully_shard``) each
parameter and moment is a ``DTensor``: read as the rank's shard and its place in
the full tensor (``files/dtensor_pickle``), never unpickled as torch's class.
The ranks' shards are the pieces of one ``StoredTensor`` each, checked to tile
it exactly; a replicated copy counts once. FSDP1's files (``ShardedTensor``)
are refused, saying so.

What is measured: the weights, and the optimizer's moments as torch's AdamW
state (ids in the model's order, as torch numbers them). A verl checkpoint
saves no gradients. Recognised by content: a folder holding
``model_world_size_W_rank_R.pt`` files. The step is N of the parent folder's
name ``global_step_N``, verl's trainer's.

One rank's model or optimizer file given alone is refused naming the folder
(``rank_file_alone``): its DTensor shards are placed only by all the ranks'
files together.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files.dtensor_pickle import GLOBALS, DTensorShard, placement
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import Checkpoint, Contents, Piece, StoredTensor
from gradclip_cli.source.untrusted import is_count
from gradclip_cli.source.vocabulary import step_after

from .dcp_folder import check_tiling
from .dcp_frameworks import refuse_key
from .draft import Draft
from .facts import FILES, Found, NoGradients, wording
from .paths import inside, read_json
from .torch_optim import optimizer_state

KIND = "verl-fsdp"
_FILE = re.compile(r"(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt")
_CONFIG = "fsdp_config.json"


def recognises(path: Path) -> bool:
    try:
        return os.path.isdir(path) and any(
            (m := _FILE.fullmatch(n)) is not None and m.group(1) == "model"
            for n in os.listdir(path)
        )
    except OSError:
        return False


def rank_file_alone(path: Path) -> str | None:
    """Why one rank's model or optimizer file given alone cannot be measured: it holds that
    rank's shards of each tensor (DTensors), placed only by the folder's files read
    together. None for any other file."""
    found = _FILE.fullmatch(path.name)
    if found is None or found.group(1) == "extra_state" or not os.path.isfile(path):
        return None
    if not recognises(path.parent):
        return None
    return (f"{path}: one rank's file of the verl FSDP checkpoint {path.parent}, whose rank "
            "files hold each tensor's shards, measured only together; give the folder: "
            f"{path.parent}")


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "a verl FSDP checkpoint")
    world, version = _world(path)
    reader = _Reader(path, world, trust_pickle=trust_pickle, verify=verify)
    models = [reader.load("model", rank) for rank in range(world)]
    order = _names(models)
    weights, buffers = {}, {}
    for name in order:
        values = [m.root[name] for m in models]
        if isinstance(values[0], torch.Tensor) and all(
            isinstance(v, torch.Tensor) for v in values
        ):
            buffers[name] = StoredTensor.whole(name, values[0], models[0].path)
        else:
            weights[name] = _joined(name, values, models, "model")
    contents = Draft(
        path=path, kind=KIND, weights=weights or None,
        buffers=buffers or None, trusted_pickle=reader.trusted,
    )
    said = "a verl FSDP checkpoint"
    found = [Found(roles.WEIGHT, FILES, (f"model_world_size_{world}_rank_R.pt",), said,
                   "each rank's shards")]
    optimizers = reader.present("optim")
    if optimizers:
        contents.optimizers.append(_optimizer(reader, world, weights))
        found.append(Found(roles.OPTIMIZER_STATE, FILES, (f"optim_world_size_{world}_rank_R.pt",),
                           said, "torch's optimizer state of each rank's shards"))
    contents.files = list(reader.files)
    contents.step = step_after(path.resolve().parent.name, "global_step_")
    contents.say(wording(*found, NoGradients(path, said, (
        "model and optimizer shards", "extra state"))))
    at = f" at global step {contents.step}" if contents.step is not None else ""
    state = f", optimizer state for {len(contents.optimizers[0].state)} parameters" \
        if contents.optimizers else ", no optimizer state"
    contents.description.append(
        f"verl FSDP{version} checkpoint{at}: {visible(path.name)}/, {world} ranks; "
        f"{len(weights)} sharded model tensors{state}"
    )
    return contents.finish()


def _world(path: Path) -> tuple[int, str]:
    """The world size the files' names give (one for all), checked against
    ``fsdp_config.json`` where verl wrote one, and its FSDP version (``""`` unknown)."""
    sizes: dict[int, str] = {}
    for name in sorted(os.listdir(path)):
        found = _FILE.fullmatch(name)
        if found:
            size, rank = int(found.group(2)), int(found.group(3))
            if rank >= size:
                raise InputError(f"{path / name}: rank {rank} of a world of {size} ranks")
            sizes.setdefault(size, name)
    config = path / _CONFIG
    stated, version = None, ""
    if os.path.isfile(config):
        doc = read_json(inside(path, _CONFIG, named_by=path), what="verl's FSDP config",
                        folder=path)
        stated = doc.get("world_size") if isinstance(doc, Mapping) else None
        fsdp = doc.get("FSDP_version") if isinstance(doc, Mapping) else None
        if not is_count(stated, 1) or fsdp not in (1, 2):
            raise InputError(f"{config}: not verl's FSDP config: no world_size and FSDP_version")
        if fsdp == 1:
            raise InputError(
                f"{config}: an FSDP1 checkpoint (FSDP_version 1): its shards are torch "
                "ShardedTensors, which gradclip does not read; verl's FSDP2 ones it does"
            )
        version = str(fsdp)
    world = stated if stated is not None else min(sizes)
    for size, name in sizes.items():
        if size != world:
            said = f"{_CONFIG} says" if stated is not None else "the folder's other files say"
            raise InputError(
                f"{path / name}: from a world size of {size}, where {said} {world}: "
                "files of two runs in one folder"
            )
    return world, version


class _Reader:
    """The folder's rank files, each loaded with the DTensor stand-ins and checked."""

    def __init__(self, folder: Path, world: int, *, trust_pickle: bool, verify: bool):
        self.folder, self.world = folder, world
        self.trust_pickle, self.verify = trust_pickle, verify
        self.files: list[Path] = []
        self.trusted = False

    def name(self, kind: str, rank: int) -> str:
        return f"{kind}_world_size_{self.world}_rank_{rank}.pt"

    def present(self, kind: str) -> bool:
        """Whether the folder holds ``kind``'s files (then every rank's must be there)."""
        return any(os.path.isfile(self.folder / self.name(kind, r)) for r in range(self.world))

    def load(self, kind: str, rank: int) -> Checkpoint:
        file = inside(self.folder, self.name(kind, rank), named_by=self.folder)
        if not os.path.isfile(file):
            raise InputError(
                f"{file}: missing: rank {rank} of {self.world}'s {kind} shards (every rank "
                "writes its own)"
            )
        with allowing(GLOBALS), _quiet_mesh():
            ckpt = load_checkpoint(file, trust_pickle=self.trust_pickle, verify=self.verify)
        self.files.append(file)
        self.trusted |= ckpt.trusted_pickle
        if not isinstance(ckpt.root, Mapping):
            raise InputError(f"{file}: not a verl FSDP {kind} shard file: not a dict")
        # Real DTensors come from a trusted load, and from torch's own weights-only
        # reader too once torch.distributed.tensor is imported (it allows their
        # classes then): one form for both.
        ckpt.root = _untrusted_form(ckpt.root)
        _check_rank(ckpt, rank, self.world)
        return ckpt


class _quiet_mesh:
    """torch logs a warning when a ``DeviceMesh`` is unpickled before any process group
    (a trusted load's real ``DTensor``s): not the user's business here."""

    def __enter__(self):
        self.logger = logging.getLogger("torch.distributed.device_mesh")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def _untrusted_form(root: Any) -> Any:
    """A trusted load's real ``DTensor``s as the ``DTensorShard`` the restricted reader
    gives, so that both are read by one path."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed: it holds none
        return root

    def shard(value):
        if not isinstance(value, DTensor):
            if isinstance(value, Mapping):
                return {k: shard(v) for k, v in value.items()}
            return value
        out = DTensorShard.__new__(DTensorShard)
        out.local, out.shape, out.dtype = value.to_local(), value.shape, value.dtype
        out.placements = tuple(placement(p) for p in value.placements)
        mesh = value.device_mesh
        out.sizes, out.coordinate = tuple(mesh.shape), mesh.get_coordinate()
        return out

    return shard(root)


def _check_rank(ckpt: Checkpoint, rank: int, world: int) -> None:
    """Every shard of rank ``rank``'s file lies on a mesh of the world's ranks, at the
    file's rank (a copy of another rank's file under this name is refused)."""
    for name, value in _shards(ckpt.root):
        shown = quoted(name)
        other = next((p[1] for p in value.placements if p[0] == "other"), None)
        if other is not None:
            raise InputError(
                f"{ckpt.path}: {shown} is placed {other}, not as FSDP shards "
                "(Shard or Replicate), which is all gradclip reads of a DTensor"
            )
        if value.coordinate is None:
            raise InputError(f"{ckpt.path}: {shown} is a DTensor this rank holds no part of")
        if len(value.sizes) != 1 or value.sizes[0] != world:
            raise InputError(
                f"{ckpt.path}: {shown} lies on a device mesh of {list(value.sizes)} ranks; "
                f"gradclip reads verl's FSDP over one dimension of all {world} ranks"
            )
        if value.coordinate != (rank,):
            raise InputError(
                f"{ckpt.path}: holds the shards of rank {value.coordinate[0]} (its device "
                f"mesh says so), not rank {rank}'s: a file copied under another rank's name"
            )
        if tuple(value.local.shape) != value.box()[1]:
            raise InputError(
                f"{ckpt.path}: {shown}'s shard has the shape {list(value.local.shape)}, where "
                f"its place in the full {list(value.shape)} gives {list(value.box()[1])}"
            )


def _shards(root: Mapping):
    for name, value in root.items():
        if isinstance(value, DTensorShard):
            yield name, value
        elif isinstance(value, Mapping):
            yield from _shards(value)


def _names(models: list[Checkpoint]) -> list[str]:
    """The model's names, rank 0's order; every rank's file names the same tensors."""
    first = list(models[0].root)
    for model in models:
        names = list(model.root)
        if names != first or not all(isinstance(n, str) for n in names):
            extra = [n for n in names if n not in first] or [n for n in first if n not in names]
            which = quoted(extra[0])[:80] if extra else "its names in another order"
            raise InputError(
                f"{model.path}: names other tensors than {models[0].path.name} ({which}): "
                "the ranks' files are not of one model"
            )
    return first


def _joined(name: str, values: list[Any], files: list[Checkpoint], what: str) -> StoredTensor:
    """One tensor from each rank's shard of it: the pieces, checked to tile it once."""
    pieces, boxes = [], []
    for value, ckpt in zip(values, files):
        if not isinstance(value, DTensorShard):
            raise InputError(
                f"{ckpt.path}: {what} entry {quoted(name)} is "
                f"{type(value).__name__}, where {files[0].path.name} holds a DTensor's shard"
            )
        if value.shape != values[0].shape or value.dtype != values[0].dtype:
            raise InputError(
                f"{ckpt.path}: {quoted(name)} is a {list(value.shape)} "
                f"{str(value.dtype).removeprefix('torch.')} tensor, in "
                f"{files[0].path.name} a {list(values[0].shape)} "
                f"{str(values[0].dtype).removeprefix('torch.')} one"
            )
        if value.replica():
            continue
        offsets, sizes = value.box()
        local = value.local
        pieces.append(Piece(offsets, sizes, lambda t=local: t, ckpt.path, local))
        boxes.append((offsets, sizes))
    check_tiling(files[0].path.parent, name, tuple(values[0].shape), boxes)
    return StoredTensor(name, values[0].shape, values[0].dtype, pieces)


def _optimizer(reader: _Reader, world: int, weights: dict[str, StoredTensor]):
    """torch's optimizer state of each rank, as one: rank 0's groups and steps, each
    moment joined from every rank's shard of it."""
    files = [reader.load("optim", rank) for rank in range(world)]
    first = optimizer_state(files[0].root, files[0].path, "the file")
    for ckpt in files[1:]:
        other = optimizer_state(ckpt.root, ckpt.path, "the file")
        if [g["params"] for g in other.param_groups] != \
                [g["params"] for g in first.param_groups] or \
                {p: sorted(s) for p, s in other.state.items()} != \
                {p: sorted(s) for p, s in first.state.items()}:
            raise InputError(
                f"{ckpt.path}: its optimizer state holds other parameters or quantities than "
                f"{files[0].path.name}'s: the ranks' files are not of one optimizer"
            )
    shapes = [w.shape for w in weights.values()]
    for pid, entry in first.state.items():
        for quantity, value in entry.items():
            if isinstance(value, DTensorShard):
                values = [f.root["state"][pid][quantity] for f in files]
                joined = _joined(f"{pid}.{quantity}", values, files, "optimizer")
                if pid < len(shapes) and joined.shape != shapes[pid]:
                    raise InputError(
                        f"{files[0].path}: parameter {pid}'s {quantity} has the shape "
                        f"{list(joined.shape)}, the model's parameter {pid} {list(shapes[pid])}"
                    )
                entry[quantity] = joined
    return first
