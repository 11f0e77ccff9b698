"""What the DCP-based pretraining frameworks (torchtitan, OLMo-core, Megatron) share.

Each of them saves with ``torch.distributed.checkpoint`` but lays its state
dict out its own way; the layouts ``torchtitan``, ``olmo_core`` and
``megatron`` read the folder through ``read_folder`` (the DCP folder reader
of ``layouts/dcp_folder.py``: every file inside the folder, byte ranges checked,
chunks tiling their tensors) and name what the keys hold with the helpers
here:

* ``fqn_optimizer``: an optimizer state flattened by parameter name, as
  torchtitan's ``get_flat_optim_state_dict`` writes it
  (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``: each parameter's
  hyperparameters repeated under its own name) and OLMo-core's
  ``optim.state.<fqn>.exp_avg`` (``get_optimizer_state_dict`` with
  ``flatten_optimizer_state_dict``);
* ``fused_weights``: torchtitan's fused ``wqkv``, whose optimizer state is
  keyed by the fused parameter while the model's state dict stores it split
  as ``wq``/``wk``/``wv`` (``FusedQKVLinear._split_qkv_on_save``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.dcp_metadata import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    DcpMetadata,
    read_dcp_metadata,
)
from gradclip_cli.source.files.small_file import read_small_file
from gradclip_cli.source.files.verify import verify_torch_zip
from gradclip_cli.source.interface import OptimizerState, Piece, StoredTensor

from . import dcp_folder


@dataclass
class Folder:
    """A DCP folder, checked: its metadata, files, tensors and each key's path."""

    meta_file: Path
    meta: DcpMetadata
    files: dict[str, Path]
    tensors: dict[str, StoredTensor]
    paths: dict[str, tuple]

    def value(self, key: str):
        """A small entry's value: a bytes value unpickled (restricted), or a tensor read."""
        return dcp_folder._value(self.meta, key, self.tensors, self.files)

    def all_files(self) -> list[Path]:
        return [self.meta_file, *sorted(set(self.files.values()))]


def metadata(meta_file: Path, *, trust_pickle: bool = False) -> DcpMetadata:
    """``read_dcp_metadata``, remembered for the file as it is now (size, mtime): a layout
    that recognises a folder by its planner records reads the metadata once, not twice."""
    try:
        info = os.stat(meta_file)
        stamp = (os.path.realpath(meta_file), info.st_size, info.st_mtime_ns, info.st_ino)
    except OSError:
        return read_dcp_metadata(meta_file, meta_file.parent, trust_pickle=trust_pickle)
    cached = _CACHE.get(stamp)
    if cached is None or (cached.trusted and not trust_pickle):  # never bypass a refusal
        cached = read_dcp_metadata(meta_file, meta_file.parent, trust_pickle=trust_pickle)
        _CACHE.clear()  # one folder at a time is all recognition and opening need
        _CACHE[stamp] = cached
    return cached


_CACHE: dict[tuple, DcpMetadata] = {}


def names_all(meta_file: Path, marks: tuple[bytes, ...]) -> bool:
    """Whether the metadata's bytes hold every one of ``marks`` (key names, for recognising a
    metadata file the restricted reader refuses), bounded as the reader is."""
    try:
        data = read_small_file(meta_file, limit=MAX_METADATA_BYTES, what="DCP metadata")
    except InputError:
        return False
    return all(mark in data for mark in marks)


def read_folder(folder: Path, *, verify: bool, trust_pickle: bool = False) -> Folder:
    """Open the DCP folder ``folder`` (its ``.metadata`` and the files it names), checked."""
    meta_file = folder / METADATA_NAME
    meta = metadata(meta_file, trust_pickle=trust_pickle)
    files = dcp_folder._files(meta, folder)
    dcp_folder._check_byte_ranges(meta, files)
    if verify:
        for location in meta.locations.values():
            verify_torch_zip(files[location.relative_path], (location.offset, location.length))
    tensors = {
        k: dcp_folder._stored(meta, k, e, files)
        for k, e in meta.entries.items()
        if not isinstance(e, str)
    }
    paths = {k: tuple(meta.paths.get(k, (k,))) for k in meta.entries}
    return Folder(meta_file, meta, files, tensors, paths)


def renamed(tensor: StoredTensor, name: str) -> StoredTensor:
    return StoredTensor(name, tensor.shape, tensor.dtype, tensor.pieces, flat=tensor.flat)


def fqn_optimizer(folder: Folder, entries: dict[str, str]) -> OptimizerState | None:
    """An optimizer state flattened by parameter name.

    ``entries`` maps each DCP key of the optimizer to its name inside the
    optimizer's flat dict (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``).
    The parameter is what lies between the prefix and the last dotted part
    (the state key or hyperparameter, which hold no dots). Parameters whose
    hyperparameters are equal form one param group, in the order they appear.
    """
    where = folder.meta_file
    state: dict[str, dict] = {}
    hyper: dict[str, dict] = {}
    for key, inner in entries.items():
        head, _, rest = inner.partition(".")
        fqn, _, name = rest.rpartition(".")
        if head not in ("state", "param_groups") or not fqn or not name:
            raise InputError(
                f"{where}: optimizer entry {visible(repr(key))} is not "
                "state.<parameter>.<key> or param_groups.<parameter>.<key>"
            )
        if head == "state":
            tensor = folder.tensors.get(key)
            if tensor is not None and tensor.shape:
                state.setdefault(fqn, {})[name] = renamed(tensor, f"{fqn}.{name}")
            else:  # a 0-dim step, or a bytes value
                state.setdefault(fqn, {})[name] = folder.value(key)
        else:
            hyper.setdefault(fqn, {})[name] = folder.value(key)
    if not state and not hyper:
        return None
    for fqn in state:
        if fqn not in hyper:
            raise InputError(
                f"{where}: the optimizer holds state for {visible(repr(fqn))} "
                "but no hyperparameters (param_groups) for it"
            )
    groups: list[dict] = []
    keyed: dict[str, int] = {}
    ids = {fqn: i for i, fqn in enumerate(hyper)}
    for fqn, values in hyper.items():
        signature = repr(sorted(values.items()))
        if signature not in keyed:
            keyed[signature] = len(groups)
            groups.append({**values, "params": []})
        groups[keyed[signature]]["params"].append(ids[fqn])
    return OptimizerState(
        groups, {ids[f]: s for f, s in state.items()}, {i: f for f, i in ids.items()}, where
    )


