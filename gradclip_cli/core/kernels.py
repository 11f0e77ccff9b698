"""Fast first pass: ``max |x|`` and a p-norm for every row of every tensor.

A *row* is a run of consecutive elements of one flattened tensor. Its power
sum is accumulated in float32 (float64 for float64 tensors) with ``sum``'s
cascade summation, then rows are combined in float64 (power_sums.py). That
split is what makes the result accurate: torch's single fp32 reduction over
a whole tensor has relative error 2.7e-3 on 38M normal values, while these
stay near 1e-7 whatever the data (BENCHMARKS.md, accuracy).

Two kernels give the same ``Rows`` and differ only in speed per device:

* ``rows_on_cpu``: rows of up to ``CHUNK`` elements (1 MiB of float32), each
  read from memory once, its later passes hitting cache; small tensors are
  stacked, one row each. Half types are widened into a reused float32 buffer
  row by row, many times faster than ``vector_norm(..., dtype=torch.float32)``.
* ``rows_by_foreach``: rows of ``ROW`` elements; one ``torch._foreach_norm``
  call per group for the maxima and one for the norms (fused kernels on CUDA,
  as ``torch.nn.utils.clip_grad`` uses).

Neither does any I/O or host-device synchronisation.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.utils._foreach_utils import _device_has_foreach_support

from .power_sums import pointwise_pow

# Rows of the foreach kernel (a fused _foreach_norm call per group).
ROW = 1 << 12
# Pieces of the CPU kernel: 1 MiB of float32, which stays in L2 between passes.
CHUNK = 1 << 18
# Tensors below this many elements are stacked with others of their size.
SMALL = 1 << 14


@dataclass
class Rows:
    """Row results for tensors of one (device, dtype) group.

    ``tensor``, ``start`` and ``length`` locate each row (int64, CPU);
    ``max_abs`` and ``norm`` are per row on the compute device (``norm`` is
    None for p = inf, where the max is the norm). ``acc_dtype`` is the type
    the norms were accumulated in.
    """

    tensor: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    max_abs: torch.Tensor
    norm: torch.Tensor | None
    acc_dtype: torch.dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every narrower float accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flat(t: torch.Tensor) -> torch.Tensor:
    # reshape is a view for contiguous tensors; only strided ones are copied.
    return t.reshape(-1)


def row_layout(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(tensor index, start, length) of every row, tensor by tensor."""
    layout = []
    for i, t in enumerate(tensors):
        n = t.numel()
        layout.extend((i, s, min(ROW, n - s)) for s in range(0, n, ROW))
    return layout


def rows_by_foreach(tensors: Sequence[torch.Tensor], norm_type: float) -> Rows:
    """Row maxima and norms with one fused ``_foreach_norm`` call each."""
    flats = [_flat(t) for t in tensors]
    layout = row_layout(tensors)
    chunks = [flats[i][s : s + n] for i, s, n in layout]
    acc = accumulation_dtype(tensors[0].dtype)
    device = tensors[0].device
    if not chunks:
        empty = torch.empty(0, dtype=acc, device=device)
        return _rows(layout, empty, None if math.isinf(norm_type) else empty, acc)
    norms = None
    if _device_has_foreach_support(device):
        maxima = torch._foreach_norm(chunks, math.inf)
        if norm_type == 2.0 and device.type == "cuda":
            # CUDA reduces each chunk as a tree: accurate, and one fused kernel.
            norms = torch._foreach_norm(chunks, 2.0, dtype=acc)
        elif not math.isinf(norm_type):
            # Elsewhere vector_norm accumulates lane by lane (see row_norms):
            # form |x|**p and sum it in float64 instead.
            powers = torch._foreach_abs([c.to(acc) for c in chunks])
            if norm_type != 1.0:
                torch._foreach_pow_(powers, norm_type)
            norms = [x.sum(dtype=torch.float64).pow(1.0 / norm_type) for x in powers]
    else:
        maxima = [torch.linalg.vector_norm(c, math.inf) for c in chunks]
        if not math.isinf(norm_type):
            norms = [row_norms(c.to(acc).view(1, -1), norm_type)[0] for c in chunks]
    return _rows(
        layout,
        torch.stack(maxima).to(acc),
        None if norms is None else torch.stack(norms),
        acc,
    )


