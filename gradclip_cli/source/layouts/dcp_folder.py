"""The DCP folder reader: one ``torch.distributed.checkpoint`` folder, checked, its
tensors read chunk by chunk when measured.

The one building block for every layout that ``dcp.save`` writes: the
``dcp`` layout itself, Lightning's sharded checkpoints (``lightning``),
accelerate's FSDP folders (``accelerate_fsdp``), Megatron's ``torch_dist``
(``megatron``), ``torchtitan`` and ``olmo_core`` (the last three with the
helpers of ``dcp_frameworks`` for their flattened optimizer layout). This
module knows DCP's own format only; what the keys of the saved state dict
*mean* (which top-level key is the model, the optimizer, the gradients) is
each layout's to say. The interface::

    folder = read_folder(path, verify=False)   # a folder, or its .metadata
    folder.meta           # the checked metadata (files/dcp_metadata's DcpMetadata)
    folder.tensors        # flattened key -> StoredTensor (its chunks, read on demand)
    folder.paths          # flattened key -> its path in the saved nested state dict
    folder.tops()         # the top-level keys, in order
    folder.under("model") # the tensors under a top-level key, named by the rest of the path
    folder.optimizer("optim")   # get_state_dict's optimizer state under a top-level key
    folder.value(key)     # a small entry (a bytes value unpickled, or a tensor read whole)
    folder.step(key)      # an entry that holds a step count
    folder.files          # every file read: .metadata, then the data files
    folder.data_files     # the data files by the name .metadata gives them

    read_metadata(file)   # the checked metadata alone, remembered for read_folder
    names_all(file, marks)  # whether a (refused) metadata file's bytes name every mark

``dcp.save`` (FSDP2, torchtitan, accelerate) writes one ``.metadata`` pickle
listing every flattened state-dict key: a tensor's dtype, full size and
chunks (an FSDP2 shard of a parameter is one chunk), or a bytes value (any
other object), and where each chunk's ``torch.save`` blob lies:
``(relative_path, offset, length)`` inside a ``.distcp`` file.

The metadata is read by ``files/dcp_metadata`` (an allow-list unpickler:
nothing from the file runs), every blob by the restricted ``torch.save``
reader at its byte range, mapped. Before any blob is read the folder is
checked: every file named stays inside the folder and exists, every byte
range lies inside its file and overlaps no other, and each tensor's chunks
tile it exactly (a chunk listed twice, as replicated state may be, counts
once). A tensor becomes a ``StoredTensor`` whose pieces are its chunks, read
when measured: memory stays bounded by the largest chunk.

The planner records each key's path in the nested state dict:
``get_state_dict`` gives the model under ``model`` (``model.<fqn>``), the
optimizer keyed by parameter name (``optim.state.<fqn>.exp_avg``,
``optim.param_groups.<i>.lr``, with ``params`` the group's names).
"""

from __future__ import annotations

import builtins
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from gradclip_cli.errors import InputError, UnsafeCheckpointError
from gradclip_cli.source.files.dcp_metadata import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    Chunk,
    DcpMetadata,
    Location,
    TensorEntry,
    looks_like_dcp_metadata,
    read_dcp_metadata,
)
from gradclip_cli.source.files.small_file import quoted, read_small_file
from gradclip_cli.source.files.torch_zip_reader import (
    restricted_read,
    storage_patch,
)
from gradclip_cli.source.files.verify import verify_torch_zip
from gradclip_cli.source.files.weights_pickle import Outside
from gradclip_cli.source.interface import (
    Contents,
    FileWrite,
    OptimizerState,
    Piece,
    StorageBytes,
    StoredTensor,
    WriteBack,
    WriteBackPlan,
)
from gradclip_cli.source.untrusted import is_int
from gradclip_cli.source.vocabulary import step_value

from . import tiling
from .paths import inside

__all__ = ["DcpFolder", "METADATA_NAME", "check_tiling", "hold_gradient_chunks",
           "names_all", "piece_name", "read_folder", "read_metadata", "recognises", "renamed"]


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