# --------------------------------------------------------------------- fused qkv


_SPLIT = ("wq", "wk", "wv")


def fused_weights(
    optimizer: OptimizerState | None, weights: dict[str, StoredTensor]
) -> tuple[dict[str, StoredTensor], list[str]]:
    """The weights of each fused ``wqkv`` parameter the optimizer names, from ``wq/wk/wv``.

    torchtitan's ``FusedQKVLinear`` trains one ``wqkv`` but saves it split:
    the rows of each key-value group interleaved (``reshape(n_kv, r,
    head_dim, dim)``), so which row goes where needs ``head_dim``, which the
    checkpoint does not record. A norm does not depend on the order of the
    elements, though: ``wq``, ``wk`` and ``wv`` together are exactly the
    fused parameter's elements, so the fused weight is given as their
    elements end to end (a flat ``StoredTensor``, good for norms and not for
    element-wise use) and its ``ratio`` is exact. Returns those weights by
    the optimizer's name, and a sentence for each fused parameter that could
    not be matched, saying why.
    """
    found: dict[str, StoredTensor] = {}
    notes: list[str] = []
    if optimizer is None or optimizer.param_names is None:
        return found, notes
    for pid, name in optimizer.param_names.items():
        module, _, param = name.rpartition(".")
        if name in weights or not module.endswith("wqkv"):
            continue
        base = module[: -len("wqkv")]
        parts = [weights.get(f"{base}{w}.{param}") for w in _SPLIT]
        moment = optimizer.state.get(pid, {}).get("exp_avg")
        why = _why_not_fused(parts, moment)
        if why:
            notes.append(f"no ratio for {name}: {why}")
            continue
        found[name] = _end_to_end(name, tuple(moment.shape), parts)
    return found, notes


def _why_not_fused(parts, moment) -> str | None:
    if any(p is None for p in parts):
        return "the weights hold no wq, wk and wv beside it"
    if not isinstance(moment, StoredTensor):
        return "its optimizer state holds no exp_avg"
    if sum(p.numel() for p in parts) != moment.numel():
        return (
            f"wq, wk and wv hold {sum(p.numel() for p in parts)} elements, its "
            f"optimizer state {moment.numel()}"
        )
    if any(p.dtype != parts[0].dtype for p in parts):
        return "wq, wk and wv differ in dtype"
    if any(not _rows(p) for p in parts):
        return "a chunk of wq, wk or wv is not a block of whole rows"
    return None


def _rows(tensor: StoredTensor) -> bool:
    """Whether every piece spans the trailing dimensions whole (a contiguous flat range)."""
    return tensor.flat or all(
        piece.offsets[1:] == (0,) * (len(piece.offsets) - 1)
        and piece.shape[1:] == tuple(tensor.shape[1:])
        for piece in tensor.pieces
    )


def _end_to_end(name: str, shape: tuple[int, ...], parts: list[StoredTensor]) -> StoredTensor:
    pieces = []
    start = 0
    for part in parts:
        row = part.numel() // part.shape[0] if part.shape and part.shape[0] else 1
        for piece in part.pieces:
            first = piece.offsets[0] * row if not part.flat else piece.offsets[0]
            pieces.append(
                Piece((start + first,), (piece.numel,), _flattened(piece.read), piece.file)
            )
        start += part.numel()
    return StoredTensor(name, shape, parts[0].dtype, pieces, flat=True)


def _flattened(read):
    return lambda: read().reshape(-1)


def refuse_key(path: Path, key: str | None, what: str) -> None:
    """``--key`` finds saved gradients; these frameworks save none, and their weights and
    optimizer state are named by the layout, so a ``--key`` would only mislabel them."""
    if key is not None:
        raise InputError(
            f"{path}: --key {visible(repr(key))}: {what} saves no gradients and "
            "gradclip names its weights and optimizer state itself: drop --key "
            "(--what chooses what is measured)"
        )


def step_folder_number(path: Path, prefix: str) -> int | None:
    """N of a folder named ``<prefix>N`` (``step-3``, ``step3``), else None."""
    name = os.path.basename(os.path.normpath(path))
    number = name.removeprefix(prefix)
    return int(number) if name.startswith(prefix) and number.isdigit() else None


def int_value(value, where: Path, what: str) -> int:
    """A step count read from a checkpoint: a non-negative int (a 1-element tensor too)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{where}: {what} is {visible(repr(value))[:60]}, not a step count")
    return value
