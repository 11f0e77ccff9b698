"""Reading a ``torch.distributed.checkpoint`` (DCP) ``.metadata`` file without running it.

DCP writes ``.metadata`` with ``pickle.dump`` of a ``Metadata`` dataclass, so
``pickle.load`` (what ``FileSystemReader.read_metadata`` does) runs whatever
the file names. Here the pickle runs in ``weights_pickle``'s restricted
unpickler, which hands out, besides ``torch.Size`` and dtypes, only inert
records standing for DCP's own classes (``metadata.Metadata``,
``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
``TensorProperties``, ``MetadataIndex``, ``StorageMeta``,
``_MEM_FORMAT_ENCODING``, ``filesystem._StorageInfo``), ``pathlib`` paths (as
strings) and ``torch.serialization._get_layout`` (as a name). Anything else is
refused before it is called. A record is a bag for the state its pickle gives
it; ``read_dcp_metadata`` then checks every field's type and builds
gradclip's own plain records below, so nothing of torch.distributed is
imported.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gradclip_cli.errors import InputError, UnsafeCheckpointError
from gradclip_cli.source.files.small_file import read_small_file
from gradclip_cli.source.files.weights_pickle import (
    DTypeMarker,
    Outside,
    _Slot,
    allowing,
    pickle_protocol,
    run_restricted,
    unpickle,
)

__all__ = ["Chunk", "DcpMetadata", "Location", "TensorEntry", "looks_like_dcp_metadata",
           "read_dcp_metadata"]

METADATA_NAME = ".metadata"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
_MEGATRON_MODULE = "megatron.core.dist_checkpointing.strategies.torch"
# A 70B model's metadata is a few MB; anything far larger is not one.
MAX_METADATA_BYTES = 1 << 30


# --------------------------------------------------------------------- what gradclip keeps


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of a tensor: where it starts and its extent."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the state dict: dtype, full size and its chunks as listed."""

    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


BYTES = "bytes"  # the entry of a non-tensor value (a torch.save'd object)


@dataclass(frozen=True)
class Location:
    """Where a chunk's (or a bytes value's) blob lies: a file of the folder, and a byte range."""

    relative_path: str
    offset: int
    length: int


@dataclass
class DcpMetadata:
    """A ``.metadata`` file, checked.

    ``entries``: flattened key -> ``TensorEntry`` or ``BYTES``, in the file's
    (the state dict's) order. ``locations``: (key, chunk offsets, or None
    for a bytes value) -> ``Location``. ``paths``: key -> its path in the
    nested state dict as saved (``("optim", "state", "0.weight",
    "exp_avg")``), from the default planner's data; empty when absent.
    """

    path: Path
    entries: dict[str, TensorEntry | str]
    locations: dict[tuple[str, tuple[int, ...] | None], Location]
    paths: dict[str, tuple[str | int, ...]]
    version: str | None
    trusted: bool = False  # read with --trust-pickle's full unpickling


# --------------------------------------------------------------------- what the pickle builds


class _Record:
    """An inert stand-in for one of DCP's classes: holds the state the pickle sets, once."""

    __slots__ = ("state", "args")

    def __new__(cls, *args):
        record = object.__new__(cls)
        record.state = None
        record.args = args
        return record

    def __init__(self, *args):
        pass

    def __setstate__(self, state):
        if self.state is not None:
            raise Outside("state set twice on one record")
        self.state = state

    def __reduce__(self):
        raise Outside("reader objects are not picklable")


class _Metadata(_Record):
    __slots__ = ()


class _TensorStorage(_Record):
    __slots__ = ()


class _BytesStorage(_Record):
    __slots__ = ()


class _ChunkStorage(_Record):
    __slots__ = ()


class _TensorProperties(_Record):
    __slots__ = ()


class _MetadataIndex(_Record):
    __slots__ = ()


class _StorageMeta(_Record):
    __slots__ = ()


class _StorageInfo(_Record):
    __slots__ = ()


class _SavePlan(_Record):
    """A rank's plan (``planner.SavePlan``; Megatron's ``MCoreSavePlan``), kept in
    ``all_local_plans`` by Megatron's torch_dist writer: inert, never read."""

    __slots__ = ()


def _write_item_type(*args):
    # WriteItemType(value): TENSOR, SHARD, BYTE_IO.
    if len(args) != 1 or type(args[0]) is not int or args[0] not in (1, 2, 3):
        raise Outside("unexpected WriteItemType arguments")
    return args[0]


