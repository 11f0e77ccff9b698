"""A fast, restricted reader for the common zip-format ``torch.save`` file.

``read_torch_zip`` returns what ``torch.load(path, map_location="cpu",
weights_only=True, mmap=True)`` returns, for files made only of nested
dicts / lists / tuples / OrderedDicts of tensors, Parameters and plain values
(``weights_pickle`` says exactly what); for anything else it returns None and
the caller falls back to ``torch.load``. ``restricted_read`` says why instead.

Why it is faster: torch's weights-only unpickler is pure Python, and its
zip reader does per-storage Python work; here the pickle is run by CPython's
C unpickler, and every storage is a slice of one copy-on-write mapping. The
C unpickler also reads pickle protocols 4 and 5, which torch's refuses.

Why it is safe: see ``weights_pickle``; in addition every size, offset and
stride is checked against the zip entry before a tensor is made, and no two
byte ranges read may overlap.
"""

from __future__ import annotations

import io
import mmap
import os
import re
import struct
import zlib
from pathlib import Path

import torch

from gradclip_cli.source.files.pages import register_mapping
from gradclip_cli.source.files.weights_pickle import (
    Attempt,
    Outside,
    StorageRef,
    check_storage_id,
    finish,
    known_storage,
    pickle_protocol,
    run_restricted,
    unpickle,
)

__all__ = ["read_torch_zip", "restricted_read"]

_VERSION = re.compile(rb"[1-3]\n?")
# UntypedStorage.__getitem__ minus its meta-device check: a slice that aliases
# the mapping (what torch.load's own mmap path does per storage).
_slice = torch._C.StorageBase.__getitem__


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
        raise Outside("no end of central directory")
    disk, cd_disk, n_here, n_total, cd_size, cd_offset, _ = struct.unpack_from(
        "<4H2LH", view, pos + 4
    )
    if n_here == 0xFFFF or n_total == 0xFFFF or cd_size == _U32 or cd_offset == _U32:
        loc = pos - 20
        if loc < 0 or view[loc : loc + 4] != _EOCD64_LOCATOR:
            raise Outside("zip64 locator missing")
        (eocd64,) = struct.unpack_from("<Q", view, loc + 8)
        if eocd64 + 56 > loc or view[eocd64 : eocd64 + 4] != _EOCD64:
            raise Outside("zip64 end record missing")
        disk, cd_disk, n_here, n_total, cd_size, cd_offset = struct.unpack_from(
            "<2L4Q", view, eocd64 + 16
        )
    if disk != 0 or cd_disk != 0 or n_here != n_total:
        raise Outside("multi-disk zip")
    if cd_offset + cd_size > pos or n_total > cd_size // 46:
        raise Outside("central directory out of bounds")

    entries: dict[str, tuple] = {}
    prefix = None
    at = cd_offset
    end = cd_offset + cd_size
    unpack = _CENTRAL_FMT.unpack_from
    for _ in range(n_total):
        if at + 46 > end:
            raise Outside("central directory truncated")
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
            raise Outside("bad central directory signature")
        name_end = at + 46 + name_len
        extra_end = name_end + extra_len
        if extra_end + comment_len > end:
            raise Outside("central directory truncated")
        name = view[at + 46 : name_end].decode("utf-8")
        if csize == _U32 or usize == _U32 or offset == _U32:
            usize, csize, offset = _zip64_extra(view[name_end:extra_end], usize, csize, offset)
        if name in entries:
            raise Outside("duplicate entry name")
        entries[name] = (method, flags, crc, csize, usize, offset)
        if prefix is None:
            prefix = name.split("/", 1)[0]
        at = extra_end + comment_len
    if prefix is None:
        raise Outside("empty zip")
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
                        raise Outside("short zip64 extra field")
                    fields.append(values.pop(0))
                else:
                    fields.append(current)
            return fields[0], fields[1], fields[2]
        at += 4 + length
    raise Outside("zip64 extra field missing")


def _data_span(view: mmap.mmap, size: int, name: str, entry: tuple) -> tuple[int, int]:
    """Where a stored entry's bytes lie in the file: (start, length)."""
    method, flags, _crc, csize, usize, offset = entry
    if method != 0 or csize != usize or flags & 0x1:
        raise Outside(f"entry {name} is compressed or encrypted")
    if offset + 30 > size or view[offset : offset + 4] != _LOCAL:
        raise Outside(f"entry {name} has no local header")
    name_len, extra_len = struct.unpack_from("<2H", view, offset + 26)
    if view[offset + 30 : offset + 30 + name_len] != name.encode("utf-8"):
        raise Outside(f"entry {name} points at another header")
    start = offset + 30 + name_len + extra_len
    if start + usize > size:
        raise Outside(f"entry {name} runs past the end")
    return start, usize