@dataclass
class DcpFolder:
    """One DCP folder, read and checked (``read_folder``); tensors are read when measured."""

    metadata_file: Path
    folder: Path
    meta: DcpMetadata
    data_files: dict[str, Path]  # relative name in .metadata -> the file
    tensors: dict[str, StoredTensor]  # flattened key -> its chunks
    paths: dict[str, tuple]  # flattened key -> its path in the saved state dict
    trusted: bool = False  # .metadata was read with --trust-pickle (full unpickling)

    @property
    def files(self) -> list[Path]:
        """Every file read: ``.metadata``, then each data file once, by name."""
        return [self.metadata_file, *sorted(set(self.data_files.values()))]

    @property
    def chunk_count(self) -> int:
        return sum(len(t.pieces) for t in self.tensors.values())

    def tops(self) -> list[str]:
        """The top-level keys of the saved state dict, in order."""
        return list(dict.fromkeys(str(p[0]) for p in self.paths.values()))

    def holds(self, top: str) -> bool:
        """Whether any tensor or value sits under the top-level key ``top``."""
        return any(p[0] == top and len(p) > 1 for p in self.paths.values())

    def under(self, top: str) -> dict[str, StoredTensor]:
        """The tensors under the top-level key ``top``, each named by the rest of its path."""
        return {n: renamed(self.tensors[k], n) for k, n in (
            (k, ".".join(map(str, p[1:]))) for k, p in self.paths.items()
            if p[0] == top and len(p) > 1 and k in self.tensors)}

    def holds_optimizer_state(self, top: str) -> bool:
        """Whether ``top`` holds an optimizer state dict's ``state`` or ``param_groups``."""
        return any(p[0] == top and len(p) > 2 and p[1] in ("state", "param_groups")
                   for p in self.paths.values())

    def optimizer(self, top: str) -> OptimizerState:
        """``get_state_dict``'s optimizer state (or a plain ``optimizer.state_dict()``)
        saved under ``top``; moments stay chunked, 0-dim entries (``step``) are read now."""
        return _optimizer(self.meta, top, self.paths, self.tensors, self.data_files)

    def value(self, key: str):
        """A small entry's value: a bytes value unpickled (restricted), or a tensor read whole."""
        return _value(self.meta, key, self.tensors, self.data_files)

    def step(self, key: str) -> int:
        """The step count stored at ``key``; ``InputError`` if it holds anything else."""
        return _step(self.meta, key, self.tensors, self.data_files)


def read_folder(path: Path, *, verify: bool = False, trust_pickle: bool = False) -> DcpFolder:
    """Read a DCP folder (or its ``.metadata`` given itself) and check its layout.

    ``verify``: also check every blob's stored CRC32s (``--verify``);
    ``trust_pickle``: as ``files/dcp_metadata`` takes it. Every failure is an
    ``InputError`` naming the file.
    """
    meta_file = path / METADATA_NAME if os.path.isdir(path) else path
    meta = read_metadata(meta_file, in_folder=os.path.isdir(path), trust_pickle=trust_pickle)
    files = _files(meta, meta_file.parent)
    _check_byte_ranges(meta, files)
    if verify:
        for location in meta.locations.values():
            verify_torch_zip(files[location.relative_path],
                             (location.offset, location.length))
    tensors = {k: _stored(meta, k, e, files) for k, e in meta.entries.items()
               if isinstance(e, TensorEntry)}
    paths = {k: tuple(meta.paths.get(k, (k,))) for k in meta.entries}
    return DcpFolder(meta_file, meta_file.parent, meta, files, tensors, paths, meta.trusted)


