"""``torch.distributed.checkpoint`` (DCP) folders: ``.metadata`` plus ``__R_N.distcp`` files.

``dcp.save`` (FSDP2, torchtitan, accelerate) writes one ``.metadata`` pickle
listing every flattened state-dict key: a tensor's dtype, full size and
chunks (an FSDP2 shard of a parameter is one chunk), or a bytes value (any
other object), and where each chunk's ``torch.save`` blob lies:
``(relative_path, offset, length)`` inside a ``.distcp`` file. Recognised by
content: a folder holding ``.metadata``, or that file given itself (a pickle
of DCP's ``Metadata``).

The metadata is read by ``files/dcp_metadata`` (an allow-list unpickler:
nothing from the file runs), every blob by the restricted ``torch.save``
reader at its byte range, mapped. Before any blob is read the layout is
checked: every file named stays inside the folder and exists, every byte
range lies inside its file and overlaps no other, and each tensor's chunks
tile it exactly (a chunk listed twice, as replicated state may be, counts
once). A tensor becomes a ``StoredTensor`` whose pieces are its chunks, read
when measured: memory stays bounded by the largest chunk.

What the flattened keys hold comes from the planner's record of each key's
path in the nested state dict: ``get_state_dict`` gives the model under
``model`` (``model.<fqn>``), the optimizer keyed by parameter name
(``optim.state.<fqn>.exp_avg``, ``optim.param_groups.<i>.lr``, with
``params`` the group's names), and saved gradients sit under ``grads``.
"""

from __future__ import annotations

import builtins
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from gradclip_cli.errors import InputError, UnsafeCheckpointError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.dcp_metadata import (
    METADATA_NAME,
    Chunk,
    DcpMetadata,
    Location,
    TensorEntry,
    looks_like_dcp_metadata,
    read_dcp_metadata,
)
from gradclip_cli.source.files.torch_zip_reader import (
    StoragePatch,
    restricted_read,
    storage_patch,
)
from gradclip_cli.source.files.verify import verify_torch_zip
from gradclip_cli.source.files.weights_pickle import Outside
from gradclip_cli.source.interface import Contents, OptimizerState, Piece, StoredTensor
from gradclip_cli.source.locate import GRADIENT_KEYS
from gradclip_cli.source.vocabulary import OPTIMIZER_KEYS, STEP_KEYS, WEIGHT_KEYS

from . import tiling
from .paths import inside

KIND = "dcp"
_STEP_KEYS = STEP_KEYS
_LIGHTNING_OPTIMIZER = re.compile(r"optimizer_\d+")


def recognises(path: Path) -> bool:
    if os.path.isdir(path):
        return os.path.isfile(path / METADATA_NAME)
    try:
        if not os.path.isfile(path):
            return False
        with builtins.open(path, "rb") as file:
            return looks_like_dcp_metadata(file.read(256))
    except OSError:
        return False


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    meta_file = path / METADATA_NAME if os.path.isdir(path) else path
    folder = meta_file.parent
    meta = read_dcp_metadata(meta_file, folder if os.path.isdir(path) else None,
                             trust_pickle=trust_pickle)
    files = _files(meta, folder)
    _check_byte_ranges(meta, files)
    if verify:
        for location in meta.locations.values():
            verify_torch_zip(files[location.relative_path],
                             (location.offset, location.length))
    tensors = {k: _stored(meta, k, e, files) for k, e in meta.entries.items()
               if isinstance(e, TensorEntry)}
    paths = {k: meta.paths.get(k, (k,)) for k in meta.entries}
    contents = Contents(path=path, kind=KIND, files=[meta_file, *sorted(set(files.values()))],
                        index=meta_file, folder=folder, trusted_pickle=meta.trusted)
    contents.weights = _under(paths, tensors, WEIGHT_KEYS)
    _fill_gradients(contents, meta_file, paths, tensors, key)
    for name in _optimizer_tops(paths):
        contents.optimizers.append(_optimizer(meta, name, paths, tensors, files))
    for k, p in paths.items():
        if len(p) == 1 and p[0] in _STEP_KEYS:
            contents.step = _step(meta, k, tensors, files)
            break
    chunks = sum(len(t.pieces) for t in tensors.values())
    held = [what for what, there in (("weights", contents.weights),
                                     ("gradients", contents.gradients),
                                     ("optimizer state", contents.optimizers)) if there]
    step = f" at step {contents.step}" if contents.step is not None else ""
    contents.description.append(
        f"DCP checkpoint{step}: {len(tensors)} tensors, {chunks} chunks, "
        f"{len(set(files.values()))} files; {', '.join(held) or 'no tensors gradclip reads'}")
    return contents


# --------------------------------------------------------------------- checks