def _record(view, size, entries, name, spans) -> bytes:
    """A small record, CRC-checked as torch's reader does for records it reads whole.

    Its span joins ``spans``, so no storage may overlap it either.
    """
    entry = entries.get(name)
    if entry is None:
        raise Outside(f"missing {name}")
    start, length = _data_span(view, size, name, entry)
    spans[name] = (start, start + length)
    data = view[start : start + length]
    if zlib.crc32(data) != entry[2]:
        raise Outside(f"CRC mismatch in {name}")
    return data


# --- entry point -----------------------------------------------------------


def read_torch_zip(path: Path) -> object | None:
    """Load a zip-format ``torch.save`` file as ``torch.load(path, map_location="cpu",
    weights_only=True, mmap=True)`` would, or return None when the file is outside
    the simple subset (the caller then falls back to ``torch.load``).

    The storages alias one private (copy-on-write) mapping of the file: editing a
    loaded tensor in place never writes through to the file.
    """
    try:
        return restricted_read(path)
    except Outside:
        return None


def restricted_read(path: Path) -> object:
    """``read_torch_zip``, raising ``Outside`` (with the reason and the pickle protocol)
    where that returns None."""
    return run_restricted(lambda attempt: _read(Path(path), attempt))


def _read(path: Path, attempt: Attempt) -> object:
    with open(path, "rb") as raw:
        stat = os.fstat(raw.fileno())
        size = stat.st_size
        if size < 22:
            raise Outside("too small for a zip")
        view = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        prefix, entries = _read_directory(view, size)
        if f"{prefix}/constants.pkl" in entries:
            raise Outside("a TorchScript archive")  # torch.load refuses these with weights_only
        # Every byte range read, records and storages: none may overlap another
        # (a storage laid over data.pkl would load pickle bytes as a tensor).
        spans: dict[str, tuple[int, int]] = {}
        pickle_data = _record(view, size, entries, f"{prefix}/data.pkl", spans)
        attempt.protocol = pickle_protocol(pickle_data)
        if attempt.protocol is None or not 2 <= attempt.protocol <= 5:
            raise Outside("not a pickle protocol torch.save writes (2 to 5)")
        version = _record(view, size, entries, f"{prefix}/version", spans)
        if not _VERSION.fullmatch(version):
            raise Outside("unexpected format version")
        order_name = f"{prefix}/byteorder"
        if order_name in entries:
            if _record(view, size, entries, order_name, spans) != b"little":
                raise Outside("not little-endian")
        elif torch.serialization.get_default_load_endianness() not in (
            None,
            torch.serialization.LoadEndianness.LITTLE,
        ):
            raise Outside("load endianness overridden")

        # Check every storage the pickle names before allocating the mapping:
        # collect the requests first, then validate them all at once.
        refs: dict[str, StorageRef] = {}
        overall = []  # filled once the pickle has been read

        def resolve(pid):
            if type(pid) is not tuple or len(pid) != 5:
                raise Outside("unexpected persistent id")
            tag, marker, key, location, numel = pid
            check_storage_id(tag, marker, key, location, numel)
            ref = known_storage(refs, key, marker, numel)
            if ref is not None:
                return ref
            name = f"{prefix}/data/{key}"
            entry = entries.get(name)
            if entry is None:
                raise Outside(f"missing {name}")
            start, length = _data_span(view, size, name, entry)
            nbytes = numel * marker.dtype.itemsize
            if length < nbytes:
                raise Outside(f"{name} is smaller than its storage")
            if not overall:
                overall.append(torch.UntypedStorage.from_file(os.fspath(path), False, size))
                register_mapping(stat, overall[0])
            spans[name] = (start, start + nbytes)
            storage = _slice(overall[0], slice(start, start + nbytes))
            ref = StorageRef(key, marker, numel, storage, start)
            refs[key] = ref
            return ref

        root = unpickle(io.BytesIO(pickle_data), resolve)
        _check_no_overlap(spans)
        return finish(root)
    finally:
        view.close()


def _check_no_overlap(spans: dict[str, tuple[int, int]]) -> None:
    ordered = sorted(spans.values())
    for (_, end), (begin, _) in zip(ordered, ordered[1:]):
        if begin < end:
            raise Outside("storages overlap")
