"""Fast first pass: ``max |x|`` and a p-norm for every row of every tensor.

A *row* is a run of consecutive elements of one flattened tensor. Its power
sum is accumulated in float32 (float64 for float64 tensors) with ``sum``'s
cascade summation, or for p = 2 from the norms of its runs of ``ROW``
elements (one read, no ``x * x`` written), then rows are combined in float64
(power_sums.py). That
split is what makes the result accurate: torch's single fp32 reduction over
a whole tensor has relative error 2.7e-3 on 38M normal values, while these
stay near 1e-7 whatever the data (BENCHMARKS.md, accuracy).

Three kernels give ``Rows`` and differ in speed per device and purpose:

* ``rows_on_cpu``: rows of up to ``CHUNK`` elements (1 MiB of float32), each
  read from memory once, its later passes hitting cache; small tensors are
  stacked, one row each. Half types are widened into a reused float32 buffer
  row by row, many times faster than ``vector_norm(..., dtype=torch.float32)``.
* ``squares_on_cpu``: the drop-ins' and the monitor's 2-norm (float32 and
  float64, no max): rows of ``ROW`` elements reduced by torch's own
  ``vector_norm`` over a last dimension, short enough to be accurate in
  float32, so every element is read once, as torch's ``clip_grad_norm_``
  reads it; small tensors are packed into cache-sized blocks first.
* ``sums_by_foreach``: one row per tensor, a fixed number of fused
  ``torch._foreach_norm`` calls per group accumulated in float64 (fused
  kernels on CUDA, as ``torch.nn.utils.clip_grad`` uses): the host's work
  follows the number of tensors, never their size.

None does any I/O or host-device synchronisation.
"""

from __future__ import annotations

import math
import os
import threading
from array import array
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
)

from .power_sums import pointwise_pow

# Pieces of the CPU kernel: 1 MiB of float32, which stays in L2 between passes.
CHUNK = 1 << 18
# Tensors below this many elements are stacked with others of their size.
SMALL = 1 << 14


@dataclass
class Rows:
    """Row results for tensors of one (device, dtype) group.

    ``tensor``, ``start`` and ``length`` locate each row (int64, CPU);
    ``max_abs`` and ``norm`` are per row on the compute device. ``norm`` is
    None for p = inf, where the max is the norm; ``max_abs`` is None where
    it was not asked for (``with_max=False``): a norm is certified from its
    own power sum, and the max is only reported. Where ``unit`` (a 0-dim
    tensor) is given, ``norm`` is that of the values divided by it.
    ``acc_dtype`` is the type the norms were accumulated in.
    """

    tensor: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    max_abs: torch.Tensor | None
    norm: torch.Tensor | None
    acc_dtype: torch.dtype
    unit: torch.Tensor | None = None

    def device_values(self) -> list[torch.Tensor]:
        """The tensors that live on the compute device, to read back together."""
        return [x for x in (self.max_abs, self.norm, self.unit) if x is not None]

    def with_values(self, values: list[torch.Tensor]) -> Rows:
        """The same rows with ``device_values()`` replaced (by their host copies)."""
        values = iter(values)
        fields = [None if x is None else next(values) for x in (self.max_abs, self.norm,
                                                                 self.unit)]
        return Rows(self.tensor, self.start, self.length, fields[0], fields[1], self.acc_dtype,
                    fields[2])


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every narrower float accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flat(t: torch.Tensor) -> torch.Tensor:
    # reshape is a view for contiguous tensors; only strided ones are copied.
    return t.reshape(-1)


