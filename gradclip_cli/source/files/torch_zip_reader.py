"""A fast, restricted reader for the common zip-format ``torch.save`` file.

``read_torch_zip`` returns what ``torch.load(path, map_location="cpu",
weights_only=True, mmap=True)`` returns, for files made only of nested
dicts / lists / tuples / OrderedDicts of plain tensors and plain values; for
anything else it returns None and the caller falls back to ``torch.load``.

Why it is faster: torch's weights-only unpickler is pure Python, and its
zip reader does per-storage Python work; here the pickle is run by CPython's
C unpickler, and every storage is a slice of one copy-on-write mapping.

Why it is safe: ``find_class`` hands out only the few callables and markers
defined in this module (everything else aborts the read), nothing from the
file is ever called, and every size, offset and stride is checked against
the zip entry before a tensor is made. Tensors are built as inert
placeholders while unpickling (so BUILD / SETITEM / APPEND opcodes aimed at
them fail instead of reaching ``Tensor.__setstate__``) and swapped in by a
final walk that also rejects any type outside the simple subset.
"""

from __future__ import annotations

import copyreg
import gc
import io
import mmap
import os
import pickle
import re
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

__all__ = ["read_torch_zip"]

_MAX_DIMS = 64
_MAX_DIM = 1 << 62


class _Reject(Exception):
    """The file is outside the subset this reader handles."""


class _Inert:
    """Base for objects the unpickler may hold: no state can be set on them."""

    __slots__ = ()
    __hash__ = None  # not usable as dict keys or set members

    def __setstate__(self, state):
        raise _Reject("BUILD on a reader object")

    def __reduce__(self):
        raise _Reject("reader objects are not picklable")


class _DTypeMarker(_Inert):
    """What ``find_class`` returns for ``torch.FloatStorage`` and friends, or
    ``torch.float32`` and friends (the dtype argument of ``_rebuild_tensor_v3``)."""

    __slots__ = ("dtype", "untyped")

    def __init__(self, dtype: torch.dtype, untyped: bool = False):
        self.dtype = dtype
        self.untyped = untyped


class _StorageRef(_Inert):
    """One storage key of the file: a view of the mapping over its bytes."""

    __slots__ = ("key", "dtype", "untyped", "numel", "nbytes", "storage", "data_offset")

    def __init__(self, key, marker, numel, storage, data_offset):
        self.key = key
        self.dtype = marker.dtype
        self.untyped = marker.untyped
        self.numel = numel
        self.nbytes = numel * _ITEMSIZE[marker.dtype]
        self.storage = storage
        self.data_offset = data_offset


