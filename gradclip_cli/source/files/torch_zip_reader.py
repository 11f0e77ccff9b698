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

import contextlib
import io
import mmap
import os
import platform
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

# The widest element a storage holds (complex128): a blob's storage at another offset
# is read where it lies on CPUs that load unaligned data, else copied.
_ALIGN = 16
_UNALIGNED_OK = platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
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


def _read_directory(view: mmap.mmap, size: int,
                    central: dict[str, int] | None = None) -> tuple[str, dict]:
    """Entries of the zip: name -> (method, flags, crc, csize, usize, header_offset).

    ``central``, when given, receives each entry's central directory record position.

    Returns the archive prefix (the first entry's top folder, as torch's reader
    takes it) too. Anything unusual (multi-disk, duplicate names, bad
    signatures) rejects.
    """
    tail_start = max(0, size - (22 + 0xFFFF))
    pos = bytes(view[tail_start:size]).rfind(_EOCD)
    pos = pos + tail_start if pos >= 0 else pos
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
        name = bytes(view[at + 46 : name_end]).decode("utf-8")
        if csize == _U32 or usize == _U32 or offset == _U32:
            usize, csize, offset = _zip64_extra(view[name_end:extra_end], usize, csize, offset)
        if name in entries:
            raise Outside("duplicate entry name")
        entries[name] = (method, flags, crc, csize, usize, offset)
        if central is not None:
            central[name] = at
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
    data = bytes(view[start : start + length])
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


def restricted_read(path: Path, span: tuple[int, int] | None = None) -> object:
    """``read_torch_zip``, raising ``Outside`` (with the reason and the pickle protocol)
    where that returns None.

    ``span`` (start, length): read the ``torch.save`` blob that lies at those
    bytes of a bigger file (a DCP ``.distcp`` chunk) instead of the whole
    file. Its zip offsets count from ``start``; its storages are mapped from
    the blob's pages there, never copied.
    """
    return run_restricted(lambda attempt: _read(Path(path), attempt, span))


def _read(path: Path, attempt: Attempt, span: tuple[int, int] | None = None) -> object:
    with open(path, "rb") as raw:
        stat = os.fstat(raw.fileno())
        file_size = stat.st_size
        base, size = (0, file_size) if span is None else span
        if base < 0 or size < 0 or base + size > file_size:
            raise Outside(f"bytes {base}..{base + size} lie past the end of the file "
                          f"({file_size} bytes)")
        if size < 22:
            raise Outside("too small for a zip")
        if span is None:
            mapping = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ)
            lead = 0
        else:
            # The blob's pages only, private (copy-on-write): its storages
            # alias this mapping, and a file of many blobs is never mapped whole.
            lead = base % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(raw.fileno(), lead + size, access=mmap.ACCESS_COPY,
                                offset=base - lead)
    # The blob's own bytes, positions counted from its start (no copy).
    window = memoryview(mapping)[lead : lead + size] if span is not None else None
    view = window if window is not None else mapping
    overall: list = []  # the mapping as a storage, once the pickle names one
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
                # torch.load refuses this too, but with mmap=True it maps a
                # storage of the claimed size over a smaller file.
                raise Outside(f"{name} is smaller than its storage", damaged=True)
            if length // marker.dtype.itemsize != numel:
                # torch.save writes numel = nbytes // itemsize (an odd-sized storage
                # keeps its tail); more than that is a lying dtype or numel, which
                # torch.load refuses and torch.load(mmap=True) reads as other numbers.
                raise Outside(f"{name} holds {length} bytes, not the {numel} "
                              f"{marker.dtype} elements its storage claims", damaged=True)
            if not overall:
                if span is None:
                    overall.append(
                        torch.UntypedStorage.from_file(os.fspath(path), False, file_size))
                    register_mapping(stat, overall[0])
                else:
                    overall.append(torch.frombuffer(mapping, dtype=torch.uint8)
                                   .untyped_storage())
            spans[name] = (start, start + nbytes)
            at = lead + start  # in the mapping
            storage = _slice(overall[0], slice(at, at + nbytes))
            if span is not None and at % _ALIGN:
                # A blob inside a bigger file sits where its writer left it
                # (DCP packs them end to end): its storages are aligned to the
                # blob, not to memory. Where the CPU loads unaligned floats
                # (x86-64, ARMv8: torch's vector kernels use unaligned loads)
                # the mapping is used as it is; elsewhere the storage is
                # copied once, aligned (memory stays bounded by the blob).
                # The copy cost 40% of inspect's time on x86 (BENCHMARKS.md).
                if not _UNALIGNED_OK:
                    storage = torch.UntypedStorage(nbytes).copy_(storage)
                at = 0
            ref = StorageRef(key, marker, numel, storage, at)
            refs[key] = ref
            return ref

        root = unpickle(io.BytesIO(pickle_data), resolve)
        _check_no_overlap(spans)
        return finish(root)
    finally:
        with contextlib.suppress(BufferError):
            # A slice of the window may live on in a traceback's frame: the
            # mapping then closes when that goes.
            if window is not None:
                window.release()
            if span is None or not overall:
                # Storages made by frombuffer hold the mapping object itself,
                # not a buffer export: closing would unmap under them. It
                # unmaps when the last of them is freed.
                mapping.close()


