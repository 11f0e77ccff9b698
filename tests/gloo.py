"""Spawned gloo ranks for the tests: every rank closes its group with the others and
leaves without the interpreter's teardown.

Left to the interpreter's exit, a gloo group's threads abort a rank now and then
("terminate called without an active exception", SIGABRT), after its files are
written: seen under load in the DCP, accelerate, DeepSpeed and DDP fixtures, twice
in a row in one CI run. ``closing`` runs a rank's work, then ``dist.barrier()`` and
``dist.destroy_process_group()`` on every rank together, flushes the output and
leaves with ``os._exit``, which skips the C++ static destructors where the abort
happens. A failure inside the work still raises as before.
"""

from __future__ import annotations

import os
import sys


def leave() -> None:
    """Close the process group with every other rank, flush, and exit 0 at once."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def closing(rank: int, work, *args) -> None:
    """``work(rank, *args)``, then ``leave()``: the entry ``mp.spawn`` runs."""
    work(rank, *args)
    leave()


def spawn(work, *args, nprocs: int) -> None:
    """``work(rank, *args)`` on ``nprocs`` spawned processes, each closed by ``closing``."""
    import torch.multiprocessing as mp

    mp.spawn(closing, args=(work, *args), nprocs=nprocs, join=True)