def sums_by_foreach(tensors: Sequence[torch.Tensor], norm_type: float,
                    with_max: bool = True, foreach: bool | None = None) -> Rows:
    """One row per tensor from a fixed number of fused ops, whatever the sizes.

    The accelerator kernel: ``torch._foreach_norm`` over the whole group (a
    loop of ``vector_norm`` where the device has no foreach kernels, as
    torch's clip_grad does), no views per piece, no host-device read. CUDA
    reduces each tensor as a tree; the accumulation is float64:

    * float16/bfloat16/float32 and ``p <= 6`` (``FLOAT64_SAFE_P``): plain
      float64 norms, which no finite input can overflow or underflow;
    * float64 tensors, or a larger ``p``: every tensor divided by the group's
      largest ``|x|`` first (``unit``, a 0-dim tensor on the device), so each
      term is at most 1 and the sum cannot overflow. A tensor far below the
      group's largest can still underflow there; ``norms._finish_rows``
      certifies each row from its own sum and recomputes those exactly.

    ``foreach`` as torch's: None uses the fused kernels where the device has
    them, True requires them, False loops.

    On CUDA with Triton importable, one Triton pass replaces all of this
    (``triton_norms``: every element read once, two launches per group, the
    power sums accurate at any magnitude); ``foreach=False`` keeps the loop.
    """
    device = tensors[0].device
    dtype = tensors[0].dtype
    fused_pass = fused_pass_sums(tensors, norm_type) if foreach is not False else None
    if fused_pass is not None:
        # Triton's one read of every element (triton_norms.py): norms accumulated as
        # float64 sums of power-of-two-scaled terms, accurate at any magnitude.
        layout = [(i, 0, t.numel()) for i, t in enumerate(tensors)]
        maxima = fused_pass.maxima() if with_max or math.isinf(norm_type) else None
        norms = None if math.isinf(norm_type) else fused_pass.norms()
        return _rows(layout, maxima, norms, torch.float64)
    index = [i for i, t in enumerate(tensors) if t.numel()]  # inf-norms of empty ones raise
    live = [tensors[i] for i in index]
    layout = [(i, 0, tensors[i].numel()) for i in index]
    n = len(live)
    safe = dtype != torch.float64 and (math.isinf(norm_type) or norm_type <= FLOAT64_SAFE_P)
    fused = _fused(device, foreach)
    maxima = norms = unit = None
    if n and (with_max or not safe or math.isinf(norm_type)):
        maxima = _stacked(_norms(live, math.inf, fused)).to(torch.float64)
    if n and not math.isinf(norm_type):
        if safe:
            norms = _stacked(_norms(live, norm_type, fused, torch.float64))
        else:
            top = maxima.max()
            unit = torch.where(torch.isfinite(top) & (top > 0), top, 1.0)
            wide = live if dtype == torch.float64 else [t.to(torch.float64) for t in live]
            norms = _stacked(_norms(_divided(wide, unit, fused), norm_type, fused))
    if not n:
        maxima = norms = torch.empty(0, dtype=torch.float64, device=device)
        norms = None if math.isinf(norm_type) else norms
    if not with_max and not math.isinf(norm_type):
        maxima = None
    return _rows(layout, maxima, norms, torch.float64, unit=unit)


# Below this p, sums of |x| ** p of float16/bfloat16/float32 values in float64
# can neither overflow nor underflow: (3.4e38 ** 6) * 1e12 elements < 1.8e308,
# and (1.4e-45 ** 6) = 7.5e-270 > 2.2e-308 * 2**24 * 1e12.
FLOAT64_SAFE_P = 6.0


def fused_pass_sums(tensors: Sequence[torch.Tensor], norm_type: float):
    """The Triton kernel's sums of ``tensors`` (one device, one dtype), or None where
    it does not serve: no Triton, not CUDA, a layout it does not read. Triton is
    imported only for CUDA tensors (or the interpreter's tests: triton_norms.usable)."""
    if not tensors or (tensors[0].device.type != "cuda"
                       and os.environ.get("GRADCLIP_TRITON") != "interpret"):
        return None
    from . import triton_norms

    if not triton_norms.usable(tensors, norm_type):
        return None
    return triton_norms.tensor_sums_or_none(tensors, norm_type)


def _fused(device: torch.device, foreach: bool | None) -> bool:
    if foreach is None:
        return _device_has_foreach_support(device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return foreach


def _norms(tensors, ord: float, fused: bool, dtype: torch.dtype | None = None):
    """Each tensor's ``ord``-norm: one fused call, or a loop where the device has none."""
    if fused:
        return list(torch._foreach_norm(tensors, ord, dtype=dtype))
    return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]


def _divided(tensors, unit: torch.Tensor, fused: bool):
    if fused:
        return torch._foreach_div(tensors, unit)
    return [t / unit for t in tensors]


