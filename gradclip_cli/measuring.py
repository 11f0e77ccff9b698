"""The one measuring step: what a selection says to measure, read and reduced to power sums.

``source/what.py`` says which stored tensors each measured name reads and
the transform that gives its value (a ``Derivation``); this module does the
reading for every kind alike: held tensors go to the core as they are,
pieces read on demand are read about ``_BATCH_BYTES`` at a time, and each
batch is handed to ``on_batch`` (progress, page release) once measured, so
memory stays bounded by a batch whatever the checkpoint's size.

A value that is a scale of one stored tensor (the identity for gradients and
weights, the bias correction of ``exp_avg``) is never copied: its power sums
are the stored tensor's, scaled. Any other transform (an optimizer's update,
a square root) is computed a batch of parameters at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from gradclip_cli.core import PowerSums, concat, tensor_power_sums
from gradclip_cli.source.interface import Derivation, StoredTensor

_BATCH_BYTES = 64 << 20


def power_sums(derivations: Sequence[Derivation], p: float,
               device: torch.device | None = None, on_batch: Callable | None = None,
               workers: int = 1) -> PowerSums:
    """Per-name power sums of the values ``derivations`` describe, in their order."""
    if derivations and all(d.scale is not None for d in derivations):
        sums = stored_power_sums([d.reads[0] for d in derivations], p, device, on_batch,
                                 workers)
        if all(d.scale == 1.0 for d in derivations):
            return sums
        return _scaled(sums, torch.tensor([d.scale for d in derivations], dtype=torch.float64))
    return _derived_power_sums(derivations, p, device, on_batch, workers)


# A stored tensor may carry requires_grad (torch.save keeps the flag); measuring
# is never differentiated, and out= kernels refuse such inputs under grad mode.
@torch.no_grad()
def stored_power_sums(
    tensors: Sequence[StoredTensor], p: float, device: torch.device | None = None,
    on_batch: Callable | None = None, workers: int = 1,
) -> PowerSums:
    """Per-tensor power sums of stored tensors, reading pieces a batch at a time.

    Tensors held in one piece (mapped) go to the core as they are; pieces
    read on demand are read about ``_BATCH_BYTES`` at a time, measured, and
    dropped, then combined into their tensors (``PowerSums.reduce``).
    """
    held = [s.held for s in tensors]
    if all(h is not None for h in held):
        return tensor_power_sums(held, p, device=device, on_batch=on_batch, workers=workers)
    parts: list[PowerSums] = []
    owners: list[int] = []
    batch: list = []
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if batch:
            read = [piece.read() for _, piece in batch]
            parts.append(tensor_power_sums(read, p, device=device, workers=workers))
            owners.extend(i for i, _ in batch)
            if on_batch is not None:
                on_batch(read)
        batch, size = [], 0

    for i, s in enumerate(tensors):
        for piece in s.pieces:
            batch.append((i, piece))
            size += piece.numel * s.dtype.itemsize
            if size >= _BATCH_BYTES:
                flush()
    flush()
    return concat(p, parts).reduce(torch.tensor(owners, dtype=torch.int64), len(tensors))


# Pieces of an elementwise transform: 256 KiB of float32, its temporaries in cache.
_PIECE = 1 << 16


def _by_pieces(compute: Callable[..., torch.Tensor], reads: list[torch.Tensor]) -> torch.Tensor:
    """``compute(*reads)`` for an elementwise transform, a cache-sized piece at a time.

    A transform's several passes (an update: a square root, a divide, an add,
    a multiply, a divide) then run over cached temporaries, each stored
    tensor is read from memory once and the result written once: 0.79x the
    time of the whole-tensor passes on a 38.6M fp32 update (BENCHMARKS.md,
    issue 17). The ops are elementwise and correctly rounded, so every
    element is the bits the whole-tensor computation gives.
    """
    n = reads[0].numel()
    if n <= 2 * _PIECE:
        return compute(*reads)
    flats = [r.reshape(-1) for r in reads]
    first = compute(*(f[:_PIECE] for f in flats))
    out = torch.empty(n, dtype=first.dtype)
    out[:_PIECE] = first
    for start in range(_PIECE, n, _PIECE):
        out[start : start + _PIECE] = compute(*(f[start : start + _PIECE] for f in flats))
    return out.view(reads[0].shape)


def _scaled(sums: PowerSums, factor: torch.Tensor) -> PowerSums:
    """Summaries of ``factor[i] * x_i``: scale and max move, the power sum does not."""
    return PowerSums(sums.norm_type, sums.scale * factor, sums.power_sum,
                     sums.max_abs * factor, sums.nan, sums.posinf, sums.neginf)


@torch.no_grad()
def _derived_power_sums(derived, p, device, on_batch, workers):
    """Power sums of each derivation's tensor, computed a batch of parameters at a time:
    memory stays bounded by a batch whatever the checkpoint's size."""
    parts = []
    batch: list = []
    size = 0
    # The transforms are elementwise torch ops on whole tensors, several passes each
    # (an update: a square root, an add, a multiply, a divide) on one torch thread: the
    # workers compute a batch's parameters side by side (torch releases the GIL), or the
    # transforms cost more than the reading (BENCHMARKS.md, issue 17). Reading stays in
    # this thread, in order.
    pool = ThreadPoolExecutor(workers) if workers > 1 else None

    def compute(d, reads):
        if all(tuple(r.shape) == d.shape for r in reads):
            return _by_pieces(d.compute, reads)
        return d.compute(*reads)

    def flush():
        nonlocal batch, size
        if not batch:
            return
        reads = [[t.read() for t in d.reads] for d in batch]
        values = (list(pool.map(compute, batch, reads)) if pool is not None and len(batch) > 1
                  else [compute(d, r) for d, r in zip(batch, reads)])
        del reads
        parts.append(tensor_power_sums(values, p, device=device, workers=workers))
        if on_batch is not None:
            # The pieces as stored (mapped views), not read()'s assembled copy of a
            # tensor stored in several pieces: their pages are the ones to give back.
            on_batch([piece.read() for d in batch for t in d.reads for piece in t.pieces])
        batch, size = [], 0

    try:
        for d in derived:
            batch.append(d)
            size += sum(t.nbytes for t in d.reads)
            if size >= _BATCH_BYTES:
                flush()
        flush()
    finally:
        if pool is not None:
            pool.shutdown()
    if not parts:
        return tensor_power_sums([], p, device=device, workers=workers)
    return concat(p, parts)