class _Layout:
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


def _memory_format(*args):
    # _MEM_FORMAT_ENCODING(value): contiguous, channels_last, preserve.
    if len(args) != 1 or type(args[0]) is not int or args[0] not in (0, 1, 2):
        raise Outside("unexpected _MEM_FORMAT_ENCODING arguments")
    return args[0]


def _get_layout(*args):
    if len(args) != 1 or type(args[0]) is not str:
        raise Outside("unexpected _get_layout arguments")
    return _Layout(args[0])


def _path(*args):
    if not args or any(type(a) is not str for a in args):
        raise Outside("unexpected path arguments")
    return "/".join(args)


_CLASSES = {
    (_METADATA_MODULE, "Metadata"): _Metadata,
    (_METADATA_MODULE, "TensorStorageMetadata"): _TensorStorage,
    (_METADATA_MODULE, "BytesStorageMetadata"): _BytesStorage,
    (_METADATA_MODULE, "ChunkStorageMetadata"): _ChunkStorage,
    (_METADATA_MODULE, "TensorProperties"): _TensorProperties,
    (_METADATA_MODULE, "MetadataIndex"): _MetadataIndex,
    (_METADATA_MODULE, "StorageMeta"): _StorageMeta,
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): _memory_format,
    (_FILESYSTEM_MODULE, "_StorageInfo"): _StorageInfo,
    # OLMo-core's own storage writer records the same three fields in a class of its own.
    ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): _get_layout,
    # Megatron's torch_dist writer keeps every rank's save plan in the metadata
    # (``all_local_plans``); older ones wrote its own subclasses of DCP's records.
    (_PLANNER_MODULE, "SavePlan"): _SavePlan,
    (_PLANNER_MODULE, "WriteItem"): _SavePlan,
    (_PLANNER_MODULE, "TensorWriteData"): _SavePlan,
    (_PLANNER_MODULE, "WriteItemType"): _write_item_type,
    (_MEGATRON_MODULE, "MCoreSavePlan"): _SavePlan,
    (_MEGATRON_MODULE, "MCoreMetadata"): _Metadata,
    **{("pathlib", name): _path
       for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
}


# --------------------------------------------------------------------- reading


def looks_like_dcp_metadata(head: bytes) -> bool:
    """Whether a file's first bytes open a pickle of DCP's ``Metadata`` (cheap recognition)."""
    return pickle_protocol(head) is not None and _METADATA_MODULE.encode() in head[:256]


def read_dcp_metadata(path: Path, folder: Path | None = None, *,
                      trust_pickle: bool = False) -> DcpMetadata:
    """Read and check ``path`` (a ``.metadata`` file); ``InputError`` naming it otherwise.

    ``folder``: the checkpoint's folder when the layout found the file in it (its
    real path must stay inside, ``small_file``'s rule); None for a file the user named.

    A pickle that imports anything outside the records above is refused
    (``UnsafeCheckpointError``) before anything it names is called, unless
    ``trust_pickle``: then it is unpickled in full (as DCP's own
    ``read_metadata`` does, running what it names) and the objects it builds
    are read field by field into the same checked records.
    """
    if os.path.isdir(path):
        raise InputError(f"{path}: is a directory, not DCP metadata")
    data = read_small_file(path, limit=MAX_METADATA_BYTES, what="DCP metadata", folder=folder)
    if pickle_protocol(data) is None:
        raise InputError(f"{path}: not DCP metadata: not a pickle")
    try:
        with allowing(_CLASSES):
            root = run_restricted(lambda _: unpickle(io.BytesIO(data)))
    except Outside as outside:
        if outside.unsafe and trust_pickle:
            return _trusted(path, data)
        if outside.unsafe:
            what = f" (it references {outside.culprit})" if outside.culprit else ""
            raise UnsafeCheckpointError(
                f"{path}: refused: DCP metadata that names code outside DCP's own records{what}; "
                "nothing from it was run; pass --trust-pickle only if you trust its "
                "source") from None
        raise InputError(f"{path}: not readable DCP metadata: {_short(str(outside))}") from None
    try:
        return _checked(path, root)
    except _Bad as bad:
        raise InputError(f"{path}: not readable DCP metadata: {bad}") from None


class _Bad(Exception):
    """A field of the metadata is not what DCP writes."""