def total_on_device(tensors: Sequence[torch.Tensor], norm_type: float,
                    foreach: bool | None = None) -> torch.Tensor:
    """The p-norm of all elements (p > 0 or inf), as a 0-dim float64 tensor on the
    first tensor's device, with no host-device read (torch's clip_grad has none).

    Each (device, dtype) group is reduced by ``sums_by_foreach`` to its own
    norm ``v_g``; groups combine as ``M * ||v / M||_p`` with ``M = max v_g``,
    so a sum of powers never overflows. NaN propagates, then inf, as torch's.
    On CUDA with Triton, a group's norm comes from the one-read Triton pass
    (``triton_norms``) instead of ``sums_by_foreach``.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    first = tensors[0].device
    grouped = _group_tensors_by_device_and_dtype([list(tensors)])
    totals = []
    for [group], _ in grouped.values():
        fused_pass = fused_pass_sums(group, norm_type) if foreach is not False else None
        if fused_pass is not None:
            totals.append(fused_pass.total_norm().to(first))
            continue
        rows = sums_by_foreach(group, norm_type, with_max=False, foreach=foreach)
        values = rows.max_abs if rows.norm is None else rows.norm
        total = torch.linalg.vector_norm(values, norm_type)
        totals.append((total if rows.unit is None else total * rows.unit).to(first))
    totals = torch.stack(totals)
    if len(totals) == 1:
        return totals[0]
    top = totals.max()
    unit = torch.where(torch.isfinite(top) & (top > 0), top, 1.0)
    return unit * torch.linalg.vector_norm(totals / unit, norm_type)


def _stacked(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(values)


def rows_on_cpu(tensors: Sequence[torch.Tensor], norm_type: float, workers: int = 1,
                with_max: bool = True) -> Rows:
    """Maxima and norms of cache-sized pieces, each read from memory once.

    A tensor of at least ``SMALL`` elements is cut into runs of ``CHUNK``
    elements, each one row: ``aminmax`` reads it into cache, and the power
    sum's passes then hit cache (at p = 2 one pass: ``row_norms_into``).
    Smaller tensors of equal size are stacked into blocks, one row per
    tensor, so 20,000 small tensors cost a few hundred
    reductions. ``workers`` > 1 spreads the pieces over that many threads
    (torch releases the GIL in each op). ``with_max=False`` skips the
    ``aminmax`` pass (p finite): the power sum alone certifies a norm.
    """
    dtype = tensors[0].dtype
    acc = accumulation_dtype(dtype)
    if norm_type < 1:
        # The norm is the sum to the power 1/p, which multiplies the sum's relative
        # error by 1/p: float32's 2e-7 would be 4e-6 at p = 0.1. Below p = 1 the
        # power sum is formed and summed in float64.
        acc = torch.float64
    with_norm = not math.isinf(norm_type)
    with_max = with_max or not with_norm
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
        pieces = _Pieces(dtype, acc, norm_type, with_norm, with_max)
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
        return _rows(layout, empty if with_max else None, empty if with_norm else None, acc)
    # Rows in (tensor, start) order whatever the number of workers: a tensor's
    # rows are then summed in one order, and its result does not depend on
    # how many threads or ranks shared the work.
    order = sorted(range(len(layout)), key=layout.__getitem__)
    layout = [layout[i] for i in order]
    order = torch.tensor(order, dtype=torch.int64)
    maxima = None
    if with_max:
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


# Each thread keeps its piece buffers between calls: 1 MiB freshly allocated
# is a fresh mapping, whose first touch page-faults on every call (a third of
# the time of a monitor step over 1,000 small tensors).
_BUFFERS = threading.local()


def _buffers(dtype: torch.dtype, acc: torch.dtype, widen: bool):
    cache = getattr(_BUFFERS, "by_type", None)
    if cache is None:
        cache = _BUFFERS.by_type = {}
    key = (dtype, acc)
    if key not in cache:
        cache[key] = (torch.empty(CHUNK, dtype=acc) if widen else None,
                      torch.empty(CHUNK, dtype=dtype), torch.empty(CHUNK, dtype=acc))
    return cache[key]


class _Pieces:
    """One worker's buffers and results. Buffers are reused: allocating per
    piece would page-fault on every piece."""

    def __init__(self, dtype, acc, norm_type, with_norm, with_max=True):
        self.acc, self.norm_type, self.with_norm = acc, norm_type, with_norm
        self.with_max = with_max
        self.stacks_started = False
        self.widen = dtype != acc
        self.wide, self.stacked, self.scratch = _buffers(dtype, acc, self.widen)
        self.rows = self.scratch[: -(-CHUNK // ROW)]
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
        if self.stacks_started:
            raise AssertionError("chunks must come before stacks")
        x = self._widened(x)
        if self.with_max:
            low, high = torch.aminmax(x)
            # max |x| = max(max x, -min x): no |x| temporary (formed in all_maxima).
            self.highs.append(high)
            self.lows.append(low)
        if self.with_norm:
            if self.norm_type == 2.0:
                # One read of the cached chunk, no |x|^2 written: its rows'
                # norms (see ROW), their squares summed in float64.
                rows = row_norms_into(x, self.rows[: -(-x.numel() // ROW)])
                self.chunk_sums.append(torch.linalg.vector_norm(rows, dtype=torch.float64)
                                       .square_())
            else:
                self.chunk_sums.append(power_sums(x, self.norm_type, self.scratch))
        self.layout.append(where)

    def stack(self, xs, length: int, where) -> None:
        self.stacks_started = True
        block = self.stacked[: len(xs) * length].view(len(xs), *xs[0].shape)
        torch.stack(xs, out=block)
        block = block.view(len(xs), length)
        block = self._widened(block)
        if self.with_max:
            self.maxima.append(torch.maximum(block.amax(1), block.amin(1).neg()))
        if self.with_norm:
            # The block is this worker's own copy: |x| ** p is formed over it in place.
            self.sums.append(power_sums(block, self.norm_type, block.view(-1), dim=1))
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


# Rows of the p = 2 kernel. torch's CPU 2-norm over a last dimension (the
# vectorised path of ATen's ReduceOpsKernel.cpp) accumulates a row in one
# vector of L lanes with fused multiply-adds, then adds the lanes in order: an
# element's square goes through at most ROW / L + L - 1 roundings, and the
# square root one more, so a row's norm, and every float64 sum of rows, is
# within ((ROW / L + L - 1) / 2 + 1) * 2**-24 of exact. ROW is the longest
# power of two that keeps this under 1e-6 for the lanes torch runs here: with
# AVX-512 (L = 16) rows of 256 allow 31 roundings, 9.8e-7; with AVX2 (L = 8)
# rows of 128 allow 23, 7.5e-7; elsewhere (NEON: L = 4; generic code: 8)
# rows of 64 allow at most 19, 6.3e-7. Longer rows cost less: on GPT-2's
# shapes rows of 256 take the time of torch's one-accumulator kernel over the
# whole tensor, rows of 128 1.1x, rows of 64 1.3x (BENCHMARKS.md, issue 18).
# That whole-tensor kernel is 2.2e-6 off on 4,096 fp32 values 0.1 and 1.0e-5
# on 16,448 values 1/3 (tests/core/test_squares.py).
ROW = {"AVX512": 256, "AVX2": 128}.get(torch.backends.cpu.get_cpu_capability(), 64)
LANES = {256: 16, 128: 8, 64: 4}[ROW]


def squares_on_cpu(tensors: Sequence[torch.Tensor]) -> Rows:
    """Each tensor's 2-norm (float32 or float64 tensors), from one read of its elements.

    One row per tensor, in input order, its norm from ``square_norms_on_cpu``
    in float64 (``acc_dtype`` is the rows' type: ``norms._trusted``
    certifies each from its own sum).
    """
    sizes = list(map(torch.Tensor.numel, tensors))
    order = torch.arange(len(sizes))
    length = torch.frombuffer(array("q", sizes), dtype=torch.int64) if sizes else order
    norm = square_norms_on_cpu(tensors, sizes)
    return Rows(order, torch.zeros_like(order), length, None, norm, tensors[0].dtype)


def norms_by_foreach(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's 2-norm in float64, on their device, in input order: one fused
    ``_foreach_norm`` accumulating in float64 (a loop where the device has no
    fused kernels), whatever the tensors' sizes, and no host read.

    For float16, bfloat16 and float32 tensors a float64 sum of squares can
    neither overflow nor underflow (``FLOAT64_SAFE_P``): a finite norm is
    accurate to float64's rounding, and a non-finite one means a NaN or an
    infinity among the elements. An empty tensor's norm is 0. On CUDA with Triton
    the norms come from its one-read pass (``triton_norms``), as accurate.
    """
    tensors = list(tensors)
    fused_pass = fused_pass_sums(tensors, 2.0)
    if fused_pass is not None:
        return fused_pass.norms()
    return _stacked(_norms(tensors, 2.0, _fused(tensors[0].device, None), torch.float64))