def _files(meta: DcpMetadata, folder: Path) -> dict[str, Path]:
    """Every file the metadata names, inside the folder, a regular file."""
    files: dict[str, Path] = {}
    for location in meta.locations.values():
        name = location.relative_path
        if name in files:
            continue
        file = inside(folder, name, named_by=meta.path)
        try:
            info = os.stat(file)
        except FileNotFoundError:
            raise InputError(f"{file}: missing: {meta.path.name} stores chunks in it") from None
        except OSError as error:
            raise InputError(f"{file}: cannot read: {error.strerror or error}") from None
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{file}: not a regular file; {meta.path.name} stores chunks in it")
        files[name] = file
    return files


def _check_byte_ranges(meta: DcpMetadata, files: dict[str, Path]) -> None:
    """Every blob inside its file, and no two blobs sharing a byte."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for (fqn, _), location in meta.locations.items():
        by_file.setdefault(location.relative_path, []).append(
            (location.offset, location.offset + location.length, fqn))
    for name, ranges in by_file.items():
        file = files[name]
        size = os.stat(file).st_size
        ranges.sort()
        for start, end, fqn in ranges:
            if end > size:
                raise InputError(
                    f"{file}: truncated: {meta.path.name} puts {visible(repr(fqn))} at bytes "
                    f"{start}..{end}, past its end ({size} bytes)")
        for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
            if start < end:
                raise InputError(
                    f"{meta.path}: stores {visible(repr(first))} and {visible(repr(second))} "
                    f"in overlapping bytes of {visible(name)}")


def _tiling(meta: DcpMetadata, key: str, entry: TensorEntry) -> list[Chunk]:
    """The chunks of ``entry``, each once, checked to cover the tensor exactly."""
    chunks = list(dict.fromkeys(entry.chunks))  # a replicated chunk counts once
    check_tiling(meta.path, key, entry.size, [(c.offsets, c.sizes) for c in chunks])
    return chunks


def check_tiling(where: Path, key: str, size, boxes) -> None:
    """That ``boxes`` (``(offsets, sizes)`` each, distinct) tile a tensor of ``size``
    exactly: none reaches past it, none overlaps another, no element is left out.
    ``InputError`` naming ``where`` otherwise."""
    shown = visible(repr(key))
    for offsets, sizes in boxes:
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise InputError(f"{where}: a chunk of {shown} at {list(offsets)} has "
                             f"{len(sizes)} dimensions, the tensor {len(size)}")
        if any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise InputError(f"{where}: a chunk of {shown} at {list(offsets)} "
                             f"reaches past the tensor's size {list(size)}")
    try:
        tiling.check(size, boxes)  # O(n log n): see layouts/tiling.py
    except tiling.Overlap as overlap:
        if overlap.pair is None:
            raise InputError(f"{where}: chunks of {shown} overlap (they hold "
                             f"{sum(math.prod(s) for _, s in boxes)} elements of its "
                             f"{math.prod(size)})") from None
        (a_off, _), (b_off, _) = overlap.pair
        raise InputError(f"{where}: chunks of {shown} at {list(a_off)} and "
                         f"{list(b_off)} overlap") from None
    except tiling.Gap as gap:
        raise InputError(f"{where}: the chunks of {shown} cover {gap.covered} of its "
                         f"{math.prod(size)} elements (a gap)") from None


# --------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _ChunkPiece(Piece):
    """A piece that is a DCP chunk: also says where its blob lies."""

    location: Location | None = None


@dataclass
class HeldChunk:
    """A gradient chunk read into memory for clip, and where its storage's bytes go back."""

    name: str  # the tensor's name (one of its chunks)
    file: Path
    patch: StoragePatch
    tensor: torch.Tensor


def hold_gradient_chunks(contents: Contents) -> None:
    """Read every gradient chunk into memory, each as a gradient of its own, for clip.

    ``contents.gradients`` becomes one held tensor per chunk (a tensor in one
    chunk keeps its name; others are named ``name[offsets]``), each on a
    private mapping or its own copy, so scaling in place never reaches the
    files. ``contents.chunks`` says where each chunk's storage lies, for the
    sink to write the scaled bytes into a copy of the set. Every blob must hold
    exactly one stored storage, the chunk's (what ``dcp.save`` writes).
    """
    held: dict[str, StoredTensor] = {}
    chunks: list[HeldChunk] = []
    for name, tensor in (contents.gradients or {}).items():
        for piece in tensor.pieces:
            assert isinstance(piece, _ChunkPiece) and piece.location is not None
            value = piece.read()
            location = piece.location
            where = f"{piece.file}: bytes {location.offset}..{location.offset + location.length}"
            try:
                patch = storage_patch(piece.file, (location.offset, location.length))
            except Outside as outside:
                raise InputError(f"{where}: cannot be rewritten in place: {outside}") from None
            if patch.nbytes != value.untyped_storage().nbytes():
                raise InputError(f"{where}: the stored storage is not the chunk's")
            label = name if len(tensor.pieces) == 1 else \
                f"{name}[{','.join(map(str, piece.offsets))}]"
            held[label] = StoredTensor.whole(label, value, piece.file)
            chunks.append(HeldChunk(name, piece.file, patch, value))
    contents.gradients = held
    contents.chunks = chunks