class _TensorSlot(_Inert):
    """Stands for a tensor until the final walk replaces it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


def _storage_markers() -> dict[str, _DTypeMarker]:
    quantized = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
    markers = {}
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        if dtype not in quantized:
            markers[name] = _DTypeMarker(dtype)
    return markers


def _dtype_markers() -> dict[str, _DTypeMarker]:
    names = (
        "float32 float64 float16 bfloat16 complex64 complex128 complex32 "
        "int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool "
        "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu"
    ).split()
    markers = {}
    for name in names:
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            markers[name] = _DTypeMarker(dtype)
    return markers


_STORAGES = _storage_markers()
_DTYPES = _dtype_markers()
_UNTYPED = _DTypeMarker(torch.uint8, untyped=True)
_ITEMSIZE = {m.dtype: m.dtype.itemsize for m in (*_STORAGES.values(), *_DTYPES.values())}
_VERSION = re.compile(rb"[1-3]\n?")


# --- zip directory ---------------------------------------------------------

_EOCD = b"PK\x05\x06"
_EOCD64_LOCATOR = b"PK\x06\x07"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
_CENTRAL_FMT = struct.Struct("<4s6H3L5H2L")  # 46 bytes
_U32 = 0xFFFFFFFF


def _read_directory(view: mmap.mmap, size: int) -> tuple[str, dict]:
    """Entries of the zip: name -> (method, flags, crc, csize, usize, header_offset).

    Returns the archive prefix (the first entry's top folder, as torch's reader
    takes it) too. Anything unusual (multi-disk, duplicate names, bad
    signatures) rejects.
    """
    tail_start = max(0, size - (22 + 0xFFFF))
    pos = view.rfind(_EOCD, tail_start, size)
    if pos < 0 or pos + 22 > size:
        raise _Reject("no end of central directory")
    disk, cd_disk, n_here, n_total, cd_size, cd_offset, _ = struct.unpack_from(
        "<4H2LH", view, pos + 4
    )
    if n_here == 0xFFFF or n_total == 0xFFFF or cd_size == _U32 or cd_offset == _U32:
        loc = pos - 20
        if loc < 0 or view[loc : loc + 4] != _EOCD64_LOCATOR:
            raise _Reject("zip64 locator missing")
        (eocd64,) = struct.unpack_from("<Q", view, loc + 8)
        if eocd64 + 56 > loc or view[eocd64 : eocd64 + 4] != _EOCD64:
            raise _Reject("zip64 end record missing")
        disk, cd_disk, n_here, n_total, cd_size, cd_offset = struct.unpack_from(
            "<2L4Q", view, eocd64 + 16
        )
    if disk != 0 or cd_disk != 0 or n_here != n_total:
        raise _Reject("multi-disk zip")
    if cd_offset + cd_size > pos or n_total > cd_size // 46:
        raise _Reject("central directory out of bounds")

    entries: dict[str, tuple] = {}
    prefix = None
    at = cd_offset
    end = cd_offset + cd_size
    unpack = _CENTRAL_FMT.unpack_from
    for _ in range(n_total):
        if at + 46 > end:
            raise _Reject("central directory truncated")
        (
            sig,
            _vm,
            _vn,
            flags,
            method,
            _t,
            _d,
            crc,
            csize,
            usize,
            name_len,
            extra_len,
            comment_len,
            _dn,
            _ia,
            _ea,
            offset,
        ) = unpack(view, at)
        if sig != _CENTRAL:
            raise _Reject("bad central directory signature")
        name_end = at + 46 + name_len
        extra_end = name_end + extra_len
        if extra_end + comment_len > end:
            raise _Reject("central directory truncated")
        name = view[at + 46 : name_end].decode("utf-8")
        if csize == _U32 or usize == _U32 or offset == _U32:
            usize, csize, offset = _zip64_extra(view[name_end:extra_end], usize, csize, offset)
        if name in entries:
            raise _Reject("duplicate entry name")
        entries[name] = (method, flags, crc, csize, usize, offset)
        if prefix is None:
            prefix = name.split("/", 1)[0]
        at = extra_end + comment_len
    if prefix is None:
        raise _Reject("empty zip")
    return prefix, entries


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, at)
        body = extra[at + 4 : at + 4 + length]
        if tag == 1:
            values = [v[0] for v in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            fields = []
            for current in (usize, csize, offset):
                if current == _U32:
                    if not values:
                        raise _Reject("short zip64 extra field")
                    fields.append(values.pop(0))
                else:
                    fields.append(current)
            return fields[0], fields[1], fields[2]
        at += 4 + length
    raise _Reject("zip64 extra field missing")


def _data_span(view: mmap.mmap, size: int, name: str, entry: tuple) -> tuple[int, int]:
    """Where a stored entry's bytes lie in the file: (start, length)."""
    method, flags, _crc, csize, usize, offset = entry
    if method != 0 or csize != usize or flags & 0x1:
        raise _Reject(f"entry {name} is compressed or encrypted")
    if offset + 30 > size or view[offset : offset + 4] != _LOCAL:
        raise _Reject(f"entry {name} has no local header")
    name_len, extra_len = struct.unpack_from("<2H", view, offset + 26)
    if view[offset + 30 : offset + 30 + name_len] != name.encode("utf-8"):
        raise _Reject(f"entry {name} points at another header")
    start = offset + 30 + name_len + extra_len
    if start + usize > size:
        raise _Reject(f"entry {name} runs past the end")
    return start, usize


def _record(view, size, entries, name, spans) -> bytes:
    """A small record, CRC-checked as torch's reader does for records it reads whole.

    Its span joins ``spans``, so no storage may overlap it either.
    """
    entry = entries.get(name)
    if entry is None:
        raise _Reject(f"missing {name}")
    start, length = _data_span(view, size, name, entry)
    spans[name] = (start, start + length)
    data = view[start : start + length]
    if zlib.crc32(data) != entry[2]:
        raise _Reject(f"CRC mismatch in {name}")
    return data


# --- unpickling ------------------------------------------------------------


def _exact_int(value) -> bool:
    return type(value) is int


_INT_ONLY = {int}