def read_metadata(meta_file: Path, *, in_folder: bool = True,
                  trust_pickle: bool = False) -> DcpMetadata:
    """``read_dcp_metadata`` of ``meta_file``, remembered while the file's bytes stay the
    same: a layout that recognises a folder by its planner records (``torchtitan``) reads
    the metadata once, not once to recognise and again in ``read_folder``.

    ``in_folder``: the file was found in its checkpoint's folder (its real path must stay
    inside, ``read_dcp_metadata``'s ``folder``), not named by the user.
    """
    folder = meta_file.parent if in_folder else None
    try:
        # Compared by content, not by size and mtime: a file rewritten within the
        # filesystem's timestamp granularity would otherwise be taken for the old one.
        data = read_small_file(meta_file, limit=MAX_METADATA_BYTES, what="DCP metadata",
                               folder=folder)
    except InputError:
        return read_dcp_metadata(meta_file, folder, trust_pickle=trust_pickle)
    key = (os.path.realpath(meta_file), in_folder)
    cached = _METADATA.get(key)
    if cached is None or cached[0] != data or (cached[1].trusted and not trust_pickle):
        meta = read_dcp_metadata(meta_file, folder, trust_pickle=trust_pickle)
        _METADATA.clear()  # one folder at a time is all recognition and opening need
        _METADATA[key] = (data, meta)  # never bypasses a refusal: a refused read raised
        return meta
    return cached[1]


_METADATA: dict[tuple, tuple[bytes, DcpMetadata]] = {}


def names_all(meta_file: Path, marks: tuple[bytes, ...]) -> bool:
    """Whether the metadata's bytes hold every one of ``marks`` (key names, for recognising a
    metadata file the restricted reader refuses), bounded as the reader is."""
    try:
        data = read_small_file(meta_file, limit=MAX_METADATA_BYTES, what="DCP metadata")
    except InputError:
        return False
    return all(mark in data for mark in marks)


def renamed(tensor: StoredTensor, name: str) -> StoredTensor:
    """``tensor`` under another name, the same chunks."""
    return StoredTensor(name, tensor.shape, tensor.dtype, tensor.pieces, flat=tensor.flat)


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
                    f"{file}: truncated: {meta.path.name} puts '{fqn}' at bytes "
                    f"{start}..{end}, past its end ({size} bytes)")
        for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
            if start < end:
                raise InputError(
                    f"{meta.path}: stores '{first}' and '{second}' "
                    f"in overlapping bytes of {name}")


def _tiling(meta: DcpMetadata, key: str, entry: TensorEntry) -> list[Chunk]:
    """The chunks of ``entry``, each once, checked to cover the tensor exactly."""
    chunks = list(dict.fromkeys(entry.chunks))  # a replicated chunk counts once
    check_tiling(meta.path, key, entry.size, [(c.offsets, c.sizes) for c in chunks])
    return chunks


def check_tiling(where: Path, key: str, size, boxes) -> None:
    """That ``boxes`` (``(offsets, sizes)`` each, distinct) tile a tensor of ``size``
    exactly: none reaches past it, none overlaps another, no element is left out.
    ``InputError`` naming ``where`` otherwise."""
    shown = f"'{key}'"
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


def hold_gradient_chunks(contents: Contents) -> WriteBack:
    """Clip's write-back of a DCP folder: every gradient chunk read into memory, each a
    gradient of its own, and the plan that writes their bytes back.

    The held gradients are one tensor per chunk (named by ``piece_name``),
    each on a private mapping or its own copy, so scaling in place never
    reaches the files. The plan
    copies each ``.distcp`` file holding chunks with every chunk's storage
    bytes written over (``StorageBytes``); every blob must hold exactly one
    stored storage, the chunk's (what ``dcp.save`` writes).
    """
    held: dict[str, StoredTensor] = {}
    by_file: dict[Path, list[StorageBytes]] = {}
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
            label = piece_name(name, tensor, piece)
            held[label] = StoredTensor.whole(label, value, piece.file)
            by_file.setdefault(Path(piece.file), []).append(StorageBytes(
                label, patch.data_start, patch.nbytes, tuple(patch.crc_positions)))
    files = tuple(FileWrite(file, None, tuple(s.tensor for s in found), storages=tuple(found))
                  for file, found in sorted(by_file.items()))
    counted = sum(1 for t in (contents.gradients or {}).values() if t.pieces)
    return WriteBack(WriteBackPlan(contents.folder, files, counted), held)