def _stored(meta: DcpMetadata, key: str, entry: TensorEntry,
            files: dict[str, Path]) -> StoredTensor:
    pieces = []
    for chunk in _tiling(meta, key, entry):
        location = meta.locations.get((key, chunk.offsets))
        if location is None:
            raise InputError(f"{meta.path}: lists a chunk of {visible(repr(key))} at "
                             f"{list(chunk.offsets)} but not where it is stored")
        file = files[location.relative_path]
        pieces.append(_ChunkPiece(
            chunk.offsets, chunk.sizes,
            _chunk_reader(file, location, key, entry.dtype, chunk.sizes), file,
            location=location))
    return StoredTensor(key, entry.size, entry.dtype, pieces)


def _chunk_reader(file: Path, location: Location, key: str, dtype: torch.dtype,
                  sizes: tuple[int, ...]):
    def read() -> torch.Tensor:
        value = _blob(file, location, key)
        if not isinstance(value, torch.Tensor) or value.dtype != dtype \
                or tuple(value.shape) != sizes:
            got = (f"a {value.dtype} tensor of shape {list(value.shape)}"
                   if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
            raise InputError(f"{file}: bytes {location.offset}..{location.offset + location.length}"
                             f" hold {got}, not the {dtype} chunk {list(sizes)} of "
                             f"{visible(repr(key))}")
        return value.detach()
    return read


def _blob(file: Path, location: Location, key: str):
    """The object ``torch.save``'d at ``location`` (a chunk or a bytes value), restricted."""
    span = (location.offset, location.length)
    try:
        return restricted_read(file, span)
    except Outside as outside:
        where = f"{file}: bytes {location.offset}..{location.offset + location.length} " \
                f"({visible(repr(key))})"
        if outside.unsafe:
            what = f" (it references {outside.culprit})" if outside.culprit else ""
            raise UnsafeCheckpointError(
                f"{where}: refused: needs full unpickling, which can run code{what}") from None
        reason = str(outside)
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        raise InputError(f"{where}: not a readable torch.save blob: {reason}") from None


def _value(meta: DcpMetadata, key: str, tensors: dict[str, StoredTensor],
           files: dict[str, Path]):
    """A small entry's value: a bytes value unpickled, or a tensor read whole."""
    if key in tensors:
        return tensors[key].read()
    location = meta.locations.get((key, None))
    if location is None:
        raise InputError(f"{meta.path}: lists {visible(repr(key))} but not where it is stored")
    return _blob(files[location.relative_path], location, key)


# --------------------------------------------------------------------- what it holds


def _under(paths, tensors: dict[str, StoredTensor], tops) -> dict[str, StoredTensor] | None:
    """Tensors under the first of ``tops`` that holds any, named by the rest of their path."""
    for top in tops:
        found = {".".join(map(str, p[1:])): tensors[k] for k, p in paths.items()
                 if p[0] == top and len(p) > 1 and k in tensors}
        if found:
            return {n: _renamed(t, n) for n, t in found.items()}
    return None


def _renamed(tensor: StoredTensor, name: str) -> StoredTensor:
    return StoredTensor(name, tensor.shape, tensor.dtype, tensor.pieces)


def _fill_gradients(contents: Contents, meta_file: Path, paths, tensors, key) -> None:
    if key is not None:
        wanted = [part for part in key.split(".") if part]
        found = {}
        for k, p in paths.items():
            dotted = [str(part) for part in p]
            # A path part may hold dots itself ("0.weight"): compare dotted names.
            full = ".".join(dotted)
            prefix = ".".join(wanted)
            if k in tensors and full.startswith(prefix + ".") and full != prefix:
                found[full[len(prefix) + 1:]] = tensors[k]
        if not found:
            raise InputError(f"{meta_file}: --key {key!r}: no tensors under it "
                             f"(top-level keys: {_tops(paths)})")
        _set_gradients(contents, found, ".".join(wanted), meta_file)
        return
    present = [g for g in GRADIENT_KEYS if any(p[0] == g and len(p) > 1 for p in paths.values())]
    if len(present) == 1:
        found = {".".join(map(str, p[1:])): tensors[k] for k, p in paths.items()
                 if p[0] == present[0] and len(p) > 1 and k in tensors}
        _set_gradients(contents, found, present[0], meta_file)
        return
    if all(len(p) == 1 for p in paths.values()) and tensors:
        # A flat name -> tensor state dict: the --key rule's "whole file" (and the model).
        _set_gradients(contents, dict(tensors), "", meta_file)
        contents.weights = contents.gradients
        return
    why = "several gradient entries" if present else "no gradients"
    contents.gradient_error = (f"{meta_file}: {why} (top-level keys: {_tops(paths)}); "
                               "--key names the one to read")


def _set_gradients(contents: Contents, found: dict[str, StoredTensor], where: str,
                   meta_file: Path) -> None:
    floating = {n: _renamed(t, n) for n, t in found.items()
                if t.dtype.is_floating_point or t.dtype.is_complex}
    contents.skipped = [n for n in found if n not in floating]
    contents.gradient_key = where
    if floating:
        contents.gradients = floating
    else:
        contents.gradient_error = f"{meta_file}: no floating-point gradients under {where!r}"


def _tops(paths) -> str:
    tops = list(dict.fromkeys(str(p[0]) for p in paths.values()))
    shown = ", ".join(visible(repr(t)) for t in tops[:8])
    return shown + (f" and {len(tops) - 8} more" if len(tops) > 8 else "")


def _optimizer_tops(paths) -> list[str]:
    """The top-level keys holding optimizer state: the first of ``OPTIMIZER_KEYS`` that
    does, else Lightning's ``optimizer_0``, ``optimizer_1``... (one per optimizer)."""
    def holds_state(top: str) -> bool:
        return any(p[0] == top and len(p) > 2 and p[1] in ("state", "param_groups")
                   for p in paths.values())

    for name in OPTIMIZER_KEYS:
        if holds_state(name):
            return [name]
    numbered = {str(p[0]) for p in paths.values() if _LIGHTNING_OPTIMIZER.fullmatch(str(p[0]))}
    return [t for t in sorted(numbered, key=lambda t: int(t.rsplit("_", 1)[1])) if holds_state(t)]


def is_dcp_set(contents: Contents) -> bool:
    """Whether ``contents`` was read from a DCP folder (this layout, or one built on it)."""
    return contents.index is not None and contents.index.name == METADATA_NAME


def _optimizer(meta: DcpMetadata, top: str, paths, tensors, files) -> OptimizerState:
    """``get_state_dict``'s optimizer state (or a plain ``optimizer.state_dict()``), flattened."""
    bad = f"{meta.path}: {visible(repr(top))} is not an optimizer state dict"
    state: dict[object, dict[str, object]] = {}
    groups: dict[int, dict[str, object]] = {}
    for k, p in paths.items():
        if p[0] != top or len(p) < 3:
            continue
        if p[1] == "state":
            if len(p) != 4 or not isinstance(p[3], str):
                raise InputError(f"{bad}: state entry {visible(repr(k))} is not <param>.<key>")
            entry = state.setdefault(p[2], {})
            tensor = tensors.get(k)
            if tensor is not None and tensor.shape:  # moments; a 0-dim step is read now
                entry[p[3]] = _renamed(tensor, f"{p[2]}.{p[3]}")
            else:
                entry[p[3]] = _value(meta, k, tensors, files)
        elif p[1] == "param_groups":
            if len(p) != 4 or not isinstance(p[2], int) or not isinstance(p[3], str):
                raise InputError(f"{bad}: param group entry {visible(repr(k))} is not "
                                 "<index>.<key>")
            groups.setdefault(p[2], {})[p[3]] = _value(meta, k, tensors, files)
    ids: dict[object, int] = {}
    param_groups = []
    for g in sorted(groups):
        group = groups[g]
        params = group.get("params")
        if not isinstance(params, (list, tuple)) or not all(
                isinstance(q, (str, int)) and not isinstance(q, bool) for q in params):
            raise InputError(f"{bad}: param group {g} has no 'params' list of names or ids")
        for q in params:
            if q in ids:
                raise InputError(f"{bad}: parameter {visible(repr(q))} is in two param groups")
            ids[q] = len(ids)
        param_groups.append({**group, "params": [ids[q] for q in params]})
    for q in state:
        if q not in ids:
            raise InputError(f"{bad}: state holds {visible(repr(q))}, which no param group lists")
    names = {i: q for q, i in ids.items() if isinstance(q, str)}
    return OptimizerState(param_groups, {ids[q]: e for q, e in state.items()},
                          names if len(names) == len(ids) and names else None, meta.path)


def _step(meta: DcpMetadata, key: str, tensors, files) -> int | None:
    value = _value(meta, key, tensors, files)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{meta.path}: {visible(repr(key))} is {visible(repr(value))}, "
                         "not a step count")
    return value