def _make_tensor(ref, offset, size, stride, requires_grad, hooks, dtype, metadata):
    if requires_grad is not False or type(hooks) is not OrderedDict or hooks or vars(hooks):
        raise _Reject("requires_grad or backward hooks")
    if metadata is not None and (type(metadata) is not dict or metadata):
        raise _Reject("tensor metadata")
    if type(offset) is not int or offset < 0:
        raise _Reject("bad storage offset")
    if type(size) is not tuple or type(stride) is not tuple:
        raise _Reject("bad size or stride")
    ndim = len(size)
    if ndim != len(stride) or ndim > _MAX_DIMS:
        raise _Reject("bad size or stride")
    itemsize = _ITEMSIZE[dtype]
    if ref.data_offset % itemsize:
        raise _Reject("storage misaligned for its dtype")
    capacity = ref.nbytes // itemsize
    if ndim:
        dims = size + stride
        if set(map(type, dims)) != _INT_ONLY or min(dims) < 0 or max(dims) >= _MAX_DIM:
            raise _Reject("bad size or stride")
        if 0 in size:
            if offset > capacity:
                raise _Reject("empty view past its storage")
        else:
            last = offset
            for n, s in zip(size, stride):
                last += (n - 1) * s
            if last >= capacity:
                raise _Reject("view does not fit its storage")
    elif offset >= capacity:
        raise _Reject("view does not fit its storage")
    return _TensorSlot(_empty(0, dtype=dtype).set_(ref.storage, offset, size, stride))


_empty = torch.empty
# UntypedStorage.__getitem__ minus its meta-device check: a slice that aliases
# the mapping (what torch.load's own mmap path does per storage).
_slice = torch._C.StorageBase.__getitem__


def _rebuild_v2(*args):
    if len(args) == 6:
        ref, offset, size, stride, requires_grad, hooks = args
        metadata = None
    elif len(args) == 7:
        ref, offset, size, stride, requires_grad, hooks, metadata = args
    else:
        raise _Reject("unexpected _rebuild_tensor_v2 arguments")
    if type(ref) is not _StorageRef or ref.untyped:
        raise _Reject("_rebuild_tensor_v2 needs a typed storage")
    return _make_tensor(ref, offset, size, stride, requires_grad, hooks, ref.dtype, metadata)


def _rebuild_v3(*args):
    if len(args) == 7:
        ref, offset, size, stride, requires_grad, hooks, marker = args
        metadata = None
    elif len(args) == 8:
        ref, offset, size, stride, requires_grad, hooks, marker, metadata = args
    else:
        raise _Reject("unexpected _rebuild_tensor_v3 arguments")
    if type(ref) is not _StorageRef or not ref.untyped:
        raise _Reject("_rebuild_tensor_v3 needs an untyped storage")
    if type(marker) is not _DTypeMarker or marker.untyped or marker.dtype not in _DTYPES_SET:
        raise _Reject("_rebuild_tensor_v3 needs a dtype")
    return _make_tensor(ref, offset, size, stride, requires_grad, hooks, marker.dtype, metadata)


_DTYPES_SET = frozenset(m.dtype for m in _DTYPES.values())


class _Unpickler(pickle.Unpickler):
    """CPython's C unpickler, allowed to import only this module's own objects."""

    def __init__(self, data, resolve):
        super().__init__(data)
        self.persistent_load = resolve  # an attribute: one call less per storage

    def find_class(self, module, name):
        if module == "torch._utils":
            if name == "_rebuild_tensor_v2":
                return _rebuild_v2
            if name == "_rebuild_tensor_v3":
                return _rebuild_v3
        elif module == "collections" and name == "OrderedDict":
            return OrderedDict
        elif module == "torch":
            marker = _STORAGES.get(name) or _DTYPES.get(name)
            if marker is not None:
                return marker
        elif module == "torch.storage" and name == "UntypedStorage":
            return _UNTYPED
        raise _Reject(f"global {module}.{name}")


# --- the result walk -------------------------------------------------------

_PLAIN = (str, int, float, bool, type(None))


def _finish(root):
    """Swap placeholders for tensors and reject any type outside the subset.

    Lists, dicts and OrderedDicts are fixed in place (keeping shared references
    shared); tuples are rebuilt once each. A cycle through a tuple rejects.
    """
    done: dict[int, object] = {}
    active: set[int] = set()

    def visit(obj):
        kind = type(obj)
        if kind is _TensorSlot:
            return obj.tensor
        if kind in _PLAIN:
            return obj
        ident = id(obj)
        if ident in done:
            return done[ident]
        if kind is list:
            done[ident] = obj
            for i, item in enumerate(obj):
                new = visit(item)
                if new is not item:
                    obj[i] = new
            return obj
        if kind is dict or kind is OrderedDict:
            done[ident] = obj
            for key, value in obj.items():
                if type(key) not in _PLAIN:
                    _check_key(key)
                new = visit(value)
                if new is not value:
                    obj[key] = new
            if kind is OrderedDict:
                attrs = vars(obj)
                if attrs:
                    for key, value in attrs.items():
                        new = visit(value)
                        if new is not value:
                            attrs[key] = new
            return obj
        if kind is tuple:
            if ident in active:
                raise _Reject("cycle through a tuple")
            active.add(ident)
            items = tuple(visit(item) for item in obj)
            active.discard(ident)
            new = obj if all(a is b for a, b in zip(items, obj)) else items
            done[ident] = new
            return new
        raise _Reject(f"unsupported type {kind.__name__}")

    def _check_key(key):
        if type(key) is tuple:
            for part in key:
                if type(part) not in _PLAIN:
                    _check_key(part)
            return
        raise _Reject("unsupported dict key")

    return visit(root)