def piece_name(name: str, tensor: StoredTensor, piece: Piece) -> str:
    """The name a held piece of ``tensor`` (named ``name``) goes by: ``name`` where the tensor
    is one piece, else ``name[offsets]`` (``name[0,128]``), one name per place."""
    return name if len(tensor.pieces) == 1 else f"{name}[{','.join(map(str, piece.offsets))}]"


def _stored(meta: DcpMetadata, key: str, entry: TensorEntry,
            files: dict[str, Path]) -> StoredTensor:
    pieces = []
    for chunk in _tiling(meta, key, entry):
        location = meta.locations.get((key, chunk.offsets))
        if location is None:
            raise InputError(f"{meta.path}: lists a chunk of '{key}' at "
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
                             f"'{key}'")
        return value.detach()
    return read


def _blob(file: Path, location: Location, key: str):
    """The object ``torch.save``'d at ``location`` (a chunk or a bytes value), restricted."""
    span = (location.offset, location.length)
    try:
        return restricted_read(file, span)
    except Outside as outside:
        where = f"{file}: bytes {location.offset}..{location.offset + location.length} " \
                f"('{key}')"
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
        raise InputError(f"{meta.path}: lists '{key}' but not where it is stored")
    return _blob(files[location.relative_path], location, key)


def _optimizer(meta: DcpMetadata, top: str, paths, tensors, files) -> OptimizerState:
    """``get_state_dict``'s optimizer state (or a plain ``optimizer.state_dict()``), flattened."""
    bad = f"{meta.path}: '{top}' is not an optimizer state dict"
    state: dict[object, dict[str, object]] = {}
    groups: dict[int, dict[str, object]] = {}
    for k, p in paths.items():
        if p[0] != top or len(p) < 3:
            continue
        if p[1] == "state":
            if len(p) != 4 or not isinstance(p[3], str):
                raise InputError(f"{bad}: state entry '{k}' is not <param>.<key>")
            entry = state.setdefault(p[2], {})
            tensor = tensors.get(k)
            if tensor is not None and tensor.shape:  # moments; a 0-dim step is read now
                entry[p[3]] = renamed(tensor, f"{p[2]}.{p[3]}")
            else:
                entry[p[3]] = _value(meta, k, tensors, files)
        elif p[1] == "param_groups":
            if len(p) != 4 or not isinstance(p[2], int) or not isinstance(p[3], str):
                raise InputError(f"{bad}: param group entry '{k}' is not "
                                 "<index>.<key>")
            groups.setdefault(p[2], {})[p[3]] = _value(meta, k, tensors, files)
    ids: dict[object, int] = {}
    numbered: set[str] = set()  # ids of a plain state_dict(), not names
    param_groups = []
    for g in sorted(groups):
        group = groups[g]
        params = group.get("params")
        if not isinstance(params, (list, tuple)) or not all(
                isinstance(q, str) or is_int(q) for q in params):
            raise InputError(f"{bad}: param group {g} has no 'params' list of names or ids")
        for q in params:
            if isinstance(q, int):
                # DCP keeps a dict's keys as strings: a plain state_dict()'s state.0 is
                # saved as "0", while its param groups' params list keeps the int 0.
                q = str(q)
                numbered.add(q)
            if q in ids:
                raise InputError(f"{bad}: parameter '{q}' is in two param groups")
            ids[q] = len(ids)
        param_groups.append({**group, "params": [ids[str(q)] for q in params]})
    for q in state:
        if q not in ids:
            raise InputError(f"{bad}: state holds '{q}', which no param group lists")
    names = {i: q for q, i in ids.items() if isinstance(q, str) and q not in numbered}
    return OptimizerState(param_groups, {ids[q]: e for q, e in state.items()},
                          names if len(names) == len(ids) and names else None, meta.path)


def _step(meta: DcpMetadata, key: str, tensors, files) -> int | None:
    value = _value(meta, key, tensors, files)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    step = step_value(value)
    if step is None:
        shown = int(value) if isinstance(value, float) and value.is_integer() else value
        raise InputError(f"{meta.path}: '{key}' is {quoted(shown)}, "
                         "not a step count")
    return step
