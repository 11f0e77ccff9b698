"""The one measuring step: what a selection says to measure, read and reduced to power sums.

``measure`` is the step every command takes (inspect, clip, trend, compare,
autopsy): a ``Selection`` (``source/what.py``) in, a ``Measurement`` out, a
plain immutable result that the report builders read. What a selection
says to measure is a list of ``Derivation``s (which stored tensors each
measured name reads and the transform that gives its value); gradients held
whole in memory that share storage are measured as their distinct pieces
(``core/elements.py``), each a stored tensor like any other, so every
element is read once and the rows follow by index.

The reading is the same for every kind: held tensors go to the core as they
are, pieces read on demand are read about ``_BATCH_BYTES`` at a time, and
each batch is handed to ``on_batch`` (progress, page release) once
measured, so memory stays bounded by a batch whatever the checkpoint's size.

A value that is a scale of one stored tensor (the identity for gradients and
weights, the bias correction of ``exp_avg``) is never copied: its power sums
are the stored tensor's, scaled. Any other transform (an optimizer's update,
a square root) is computed a batch of parameters at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gradclip_cli.core import PowerSums, concat, tensor_power_sums
from gradclip_cli.source.interface import Derivation, StoredTensor

if TYPE_CHECKING:
    from gradclip_cli.core import Elements
    from gradclip_cli.source.what import Selection

_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class Measurement:
    """One selection measured: per measured name (``names``, the selection's order),
    power sums of its own elements (``sums``: its row in a report) and of the elements
    it holds first (``owned``: each shared element once, what groups and the total
    add), and how many distinct elements each covers and owns. ``shares``: for each
    name, the other names holding some of its elements. ``weights``: the same
    parameters' weights (for ``ratio``), where asked for and every one is held."""

    names: tuple[str, ...]
    sums: PowerSums
    owned: PowerSums
    counts: tuple[int, ...]
    owned_counts: tuple[int, ...]
    shares: tuple[tuple[str, ...], ...]
    weights: PowerSums | None = None

    def total(self) -> PowerSums:
        """Every element once, combined."""
        return self.owned.total()


def measure(selection: Selection, p: float, device: torch.device | None = None, *,
            elements: Elements | None = None, owners: Sequence[int] | None = None,
            progress=None, label: str = "measuring", release=None, session=None,
            weights: bool = False, workers: int = 1) -> Measurement:
    """Measure ``selection``: the one step from what to measure to its power sums.

    ``elements``: the distinct storage elements of the selection's tensors,
    where they are gradients held whole (``core.distinct_elements``); each
    distinct element is then read once. Else every name reads its own
    derivation (read piece by piece or derived from optimizer state: no two
    names share an element, so each owns all of its own).
    ``progress`` (``Steps``): ``begin(label, total)`` and ``advance(bytes)``;
    ``release`` (a ``PageReleaser``): pages given back once measured.
    ``session`` (under a launcher): each rank measures its share of the reads,
    split by bytes, or as ``owners`` says (the rank of each read), and every
    rank gets all of them back in the single-process order.
    ``weights``: also the weights of the measured names (``Selection.weights``).
    """
    names = tuple(selection.names)
    if elements is not None:
        pieces, rows = elements.measured()
        reads = [Derivation.stored(StoredTensor.whole("", t)) for t in pieces]
    else:
        reads, rows = list(selection.derivations), None
    measured = _measured(reads, p, device, progress, label, release, session, owners,
                         workers)
    if rows is None:
        sums = owned = measured
        counts = owned_counts = tuple(t.numel() for t in selection.tensors)
        shares: tuple[tuple[str, ...], ...] = tuple(() for _ in names)
    else:
        sums = measured.take(torch.tensor(rows, dtype=torch.int64))
        owned = measured.take(torch.arange(len(elements)))
        counts = tuple(elements.count(i) for i in range(len(elements)))
        owned_counts = tuple(piece.numel() for piece in elements.owned)
        shares = tuple(tuple(names[j] for j in others) for others in elements.shares)
    weight_sums = None
    held = selection.weights
    if weights and held and all(w is not None for w in held):
        # No progress of its own: the weights are read beside what was measured.
        weight_sums = _measured([Derivation.stored(w) for w in held], p, device, None, label,
                                release, session, None, workers)
    return Measurement(names, sums, owned, counts, owned_counts, shares, weight_sums)


def _measured(reads: list[Derivation], p: float, device, progress, label: str, release,
              session, owners: Sequence[int] | None, workers: int) -> PowerSums:
    """``power_sums`` of ``reads``, all here, or under a launcher this rank's share of
    them (split by bytes, or as ``owners`` says), every rank getting all of them back in
    the single-process order."""
    sizes = [sum(t.nbytes for t in d.reads) for d in reads]

    def done(batch) -> None:
        if progress is not None:
            progress.advance(sum(t.numel() * t.dtype.itemsize for t in batch))
        if release is not None:
            release.release(batch)

    def run(only: list[int] | None) -> PowerSums:
        chosen = reads if only is None else [reads[i] for i in only]
        if progress is not None:
            progress.begin(label, total=sum(sizes) if only is None
                           else sum(sizes[i] for i in only))
        return power_sums(chosen, p, device,
                          done if progress is not None or release is not None else None,
                          workers)

    if session is None:
        return run(None)
    from gradclip_cli.distributed.combine import gather_power_sums
    from gradclip_cli.distributed.pieces import assign, owned

    if owners is None:
        owners = assign(sizes, session.world_size)
    mine = owned(owners, session.rank)
    return gather_power_sums(session, run(mine), mine, len(sizes))


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