def square_norms_on_cpu(tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """Each tensor's 2-norm in float64, in input order (CPU float32 or float64
    tensors of one dtype, ``sizes`` their numbers of elements).

    A tensor is cut into rows of ``ROW`` elements, each row's norm taken by
    torch's own kernel (accurate, see ``ROW``) and the rows' squares summed in
    float64. A tensor of at least ``SMALL`` elements is one ``vector_norm``
    over its rows; smaller ones are copied together into cache-sized blocks
    (``_Packing``), so 1,000 of them cost a few ops, not 1,000. An empty
    tensor's norm is 0.
    """
    dtype, least = tensors[0].dtype, min(sizes)
    if least >= SMALL:  # GPT-2's shapes: every tensor big
        return _big_norms(list(map(_flat, tensors)), dtype)
    if least and max(sizes) < SMALL:  # many small tensors: every one packed
        return _packing(tensors, sizes, dtype).norms(tensors)
    big = [i for i, n in enumerate(sizes) if n >= SMALL]
    small = [i for i, n in enumerate(sizes) if 0 < n < SMALL]
    norm = torch.zeros(len(sizes), dtype=torch.float64)
    if big:
        norm[big] = _big_norms([_flat(tensors[i]) for i in big], dtype)
    if small:
        members = [tensors[i] for i in small]
        norm[small] = _packing(members, [sizes[i] for i in small], dtype).norms(members)
    return norm


_SHAPE = attrgetter("shape")
_ONE_DIM = {1}


def row_norms_into(flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The norms of ``flat``'s rows of ``ROW`` elements (its short tail one more
    row) into ``out``, ``ceil(n / ROW)`` of them in ``flat``'s type (see ``ROW``)."""
    n = flat.numel()
    main = n - n % ROW
    torch.linalg.vector_norm(flat[:main].view(-1, ROW), dim=1, out=out[: main // ROW])
    if n > main:
        torch.linalg.vector_norm(flat[main:], out=out[main // ROW])
    return out


def _big_norms(flats: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Each flat tensor's 2-norm in float64, from the float norms of its rows.

    Every tensor's rows (and its short tail, as one more row) go into one
    buffer, widened to float64 once; each tensor's slice is then one float64
    norm. Few ops per tensor: under two threads each is an OpenMP region,
    and on a loaded machine those are what costs (Findings 2).
    """
    counts = [-(-f.numel() // ROW) for f in flats]
    rows = _rows_buffer(sum(counts), dtype)
    start = 0
    for flat, count in zip(flats, counts):
        row_norms_into(flat, rows[start : start + count])
        start += count
    wide = rows.double()
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count)
    return torch.stack([torch.linalg.vector_norm(wide[a:b]) for a, b in zip(bounds, bounds[1:])])


# Row norms of up to this many elements go into a buffer each thread keeps
# (GPT-2 124M has 486,093 rows of 256): a fresh one is a fresh mapping, whose
# first touch page-faults on every call.
_KEPT_ROWS = 1 << 22


def _rows_buffer(count: int, dtype: torch.dtype) -> torch.Tensor:
    if count > _KEPT_ROWS:
        return torch.empty(count, dtype=dtype)
    cache = getattr(_BUFFERS, "rows", None)
    if cache is None:
        cache = _BUFFERS.rows = {}
    kept = cache.get(dtype)
    if kept is None or kept.numel() < count:
        kept = cache[dtype] = torch.empty(max(count, 1 << 16), dtype=dtype)
    return kept[:count]


class _Packing:
    """Where small tensors of given shapes go in a block buffer, rows aligned.

    Each tensor starts on a row boundary; the rest of its last row is padding,
    zeroed on every use (the blocks share one buffer: another block's values
    may lie there). Built once per list of shapes and reused: the views it
    copies into are what would cost a Python call per tensor. A run of
    tensors of one shape that fills whole rows (a model's repeated layers)
    is one ``torch.stack`` into its place, cheaper than a copy per tensor.
    """

    def __init__(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype):
        self.buffer = torch.zeros(CHUNK, dtype=dtype)
        # Per block: its copies ((first, end, destination) runs), padding, length used.
        self.blocks: list[tuple[list[tuple[int, int, object]], torch.Tensor | None, int]] = []
        owner: list[int] = []
        start, runs, pads = 0, [], []
        for i, shape in enumerate(shapes):
            n = math.prod(shape)
            rows = -(-n // ROW)
            if start + rows * ROW > CHUNK:
                self._close(runs, pads, start)
                start, runs, pads = 0, [], []
            place = self.buffer[start : start + n].view(shape)
            last = runs[-1] if runs else None
            if (last is not None and n % ROW == 0 and last[3] == tuple(shape)
                    and last[1] == i):
                runs[-1] = (last[0], i + 1, last[2] + [place], last[3])
            else:
                runs.append((i, i + 1, [place], tuple(shape) if n % ROW == 0 else None))
            pads.extend(range(start + n, start + rows * ROW))
            owner.extend([i] * rows)
            start += rows * ROW
        self._close(runs, pads, start)
        self.owner = torch.tensor(owner, dtype=torch.int64)
        self.rows = torch.empty(len(owner), dtype=dtype)
        self.count = len(shapes)

    def _close(self, runs, pads, used) -> None:
        pad = torch.tensor(pads, dtype=torch.int64) if pads else None
        copies, singles = [], None
        for first, end, places, shape in runs:
            if end - first > 1:
                whole = places[0].numel() * (end - first)
                offset = places[0].storage_offset()
                copies.append((first, end, self.buffer[offset : offset + whole].view(
                    end - first, *shape)))
                singles = None
            elif singles is not None and singles[1] == first:
                singles[1] = end
                singles[2].append(places[0])
            else:
                singles = [first, end, [places[0]]]
                copies.append(singles)
        self.blocks.append(([tuple(c) for c in copies], pad, used))

    def norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Each tensor's 2-norm in float64 (see ``squares_on_cpu``)."""
        done = 0
        for copies, pad, used in self.blocks:
            for first, end, place in copies:
                if isinstance(place, list):
                    torch._foreach_copy_(place, tensors[first:end])
                else:
                    torch.stack(tensors[first:end], out=place)
            if pad is not None:
                self.buffer.index_fill_(0, pad, 0)
            count = used // ROW
            torch.linalg.vector_norm(self.buffer[:used].view(-1, ROW), dim=1,
                                     out=self.rows[done : done + count])
            done += count
        squares = self.rows.double().square_()
        sums = torch.zeros(self.count, dtype=torch.float64).index_add_(0, self.owner, squares)
        return sums.sqrt_()


def _packing(tensors: list[torch.Tensor], sizes: list[int], dtype: torch.dtype) -> _Packing:
    """This thread's packing for the shapes of ``tensors`` (of ``sizes`` elements),
    a few kept: a model has one or two lists.

    When every tensor is 1-D (biases, norms' weights) the sizes are the shapes,
    and they are the key: cheaper to read and to hash than ``torch.Size``-s.
    """
    cache = getattr(_BUFFERS, "packings", None)
    if cache is None:
        cache = _BUFFERS.packings = {}
    flat = set(map(torch.Tensor.dim, tensors)) == _ONE_DIM
    key = (tuple(sizes), dtype) if flat else (tuple(map(_SHAPE, tensors)), dtype, None)
    packing = cache.pop(key, None)
    if packing is None:
        shapes = tuple((n,) for n in sizes) if flat else key[0]
        packing = _Packing(shapes, dtype)
    cache[key] = packing  # most recently used last
    while len(cache) > 4:
        cache.pop(next(iter(cache)))
    return packing


def _rows(layout, max_abs, norm, acc, unit=None) -> Rows:
    index = torch.tensor(layout, dtype=torch.int64).reshape(-1, 3)
    return Rows(index[:, 0], index[:, 1], index[:, 2], max_abs, norm, acc, unit)
