"""Giving back the memory of memory-mapped tensors once they have been read.

Opening a mapped checkpoint costs no memory, but every page read stays
resident, so inspecting a 6 GB file would end with 6 GB resident.
``madvise(MADV_DONTNEED)`` drops pages of a private file mapping; touched
again, they are read back from the file, unchanged.

That is only safe for pages that were never written (a written page of a
private mapping is the only copy of the change) and that belong to the file
(dropping anonymous memory zeroes it). So ``PageReleaser`` acts only inside
ranges known to be mapped privately from the checkpoint's own file, and is
used only by ``inspect`` and ``trend``, which never write a tensor. Elsewhere
than Linux it does nothing.

Those ranges come from the mappings gradclip's own reader made
(``register_mapping``: the range of a private ``from_file`` storage, valid
while a weak reference says the storage lives, so the range cannot have been
unmapped and reused), else from /proc/self/maps. Reading /proc/self/maps
costs 3-8 ms in a process with torch loaded, which over 50 small
checkpoints was a tenth of ``trend``'s time (BENCHMARKS.md, "trend").
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_MADV_DONTNEED = 4  # Linux

# (st_dev, st_ino, start, end, weak reference to the mapping's storage)
_MAPPINGS: list[tuple[int, int, int, int, StorageWeakRef]] = []
_MAPPINGS_LOCK = threading.Lock()


def register_mapping(stat: os.stat_result, storage: torch.UntypedStorage) -> None:
    """Record that ``storage`` maps the whole file ``stat`` describes, privately
    (``torch.UntypedStorage.from_file(path, shared=False)``).

    Storages sliced from it keep it alive, so while the weak reference has not
    expired the range is this file's mapping and nothing else's.
    """
    if not sys.platform.startswith("linux") or storage.nbytes() == 0:
        return
    start = storage.data_ptr()
    entry = (stat.st_dev, stat.st_ino, start, start + storage.nbytes(), StorageWeakRef(storage))
    with _MAPPINGS_LOCK:
        _MAPPINGS[:] = [m for m in _MAPPINGS if not m[4].expired()]
        _MAPPINGS.append(entry)


def _registered(path: Path) -> list[tuple[int, int]]:
    try:
        target = os.stat(path)
    except OSError:
        return []
    with _MAPPINGS_LOCK:
        return [(lo, hi) for dev, ino, lo, hi, ref in _MAPPINGS
                if dev == target.st_dev and ino == target.st_ino and not ref.expired()]


class PageReleaser:
    """Releases the pages of tensors mapped from ``path``."""

    def __init__(self, path: Path):
        self._ranges = []
        if sys.platform.startswith("linux"):
            self._ranges = _registered(path) or _file_mappings(path)
        self._madvise = None
        if self._ranges:
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        if self._madvise is None:
            return
        page = mmap.PAGESIZE
        for t in tensors:
            if t.device.type != "cpu" or t.numel() == 0:
                continue
            first = t.data_ptr()
            # Whole pages inside the tensor only: a page it shares with a
            # neighbour may still be needed.
            start = -(-first // page) * page
            end = (first + t.numel() * t.element_size()) // page * page
            if end > start and self._inside(start, end):
                self._madvise(start, end - start, _MADV_DONTNEED)

    def _inside(self, start: int, end: int) -> bool:
        return any(lo <= start and end <= hi for lo, hi in self._ranges)


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from ``path`` (private mappings only)."""
    try:
        target = os.stat(path)
        ranges = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or "p" not in fields[1]:
                    continue
                device, inode = fields[3], int(fields[4])
                if inode != target.st_ino or not _same_device(device, target.st_dev):
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
        return ranges
    except (OSError, ValueError):
        return []


def _same_device(field: str, st_dev: int) -> bool:
    major, minor = (int(x, 16) for x in field.split(":"))
    return os.makedev(major, minor) == st_dev
