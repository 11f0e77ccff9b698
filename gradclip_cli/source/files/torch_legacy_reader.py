"""A restricted reader for the legacy (pre-1.6, non-zip) ``torch.save`` format.

The format (torch/serialization.py, ``_legacy_save``) is five pickles and the
raw storages, one after another:

    magic number, protocol version (1001), system info,
    the object (storages as persistent ids: ("storage", type, key, location, numel, None)),
    the list of storage keys,
    then for each key in that order: its element count (int64) and its bytes.

``restricted_read`` returns what ``torch.load(path, map_location="cpu",
weights_only=True)`` returns for the subset ``weights_pickle`` reads, at any
pickle protocol (torch's own weights-only unpickler refuses 4 and 5), or
raises ``Outside``. Storages are read into memory, as torch does for this
format; every storage must fit in the bytes the file has left, so a file
cannot ask for more memory than its own size.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

import torch

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

__all__ = ["restricted_read"]

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
PROTOCOL_VERSION = 1001
_COUNT = struct.Struct("<q")


def restricted_read(path: Path) -> object:
    """Load a legacy ``torch.save`` file with the restricted unpickler, or raise ``Outside``."""
    return run_restricted(lambda attempt: _read(Path(path), attempt))


def _read(path: Path, attempt: Attempt) -> object:
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        attempt.protocol = pickle_protocol(file.read(2))
        file.seek(0)
        if attempt.protocol is None or not 2 <= attempt.protocol <= 5:
            raise Outside("not a pickle protocol torch.save writes (2 to 5)")
        magic = unpickle(file)
        if type(magic) is not int or magic != MAGIC_NUMBER:
            raise Outside("no torch.save magic number (a bare pickle, or damaged)")
        version = unpickle(file)
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise Outside("unexpected legacy format version")
        info = unpickle(file)
        if type(info) is not dict or info.get("little_endian") is not True:
            raise Outside("not written on a little-endian machine")

        refs: dict[str, StorageRef] = {}
        budget = [size]  # bytes a storage may still claim: its data lies in the file

        def resolve(pid):
            if type(pid) is not tuple or len(pid) != 6:
                raise Outside("unexpected persistent id")
            tag, marker, key, location, numel, view = pid
            if view is not None:  # storage views: written only by torch < 0.4
                raise Outside("unexpected persistent id")
            check_storage_id(tag, marker, key, location, numel)
            ref = known_storage(refs, key, marker, numel)
            if ref is not None:
                return ref
            nbytes = numel * marker.dtype.itemsize
            budget[0] -= nbytes + _COUNT.size
            if budget[0] < 0:
                raise Outside("storages larger than the file")
            # Filled after the pickle, from the bytes that follow it.
            ref = StorageRef(key, marker, numel, torch.UntypedStorage(nbytes), 0)
            refs[key] = ref
            return ref

        root = unpickle(file, resolve)
        keys = unpickle(file)
        if type(keys) is not list or set(map(type, keys)) - {str}:
            raise Outside("bad storage key list")
        if len(keys) != len(refs) or set(keys) != set(refs):
            # torch fills only the listed storages: one left out would hold garbage.
            raise Outside("storage key list does not match the storages")
        for key in keys:
            _fill(file, refs[key])
        return finish(root)


def _fill(file, ref: StorageRef) -> None:
    """Read one storage's count and bytes into the storage made for it."""
    head = file.read(_COUNT.size)
    if len(head) != _COUNT.size:
        raise Outside("unexpected end of file (truncated?)")
    (count,) = _COUNT.unpack(head)
    if count != ref.numel:
        raise Outside(f"storage {ref.key} has the wrong size")
    if not ref.nbytes:
        return
    # The storage's own memory as a writable buffer: read straight into it.
    buffer = (ctypes.c_char * ref.nbytes).from_address(ref.storage.data_ptr())
    if file.readinto(memoryview(buffer).cast("B")) != ref.nbytes:
        raise Outside("unexpected end of file (truncated?)")
