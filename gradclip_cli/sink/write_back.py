"""Executing a layout's ``WriteBackPlan`` (``source/interface.py``): the writer that knows
files and nothing of why the plan names them, as ``torch.distributed.checkpoint``'s
``StorageWriter`` executes a ``SavePlan``.

One file is written whole in its own format (``write_checkpoint``). A set is
written as a new folder and switched in whole (``sharded_set``): the plan's
files written whole from what was loaded, or copied with held gradients'
storage bytes written over (a DCP chunk is a ``torch.save`` blob at a byte
range of a ``.distcp`` file, which ``.metadata`` records: scaling changes
a storage's values, not its size, so each blob is rewritten in place, same
length, its bytes and the CRC32 the zip keeps of them; ``.metadata`` is
copied byte for byte and gradclip never writes DCP's pickle); every other
file of the folder copied. Under a launcher each file is written by the rank
the command gives it (``owners``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from gradclip_cli.sink import write_checkpoint
from gradclip_cli.sink.sharded_set import set_member, write_set, write_set_by_ranks
from gradclip_cli.source.interface import Checkpoint, FileWrite, WriteBackPlan


def execute(plan: WriteBackPlan, target: Path | str, loaded: Iterable[Checkpoint],
            held: Mapping[str, torch.Tensor], *, in_place: bool, ranks=None,
            owners: Mapping[str, int] | None = None) -> int:
    """Write ``plan`` to ``target``; return how many other hard links of a replaced file
    keep the old bytes (``write_checkpoint``; 0 for a set).

    ``loaded``: the objects loaded from the files the plan writes whole, clipped
    in place; ``held``: the held gradients by name, whose bytes the plan's
    ``copies`` and ``storages`` write. ``ranks`` (``distributed.launcher.Session``)
    and ``owners`` (a file's ``set_member`` name -> rank): under a launcher,
    each rank writes its own files of a set (``sharded_set.write_set_by_ranks``).
    """
    by_path = {Path(c.path): c for c in loaded}
    if plan.folder is None:
        file, = plan.files
        return write_checkpoint(by_path[file.path], target)
    if in_place and os.path.islink(target):
        # As for one file (``write_checkpoint``): the folder the link names is
        # replaced and the link stays a link; swapping the link itself would
        # leave the set where it was and the link's name on a new folder.
        target = os.path.realpath(target)
    shards = {set_member(f.path, plan.folder): _with_copies(by_path[f.path], f, held)
              for f in plan.files if f.format is not None}
    patch = _storage_patcher(plan, held)
    if ranks is None:
        write_set(plan.folder, shards, Path(target), in_place=in_place, patch=patch)
    else:
        write_set_by_ranks(ranks, plan.folder, shards, Path(target), in_place=in_place,
                           owners=owners or {}, patch=patch)
    return 0


def _with_copies(ckpt: Checkpoint, file: FileWrite, held: Mapping[str, torch.Tensor]):
    """``ckpt`` with each of ``file.copies`` written from its held gradient (the entry's
    place in the file kept)."""
    if not file.copies:
        return ckpt
    return dataclasses.replace(ckpt, root={**ckpt.root, **{
        entry: held[tensor] for entry, tensor in file.copies}})


def _storage_patcher(plan: WriteBackPlan,
                     held: Mapping[str, torch.Tensor]) -> Callable[[str, Path], None] | None:
    """``patch(name, copy)`` for ``write_set``: the held gradients' storage bytes and their
    CRC32s into the copy of the file ``name`` (``set_member``'s name in the folder)."""
    by_name = {set_member(f.path, plan.folder): f.storages for f in plan.files if f.storages}
    if not by_name:
        return None

    def patch(name: str, out: Path) -> None:
        todo = by_name.get(name)
        if not todo:
            return
        with open(out, "r+b") as file:
            for storage in todo:
                untyped = held[storage.tensor].untyped_storage()
                data = (ctypes.c_char * untyped.nbytes()).from_address(untyped.data_ptr())
                file.seek(storage.data_start)
                file.write(data)
                crc = struct.pack("<L", zlib.crc32(data))
                for at in storage.crc_positions:
                    file.seek(at)
                    file.write(crc)
    return patch