def rows_on_cpu(tensors: Sequence[torch.Tensor], norm_type: float, workers: int = 1) -> Rows:
    """Maxima and norms of cache-sized pieces, each read from memory once.

    A tensor of at least ``SMALL`` elements is cut into runs of ``CHUNK``
    elements, each one row: ``aminmax`` reads it into cache, and the power
    sum's passes then hit cache. Smaller tensors of equal size are stacked into
    blocks, one row per tensor, so 20,000 small tensors cost a few hundred
    reductions. ``workers`` > 1 spreads the pieces over that many threads
    (torch releases the GIL in each op).
    """
    dtype = tensors[0].dtype
    acc = accumulation_dtype(dtype)
    with_norm = not math.isinf(norm_type)
    chunks: list[tuple[int, int, int]] = []
    # Small tensors are bucketed by shape, not size: torch.stack takes them as
    # they are, sparing 20,000 reshapes (3 us each, a third of the time there).
    short: dict[tuple[int, ...], list[int]] = {}
    flats: dict[int, torch.Tensor] = {}
    for i, t in enumerate(tensors):
        n = t.numel()
        if n >= SMALL:
            flats[i] = _flat(t)
            chunks.extend((i, s, min(CHUNK, n - s)) for s in range(0, n, CHUNK))
        elif n:
            short.setdefault(tuple(t.shape), []).append(i)
    stacks = []
    for shape, members in short.items():
        length = math.prod(shape)
        per_block = max(1, CHUNK // length)
        stacks.extend((length, members[b : b + per_block])
                      for b in range(0, len(members), per_block))
    jobs = [("chunk", c) for c in chunks] + [("stack", s) for s in stacks]
    workers = max(1, min(workers, len(jobs)))
    parts = [jobs[w::workers] for w in range(workers)]

    def run(part):
        pieces = _Pieces(dtype, acc, norm_type, with_norm)
        for kind, job in part:
            if kind == "chunk":
                i, s, n = job
                pieces.chunk(flats[i][s : s + n], (i, s, n))
            else:
                length, members = job
                pieces.stack([tensors[i] for i in members], length,
                             [(i, 0, length) for i in members])
        return pieces

    if workers == 1:
        results = [run(parts[0])] if jobs else []
    else:
        # The last part runs on the calling thread, the others on the shared pool.
        pending = [_pool(workers - 1).submit(run, part) for part in parts[:-1]]
        last = run(parts[-1])
        results = [f.result() for f in pending] + [last]
    layout = [loc for r in results for loc in r.layout]
    if not layout:
        empty = torch.empty(0, dtype=acc)
        return _rows(layout, empty, empty if with_norm else None, acc)
    # Rows in (tensor, start) order whatever the number of workers: a tensor's
    # rows are then summed in one order, and its result does not depend on
    # how many threads or ranks shared the work.
    order = sorted(range(len(layout)), key=layout.__getitem__)
    layout = [layout[i] for i in order]
    order = torch.tensor(order, dtype=torch.int64)
    maxima = torch.cat([m for r in results for m in r.all_maxima()])[order]
    norms = None
    if with_norm:
        sums = torch.cat([x for r in results for x in r.all_sums()]).double()[order]
        norms = pointwise_pow(sums, 1.0 / norm_type)
    return _rows(layout, maxima, norms, acc)


# One pool of worker threads for the process, grown on demand and reused by
# every call: starting threads per call cost 7 ms a thread on a loaded 2-core
# machine, 0.7 s over 50 checkpoints (BENCHMARKS.md, "trend"). Which thread
# runs a part changes nothing: the parts and the row order are fixed above.
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _pool(size: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < size:
            old = _POOL
            _POOL = ThreadPoolExecutor(size, thread_name_prefix="gradclip-norms")
            _POOL_SIZE = size
            if old is not None:
                old.shutdown(wait=False)  # its running parts finish; new ones go here
        return _POOL


def _forget_pool() -> None:
    """In a forked child the parent's threads do not exist: start afresh."""
    global _POOL, _POOL_SIZE, _POOL_LOCK
    _POOL, _POOL_SIZE, _POOL_LOCK = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


class _Pieces:
    """One worker's buffers and results. Buffers are reused: allocating per
    piece would page-fault on every piece."""

    def __init__(self, dtype, acc, norm_type, with_norm):
        self.acc, self.norm_type, self.with_norm = acc, norm_type, with_norm
        self.widen = dtype != acc
        self.wide = torch.empty(CHUNK, dtype=acc) if self.widen else None
        self.stacked = torch.empty(CHUNK, dtype=dtype)
        self.scratch = torch.empty(CHUNK, dtype=acc)
        self.layout: list[tuple[int, int, int]] = []
        # Chunks come before stacks (rows_on_cpu's job order): a chunk's results
        # are 0-dim and stacked once at the end, sparing two small ops a chunk.
        self.highs: list[torch.Tensor] = []
        self.lows: list[torch.Tensor] = []
        self.chunk_sums: list[torch.Tensor] = []
        self.maxima: list[torch.Tensor] = []
        self.sums: list[torch.Tensor] = []

    def all_maxima(self) -> list[torch.Tensor]:
        """Row maxima in layout order."""
        if not self.highs:
            return self.maxima
        return [torch.maximum(torch.stack(self.highs), torch.stack(self.lows).neg()),
                *self.maxima]

    def all_sums(self) -> list[torch.Tensor]:
        """Row power sums in layout order."""
        return [torch.stack(self.chunk_sums), *self.sums] if self.chunk_sums else self.sums

    def _widened(self, x: torch.Tensor) -> torch.Tensor:
        if not self.widen:
            return x
        wide = self.wide[: x.numel()].view(x.shape)
        wide.copy_(x)
        return wide

    def chunk(self, x: torch.Tensor, where) -> None:
        if self.maxima:
            raise AssertionError("chunks must come before stacks")
        x = self._widened(x)
        low, high = torch.aminmax(x)
        # max |x| = max(max x, -min x): no |x| temporary (formed in all_maxima).
        self.highs.append(high)
        self.lows.append(low)
        if self.with_norm:
            self.chunk_sums.append(power_sums(x, self.norm_type, self.scratch))
        self.layout.append(where)

    def stack(self, xs, length: int, where) -> None:
        block = self.stacked[: len(xs) * length].view(len(xs), *xs[0].shape)
        torch.stack(xs, out=block)
        block = block.view(len(xs), length)
        block = self._widened(block)
        self.maxima.append(torch.maximum(block.amax(1), block.amin(1).neg()))
        if self.with_norm:
            self.sums.append(power_sums(block, self.norm_type, self.scratch, dim=1))
        self.layout.extend(where)


def power_sums(x: torch.Tensor, norm_type: float, scratch: torch.Tensor, dim=None):
    """``sum |x| ** p`` (p finite) over ``dim`` (all of ``x`` when None), unrooted.

    ``|x| ** p`` is formed in ``scratch`` (cache-resident) and summed with
    ``sum``, whose cascade summation keeps the relative error near 2e-7 on
    any fp32 run up to 2**20 elements, constant or random. ``vector_norm``
    accumulates lane by lane: it loses 4e-6 on 4,096 equal fp32 values (p = 2)
    and 3e-6 on random ones for p = 0.5 (BENCHMARKS.md, accuracy).
    """
    out = scratch[: x.numel()]
    if x.dim() != 1:
        out = out.view(x.shape)
    if norm_type == 2.0:
        torch.mul(x, x, out=out)
    else:
        torch.abs(x, out=out)
        if norm_type != 1.0:
            out.pow_(norm_type)
    return out.sum() if dim is None else out.sum(dim)


def row_norms(block: torch.Tensor, norm_type: float) -> torch.Tensor:
    """p-norm of each row of a 2-D block (p finite), as float64 (see power_sums)."""
    scratch = torch.empty(block.numel(), dtype=block.dtype)
    return power_sums(block, norm_type, scratch, dim=1).double().pow(1.0 / norm_type)


def _rows(layout, max_abs, norm, acc) -> Rows:
    index = torch.tensor(layout, dtype=torch.int64).reshape(-1, 3)
    return Rows(index[:, 0], index[:, 1], index[:, 2], max_abs, norm, acc)