def _check_no_overlap(spans: dict[str, tuple[int, int]]) -> None:
    ordered = sorted(spans.values())
    for (_, end), (begin, _) in zip(ordered, ordered[1:]):
        if begin < end:
            raise Outside("storages overlap")


# --- rewriting one storage in place (clip of a DCP chunk) ------------------


class StoragePatch:
    """Where a single-storage ``torch.save`` blob keeps its storage's bytes and their CRC32.

    ``data_start`` and every ``crc_positions`` entry are absolute offsets in
    the file; writing ``nbytes`` new bytes at ``data_start`` and their CRC32
    (little-endian) at each CRC position gives a blob of the same length that
    ``torch.load`` and ``--verify`` read as the new values.
    """

    __slots__ = ("data_start", "nbytes", "crc_positions")

    def __init__(self, data_start: int, nbytes: int, crc_positions: list[int]):
        self.data_start = data_start
        self.nbytes = nbytes
        self.crc_positions = crc_positions


_DESCRIPTOR = b"PK\x07\x08"


def storage_patch(path: Path, span: tuple[int, int]) -> StoragePatch:
    """The ``StoragePatch`` of the blob at ``span`` (start, length) of ``path``; ``Outside``
    when the blob holds other than exactly one stored storage."""
    base, size = span
    with open(path, "rb") as raw:
        mapping = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ)
    window = memoryview(mapping)[base : base + size]
    try:
        if len(window) != size or size < 22:
            raise Outside("blob runs past the end of the file")
        central: dict[str, int] = {}
        prefix, entries = _read_directory(window, size, central)
        storages = [n for n in entries if n.startswith(f"{prefix}/data/")]
        if len(storages) != 1:
            raise Outside(f"{len(storages)} storages in one chunk")
        name = storages[0]
        method, flags, crc, _csize, _usize, offset = entries[name]
        start, length = _data_span(window, size, name, entries[name])
        positions = [central[name] + 16]
        (local_crc,) = struct.unpack_from("<L", window, offset + 14)
        if local_crc == crc:
            positions.append(offset + 14)
        elif local_crc != 0 or not flags & 0x8:
            raise Outside(f"entry {name}: local header and directory disagree")
        if flags & 0x8:  # a data descriptor follows the data: [signature] crc sizes
            at = start + length
            if bytes(window[at : at + 4]) == _DESCRIPTOR:
                at += 4
            if at + 4 > size or struct.unpack_from("<L", window, at)[0] != crc:
                raise Outside(f"entry {name}: data descriptor not found")
            positions.append(at)
        return StoragePatch(base + start, length, [base + p for p in positions])
    finally:
        with contextlib.suppress(BufferError):
            window.release()
            mapping.close()