# --- entry point -----------------------------------------------------------


def read_torch_zip(path: Path) -> object | None:
    """Load a zip-format ``torch.save`` file as ``torch.load(path, map_location="cpu",
    weights_only=True, mmap=True)`` would, or return None when the file is outside
    the simple subset (the caller then falls back to ``torch.load``).

    The storages alias one private (copy-on-write) mapping of the file: editing a
    loaded tensor in place never writes through to the file.
    """
    # Tens of thousands of small objects would trigger full collections that
    # find nothing to free (as they do in torch.load): pause the collector.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _read(Path(path))
    except _Reject:
        return None
    except Exception:  # noqa: BLE001 - any surprise means "let torch decide"
        return None
    finally:
        if collecting:
            gc.enable()


def _read(path: Path) -> object:
    with open(path, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        if size < 22:
            raise _Reject("too small for a zip")
        view = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        prefix, entries = _read_directory(view, size)
        if f"{prefix}/constants.pkl" in entries:
            raise _Reject("a TorchScript archive")  # torch.load refuses these with weights_only
        # Every byte range read, records and storages: none may overlap another
        # (a storage laid over data.pkl would load pickle bytes as a tensor).
        spans: dict[str, tuple[int, int]] = {}
        pickle_data = _record(view, size, entries, f"{prefix}/data.pkl", spans)
        if not pickle_data.startswith(b"\x80\x02"):
            # torch.save writes protocol 2; other protocols use opcodes (FRAME,
            # MEMOIZE...) that torch's weights-only unpickler refuses.
            raise _Reject("pickle protocol other than 2")
        version = _record(view, size, entries, f"{prefix}/version", spans)
        if not _VERSION.fullmatch(version):
            raise _Reject("unexpected format version")
        order_name = f"{prefix}/byteorder"
        if order_name in entries:
            if _record(view, size, entries, order_name, spans) != b"little":
                raise _Reject("not little-endian")
        elif torch.serialization.get_default_load_endianness() not in (
            None,
            torch.serialization.LoadEndianness.LITTLE,
        ):
            raise _Reject("load endianness overridden")

        # Check every storage the pickle names before allocating the mapping:
        # collect the requests first, then validate them all at once.
        refs: dict[str, _StorageRef] = {}
        overall = []  # filled once the pickle has been read

        def resolve(pid):
            if type(pid) is not tuple or len(pid) != 5:
                raise _Reject("unexpected persistent id")
            tag, marker, key, location, numel = pid
            if type(tag) is not str or tag != "storage":
                raise _Reject("unexpected persistent id")
            if type(marker) is not _DTypeMarker or type(key) is not str:
                raise _Reject("unexpected persistent id")
            if type(location) is not str or location != "cpu":
                raise _Reject("storage not on cpu")
            if not _exact_int(numel) or numel < 0:
                raise _Reject("bad storage size")
            ref = refs.get(key)
            if ref is not None:
                if (
                    ref.dtype is not marker.dtype
                    or ref.numel != numel
                    or ref.untyped != marker.untyped
                ):
                    raise _Reject("one storage key read as two storages")
                return ref
            name = f"{prefix}/data/{key}"
            entry = entries.get(name)
            if entry is None:
                raise _Reject(f"missing {name}")
            start, length = _data_span(view, size, name, entry)
            nbytes = numel * marker.dtype.itemsize
            if length < nbytes:
                raise _Reject(f"{name} is smaller than its storage")
            if not overall:
                overall.append(torch.UntypedStorage.from_file(os.fspath(path), False, size))
            spans[name] = (start, start + nbytes)
            storage = _slice(overall[0], slice(start, start + nbytes))
            ref = _StorageRef(key, marker, numel, storage, start)
            refs[key] = ref
            return ref

        if copyreg._extension_cache or copyreg._inverted_registry:
            # EXT opcodes resolved through a populated cache bypass find_class.
            raise _Reject("copyreg extension codes registered in this process")
        root = _Unpickler(io.BytesIO(pickle_data), resolve).load()
        _check_no_overlap(spans)
        return _finish(root)
    finally:
        view.close()


def _check_no_overlap(spans: dict[str, tuple[int, int]]) -> None:
    ordered = sorted(spans.values())
    for (_, end), (begin, _) in zip(ordered, ordered[1:]):
        if begin < end:
            raise _Reject("storages overlap")