def _fields(record, kind: type, what: str, names: tuple[str, ...]) -> dict:
    if type(record) is not kind or record.args:
        raise _Bad(f"{what} is not a {kind.__name__.lstrip('_')} record")
    state = record.state
    if state is None:
        state = {}
    if type(state) is not dict or any(type(k) is not str for k in state):
        raise _Bad(f"{what} has unexpected state")
    unknown = set(state) - set(names)
    if unknown:
        raise _Bad(f"{what} has unexpected fields {sorted(unknown)[:3]}")
    return state


def _size(value, what: str) -> tuple[int, ...]:
    if type(value) is _Slot and type(value.value) is torch.Size:
        dims = tuple(value.value)
        if all(d >= 0 for d in dims):
            return dims
    raise _Bad(f"{what} is not a torch.Size")


def _int(value, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _Bad(f"{what} is not a non-negative integer")
    return value


def _checked(path: Path, root) -> DcpMetadata:
    fields = _fields(root, _Metadata, "the top level",
                     ("state_dict_metadata", "planner_data", "storage_data", "storage_meta",
                      "version", "all_local_plans", "mcore_data"))
    plans = fields.get("all_local_plans")
    if plans is not None and (type(plans) is not list
                              or any(type(plan) is not _SavePlan for plan in plans)):
        raise _Bad("all_local_plans is not a list of save plans")
    items = fields.get("state_dict_metadata")
    if type(items) is not dict:
        raise _Bad("state_dict_metadata is not a dict")
    entries: dict[str, TensorEntry | str] = {}
    for key, item in items.items():
        if type(key) is not str:
            raise _Bad("a state_dict_metadata key is not a string")
        if type(item) is _BytesStorage:
            _fields(item, _BytesStorage, f"entry '{key}'", ())
            entries[key] = BYTES
        else:
            entries[key] = _tensor_entry(key, item)
    locations: dict[tuple[str, tuple[int, ...] | None], Location] = {}
    storage = fields.get("storage_data")
    if type(storage) is not dict:
        raise _Bad("storage_data is not a dict (not written by DCP's FileSystemWriter?)")
    for index, info in storage.items():
        where = _index(index)
        if where in locations:
            raise _Bad(f"storage_data lists '{where[0]}' at {where[1]} twice")
        locations[where] = _location(where[0], info)
    paths: dict[str, tuple[str | int, ...]] = {}
    planner = fields.get("planner_data")
    if type(planner) is dict:
        for key, value in planner.items():
            if (type(key) is not str or type(value) is not tuple or not value
                    or any(type(part) not in (str, int) for part in value)):
                raise _Bad("planner_data is not a mapping of key -> path")
            paths[key] = value
    elif planner is not None:
        raise _Bad("planner_data is not a mapping of key -> path")
    meta = fields.get("storage_meta")
    if meta is not None:
        _fields(meta, _StorageMeta, "storage_meta",
                ("checkpoint_id", "save_id", "load_id", "modules"))
    version = fields.get("version")
    if version is not None and type(version) is not str:
        raise _Bad("version is not a string")
    return DcpMetadata(path, entries, locations, paths, version)


def _tensor_entry(key: str, item) -> TensorEntry:
    what = f"entry '{key}'"
    fields = _fields(item, _TensorStorage, what, ("properties", "size", "chunks"))
    size = _size(fields.get("size"), f"{what} size")
    properties = fields.get("properties")
    if type(properties) is not _TensorProperties or properties.args:
        raise _Bad(f"{what} has no TensorProperties")
    state = properties.state
    if type(state) is dict:  # older writers pickled the dataclass's own fields
        state = (state.get("dtype"), state.get("layout"), state.get("requires_grad", False),
                 0, state.get("pin_memory", False))
    if type(state) is not tuple or len(state) != 5:
        raise _Bad(f"{what} has unexpected TensorProperties")
    dtype, layout, _requires_grad, _memory, _pinned = state
    if type(dtype) is not DTypeMarker or not dtype.is_dtype:
        raise _Bad(f"{what} has no dtype")
    if layout is not None and (type(layout) is not _Layout or layout.name != "torch.strided"):
        raise _Bad(f"{what} is not a strided (dense) tensor")
    chunks = fields.get("chunks")
    if type(chunks) is not list:
        raise _Bad(f"{what} has no list of chunks")
    listed = []
    for n, chunk in enumerate(chunks):
        part = _fields(chunk, _ChunkStorage, f"{what} chunk {n}", ("offsets", "sizes"))
        offsets = _size(part.get("offsets"), f"{what} chunk {n} offsets")
        sizes = _size(part.get("sizes"), f"{what} chunk {n} sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _Bad(f"{what} chunk {n} has {len(sizes)} dimensions, the tensor {len(size)}")
        listed.append(Chunk(offsets, sizes))
    return TensorEntry(dtype.dtype, size, tuple(listed))


def _index(index) -> tuple[str, tuple[int, ...] | None]:
    fields = _fields(index, _MetadataIndex, "a storage_data key", ("fqn", "offset", "index"))
    fqn = fields.get("fqn")
    if type(fqn) is not str:
        raise _Bad("a storage_data key has no fqn")
    offset = fields.get("offset")
    hint = fields.get("index")
    if hint is not None and type(hint) is not int:
        raise _Bad(f"storage_data key '{fqn}' has a bad index hint")
    return fqn, None if offset is None else _size(offset, f"storage_data key '{fqn}' offset")


def _location(fqn: str, info) -> Location:
    what = f"storage of '{fqn}'"
    fields = _fields(info, _StorageInfo, what,
                     ("relative_path", "offset", "length", "transform_descriptors"))
    name = fields.get("relative_path")
    if type(name) is not str:
        raise _Bad(f"{what} has no relative_path")
    transforms = fields.get("transform_descriptors")
    if transforms:
        raise _Bad(f"{what} was written through stream transforms ({transforms!r:.60}); "
                   "gradclip reads plain torch.save chunks only")
    return Location(name, _int(fields.get("offset"), f"{what} offset"),
                    _int(fields.get("length"), f"{what} length"))


def _trusted(path: Path, data: bytes) -> DcpMetadata:
    """``--trust-pickle``: the metadata unpickled in full, read into gradclip's records."""
    import pickle

    try:
        root = pickle.loads(data)  # noqa: S301 (the user asked for full unpickling)
    except Exception as error:  # whatever the pickle's own classes raise
        raise InputError(f"{path}: not readable DCP metadata with --trust-pickle: "
                         f"{_short(f'{type(error).__name__}: {error}')}") from None
    try:
        return _from_objects(path, root)
    except (AttributeError, TypeError, ValueError, _Bad) as error:
        raise InputError(f"{path}: not readable DCP metadata: {_short(str(error))}") from None


def _from_objects(path: Path, root) -> DcpMetadata:
    """DCP's own ``Metadata`` object (or one with its fields), checked as ``_checked`` does."""
    entries: dict[str, TensorEntry | str] = {}
    for key, item in dict(root.state_dict_metadata).items():
        if type(key) is not str:
            raise _Bad("a state_dict_metadata key is not a string")
        if not hasattr(item, "chunks"):
            entries[key] = BYTES
            continue
        dtype = item.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise _Bad(f"entry '{key}' has no dtype")
        size = tuple(_int(d, f"entry '{key}' size") for d in item.size)
        chunks = tuple(Chunk(tuple(_int(o, f"entry '{key}' offsets") for o in c.offsets),
                             tuple(_int(n, f"entry '{key}' sizes") for n in c.sizes))
                       for c in item.chunks)
        entries[key] = TensorEntry(dtype, size, chunks)
    locations: dict[tuple[str, tuple[int, ...] | None], Location] = {}
    for index, info in dict(root.storage_data).items():
        fqn = index.fqn
        if type(fqn) is not str:
            raise _Bad("a storage_data key has no fqn")
        offset = None if index.offset is None else tuple(
            _int(o, f"storage_data key '{fqn}' offset") for o in index.offset)
        if (fqn, offset) in locations:
            raise _Bad(f"storage_data lists '{fqn}' at {offset} twice")
        if getattr(info, "transform_descriptors", None):
            raise _Bad(f"storage of '{fqn}' was written through stream transforms")
        if type(info.relative_path) is not str:
            raise _Bad(f"storage of '{fqn}' has no relative_path")
        locations[(fqn, offset)] = Location(
            info.relative_path, _int(info.offset, f"storage of '{fqn}' offset"),
            _int(info.length, f"storage of '{fqn}' length"))
    paths: dict[str, tuple[str | int, ...]] = {}
    planner = getattr(root, "planner_data", None)
    if isinstance(planner, dict):
        for key, value in planner.items():
            if (type(key) is str and type(value) is tuple and value
                    and all(type(part) in (str, int) for part in value)):
                paths[key] = value
    version = getattr(root, "version", None)
    return DcpMetadata(path, entries, locations, paths,
                       version if type(version) is str else None, trusted=True)


def _short(text: str) -> str:
    return text if len(text) <= 160 else text[:157] + "..."
