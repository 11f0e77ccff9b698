"""One fused pass over many gradients on a CUDA device: a Triton multi-tensor kernel.

Per tensor it gives what the norms need, from one read of every element:
the power sum ``sum |x|^p`` (as ``S * 2^(p E)``: a float64 sum ``S`` and a
power-of-two exponent ``E``), ``max |x|`` over the finite elements, and the
counts of NaN, +inf and -inf. Two launches per (device, dtype) group,
whatever the number or sizes of the tensors, and nothing read back to the
host (issue 42, item 2: torch's ``_foreach_norm`` takes 6.1-6.7 ms on
Llama-2-7B's bf16 gradients on an H200 where one read of them takes 3.2 ms,
and a float64 ``vector_norm`` per tensor, the DTensor path's, 42.9 ms).

How the sum stays accurate at any size and magnitude (the contract's 1e-6):

* Each program reads ``TILES`` tiles of ``BLOCK`` consecutive elements of one
  tensor. A tile is scaled by a power of two ``2^-k`` that brings its largest
  finite ``|x|`` into [0.5, 1) (exact: a change of exponent, applied as two
  factors so that neither leaves float32's range), so no term ``(|x| 2^-k)^p``
  can overflow, and only terms below ``2^-126`` of the tile's largest
  underflow: they move the sum by less than ``BLOCK * 2^-126`` of itself.
* For p = 2 the tile's squares are summed in float32: each thread adds its
  16 elements, then warps and threads combine as a tree, at most 22
  additions deep, so the sum is within 22 * 2^-24 = 1.3e-6 of exact in the
  worst case and the norm, its square root, within 6.6e-7 (on real data
  ~1e-8). Other p are summed in float64 (p = 1 would keep the sum's whole
  error, p < 1 magnify it), their terms from a float64 ``exp2(p log2 y)``
  (float32's ``log2`` is 2 ulp off, which p times the exponent would
  magnify), with ``y`` scaled in float64: below p = 1 the terms a float32
  ``y`` would flush, ``2^(-149 p)`` of the largest each, are not negligible.
* Tiles, then a tensor's programs, are combined in float64, each sum carried
  with its own exponent and rescaled to the larger one (``S 2^(p (E - E'))``),
  so nothing overflows or underflows there either (float64 tensors are summed
  in float64 throughout).

The kernel runs where Triton is importable and the tensors are on CUDA
(``usable``); everywhere else gradclip keeps its ``_foreach`` path. The tests
run it on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
This module is imported only when it is used: importing Triton takes a second.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A tile of BLOCK elements is reduced in registers; a program reads TILES of them
# (read at each call: the interpreter's tests use smaller ones).
BLOCK = 2048
TILES = 16
# A tensor's programs are combined BLOCK_PROGRAMS at a time by the second kernel.
BLOCK_PROGRAMS = 256

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The largest finite p the kernel takes. A tile's largest term, (m 2^-k)^p with
# m 2^-k in [0.5, 1), is at least 2^-p: up to p = 512 it stays 510 binades above
# float64's smallest normal, and the terms it loses there are below 2^-510 of it.
# Beyond, it nears the subnormals (p = 1e6 summed to 0): larger p take the
# _foreach path, which divides by the largest |x| first.
LARGEST_ORDER = 512.0

F64 = torch.float64

# Why the kernel failed to build or launch on this machine, once it has: from then
# on gradclip keeps its ``_foreach`` path (``usable`` says no), after one warning.
failure: str | None = None


@functools.lru_cache(maxsize=1)
def _triton():
    """The ``triton`` module, or None where it cannot be imported."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a Triton that does not load on this machine
        return None
    return triton


def interpreted() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable(tensors: Sequence[torch.Tensor], norm_type: float) -> bool:
    """Whether the fused kernel serves ``tensors`` (one device, one dtype): CUDA
    tensors of a floating dtype it reads, 0 < p <= ``LARGEST_ORDER`` or inf, and Triton
    importable.
    ``GRADCLIP_TRITON=0`` turns it off (to compare with the ``_foreach`` path);
    ``GRADCLIP_TRITON=interpret`` with ``TRITON_INTERPRET=1`` serves CPU tensors
    too, so that the tests run every caller's path through the interpreter."""
    choice = os.environ.get("GRADCLIP_TRITON", "1")
    if not tensors or choice == "0" or failure is not None:
        return False
    first = tensors[0]
    on_cpu = choice == "interpret" and interpreted() and first.device.type == "cpu"
    if not (first.device.type == "cuda" or on_cpu):
        return False
    if first.dtype not in DTYPES or not (0 < norm_type <= LARGEST_ORDER
                                         or norm_type == math.inf):
        return False
    if any(t.layout != torch.strided or not t.is_contiguous() for t in tensors):
        return False
    return _triton() is not None and _kernels() is not None


@dataclass(frozen=True)
class TensorSums:
    """Per tensor, on the tensors' device: ``sum |x|^p = power_sum * 2^(p * exponent)``
    over the finite elements (float64; int32 exponents), ``max_abs`` of the finite
    elements (float64), and the int64 counts of NaN, +inf and -inf."""

    norm_type: float
    exponent: torch.Tensor
    power_sum: torch.Tensor
    max_abs: torch.Tensor
    nan: torch.Tensor
    posinf: torch.Tensor
    neginf: torch.Tensor

    @property
    def nonfinite(self) -> torch.Tensor:
        return self.nan + self.posinf + self.neginf

    def norms(self) -> torch.Tensor:
        """Each tensor's p-norm in float64, NaN if it holds a NaN, else inf if an inf.

        ``S^(1/p) 2^E``, the power of two applied in two halves: ``2^E`` alone
        overflows float64 for float64 tensors near its largest values.
        """
        if math.isinf(self.norm_type):
            finite = self.max_abs
        else:
            finite = _root(self.power_sum, self.norm_type, self.exponent)
        return _with_nonfinite(finite, self.nan, self.posinf + self.neginf)

    def maxima(self) -> torch.Tensor:
        """``max |x|`` with torch's propagation: NaN if any NaN, else inf if any inf."""
        return _with_nonfinite(self.max_abs, self.nan, self.posinf + self.neginf)

    def total_norm(self) -> torch.Tensor:
        """The p-norm of all the tensors' elements together, a 0-dim float64 tensor."""
        nan, inf = self.nan.sum(), self.posinf.sum() + self.neginf.sum()
        if math.isinf(self.norm_type):
            finite = self.max_abs.max()
        else:
            top = self.exponent.max()
            shift = (self.exponent - top).to(F64) * self.norm_type
            total = (self.power_sum * torch.exp2(shift)).sum()
            finite = _root(total, self.norm_type, top)
        return _with_nonfinite(finite, nan, inf)

    def total_power_sum(self) -> torch.Tensor:
        """``sum |x|^p`` over all finite elements as one float64 (the max for p = inf),
        with NaN or inf where an element is: for float16/bfloat16/float32 tensors at
        p <= 6 it neither overflows nor underflows (``kernels.FLOAT64_SAFE_P``)."""
        nan, inf = self.nan.sum(), self.posinf.sum() + self.neginf.sum()
        if math.isinf(self.norm_type):
            finite = self.max_abs.max()
        else:
            finite = (self.power_sum * torch.exp2(self.exponent.to(F64) * self.norm_type)).sum()
        return _with_nonfinite(finite, nan, inf)


def _root(power_sum: torch.Tensor, norm_type: float, exponent: torch.Tensor) -> torch.Tensor:
    """``power_sum^(1/p) 2^exponent``. Below p = 1 the root alone can overflow where the
    norm does not (subnormal values at p = 0.01): there it is formed from logarithms,
    inf only where the norm is beyond float64's range."""
    direct = _times_power_of_two(power_sum.pow(1.0 / norm_type), exponent)
    logs = torch.exp2(power_sum.log2() / norm_type + exponent.to(F64))
    return torch.where(torch.isinf(direct), logs, direct)


def _times_power_of_two(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    half = torch.div(exponent, 2, rounding_mode="floor")
    return x * torch.exp2(half.to(F64)) * torch.exp2((exponent - half).to(F64))


def _with_nonfinite(finite: torch.Tensor, nan: torch.Tensor, inf: torch.Tensor) -> torch.Tensor:
    out = torch.where(inf > 0, math.inf, finite)
    return torch.where(nan > 0, math.nan, out)


def tensor_sums_or_none(tensors: Sequence[torch.Tensor], norm_type: float) -> TensorSums | None:
    """``tensor_sums``, or None (with one warning for the process) where the kernel
    cannot be compiled or launched here: the caller's ``_foreach`` path is exact too,
    and a norm must not stop a training run. Errors the device reports later
    (asynchronously) are not caught: they are not the kernel's to hide."""
    global failure
    try:
        return tensor_sums(tensors, norm_type)
    except Exception as e:  # Triton's compile and launch errors have no common base
        failure = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e) else ''}"
        warnings.warn(f"gradclip: the Triton norm kernel cannot run here ({failure}); "
                      "using torch's _foreach kernels instead", RuntimeWarning, stacklevel=3)
        return None


def tensor_sums(tensors: Sequence[torch.Tensor], norm_type: float) -> TensorSums:
    """The fused pass over ``tensors`` (one device, one dtype, contiguous; empty ones
    allowed): two kernel launches and a few small ops, no host read.

    ``usable`` says where it serves; under Triton's interpreter it runs on the CPU.
    """
    norm_type = float(norm_type)
    tensors = list(tensors)
    device, dtype = tensors[0].device, tensors[0].dtype
    kernels = _kernels()
    layout = _layout(tuple(t.numel() for t in tensors), device)
    pointers = _pointers(tensors, device)
    programs = layout.programs
    n = len(tensors)
    wide = dtype == F64
    mode = _mode(norm_type)
    # p travels as a float64 tensor: a number argument would reach the kernel as
    # float32, and p = 2.2 rounded there would be off by 5e-8 in every exponent.
    p = _order(1.0 if math.isinf(norm_type) else norm_type, device)
    chunk_e = torch.empty(programs, dtype=torch.int32, device=device)
    chunk_s = torch.empty(programs, dtype=F64, device=device)
    chunk_m = torch.empty(programs, dtype=F64, device=device)
    chunk_counts = torch.empty((3, programs), dtype=torch.int64, device=device)
    if programs:
        kernels.chunks[(programs,)](
            pointers, layout.numels, layout.chunk_tensor, layout.chunk_index, tensors[0],
            chunk_e, chunk_s, chunk_m, chunk_counts, programs, p,
            MODE=mode, WIDE=wide, BF16=dtype == torch.bfloat16, BLOCK=BLOCK, TILES=TILES,
        )
    exponent = torch.empty(n, dtype=torch.int32, device=device)
    power_sum = torch.empty(n, dtype=F64, device=device)
    max_abs = torch.empty(n, dtype=F64, device=device)
    counts = torch.empty((3, n), dtype=torch.int64, device=device)
    kernels.tensors[(n,)](
        layout.first, layout.count, chunk_e, chunk_s, chunk_m, chunk_counts, programs,
        exponent, power_sum, max_abs, counts, n, p,
        MODE=mode, BLOCK=BLOCK_PROGRAMS,
    )
    return TensorSums(norm_type, exponent, power_sum, max_abs, counts[0], counts[1], counts[2])


def _mode(norm_type: float) -> int:
    """The kernel's branch: 0 max only (p = inf), 1 p = 1, 2 p = 2, 3 any other p."""
    if math.isinf(norm_type):
        return 0
    return {1.0: 1, 2.0: 2}.get(norm_type, 3)


@dataclass(frozen=True)
class _Layout:
    """Where each program reads, for tensors of given sizes (kept per list of sizes)."""

    numels: torch.Tensor  # int64, per tensor
    chunk_tensor: torch.Tensor  # int32, per program: its tensor
    chunk_index: torch.Tensor  # int32, per program: its chunk within the tensor
    first: torch.Tensor  # int32, per tensor: its first program
    count: torch.Tensor  # int32, per tensor: its number of programs
    programs: int


_LAYOUTS: dict = {}
_POINTERS: dict = {}
_ORDERS: dict = {}
_KEPT = 8


def _layout(numels: tuple[int, ...], device: torch.device) -> _Layout:
    chunk = BLOCK * TILES
    key = (numels, device, chunk)
    layout = _LAYOUTS.get(key)
    if layout is None:
        counts = [-(-n // chunk) for n in numels]
        firsts, start = [], 0
        for c in counts:
            firsts.append(start)
            start += c
        tensor_of = [i for i, c in enumerate(counts) for _ in range(c)]
        index_in = [j for c in counts for j in range(c)]
        layout = _Layout(
            _to_device(list(numels), torch.int64, device),
            _to_device(tensor_of, torch.int32, device),
            _to_device(index_in, torch.int32, device),
            _to_device(firsts, torch.int32, device),
            _to_device(counts, torch.int32, device),
            start,
        )
        _remember(_LAYOUTS, key, layout)
    return layout


def _pointers(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' addresses as an int64 tensor on the device (kept while they stay:
    a model's gradients usually keep their memory from step to step)."""
    addresses = tuple(t.data_ptr() for t in tensors)
    key = (addresses, device)
    table = _POINTERS.get(key)
    if table is None:
        table = _to_device(list(addresses), torch.int64, device)
        _remember(_POINTERS, key, table)
    return table


def _order(p: float, device: torch.device) -> torch.Tensor:
    key = (p, device)
    value = _ORDERS.get(key)
    if value is None:
        value = _to_device([p], F64, device)
        _remember(_ORDERS, key, value)
    return value


def _remember(cache: dict, key, value) -> None:
    cache[key] = value
    while len(cache) > _KEPT:
        cache.pop(next(iter(cache)))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without a synchronisation: through pinned memory,
    copied asynchronously (a pageable copy would wait for the device)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class _Kernels:
    chunks: object
    tensors: object


@functools.lru_cache(maxsize=1)
def _kernels() -> _Kernels | None:
    triton = _triton()
    if triton is None:
        return None
    import triton.language as tl

    @triton.jit
    def chunks(pointers, numels, chunk_tensor, chunk_index, first, out_e, out_s, out_m,
               out_counts, programs, order, MODE: tl.constexpr, WIDE: tl.constexpr,
               BF16: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr):
        pid = tl.program_id(0)
        p = tl.load(order)
        t = tl.load(chunk_tensor + pid)
        c = tl.load(chunk_index + pid).to(tl.int64)
        n = tl.load(numels + t)
        if BF16:
            # bfloat16 is the top half of a float32: widened from its bits, exactly
            # (the hardware's conversion; Triton's interpreter mangles subnormals).
            base = tl.load(pointers + t).to(tl.pointer_type(tl.uint16))
        else:
            base = tl.load(pointers + t).to(tl.pointer_type(first.dtype.element_ty))
        offsets = tl.arange(0, BLOCK).to(tl.int64)
        start = c * (BLOCK * TILES)
        run_e = tl.full((), -100000, tl.int32)  # the running sum's exponent: below any tile's
        run_s = tl.zeros((), dtype=tl.float64)
        if WIDE:
            run_m = tl.zeros((), dtype=tl.float64)
        else:
            run_m = tl.zeros((), dtype=tl.float32)
        nan = tl.zeros((), dtype=tl.int64)
        posinf = tl.zeros((), dtype=tl.int64)
        neginf = tl.zeros((), dtype=tl.int64)
        for i in range(TILES):
            where = start + i * BLOCK + offsets
            inside = where < n
            if BF16:
                x = tl.load(base + where, mask=inside, other=0)
                x = (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                x = tl.load(base + where, mask=inside, other=0.0)
                if WIDE:
                    x = x.to(tl.float64)
                else:
                    x = x.to(tl.float32)
            a = tl.abs(x)
            nan += tl.sum((x != x).to(tl.int64), axis=0)
            posinf += tl.sum((x == float("inf")).to(tl.int64), axis=0)
            neginf += tl.sum((x == float("-inf")).to(tl.int64), axis=0)
            a = tl.where(a < float("inf"), a, 0.0)  # NaN and inf out: counted above
            m = tl.max(a, axis=0)
            run_m = tl.maximum(run_m, m)
            if MODE != 0:
                # k with m 2^-k in [0.5, 1): m's exponent, read exactly from its float64
                # bits (float32 subnormals are normal there; float64 ones give -1022).
                bits = m.to(tl.float64).to(tl.int64, bitcast=True)
                k = ((bits >> 52) & 0x7FF).to(tl.int32) - 1022
                # 2^-k as two exact powers of two built from their bits, each
                # within float32's (float64's) normal range: exact multiplications.
                k1 = -k // 2
                k2 = -k - k1
                if WIDE:
                    f1 = ((k1 + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
                    f2 = ((k2 + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
                else:
                    f1 = ((k1 + 127) << 23).to(tl.float32, bitcast=True)
                    f2 = ((k2 + 127) << 23).to(tl.float32, bitcast=True)
                y = a * f1 * f2
                if MODE == 1:
                    s = tl.sum(y.to(tl.float64), axis=0)
                elif MODE == 2:
                    s = tl.sum(y * y, axis=0).to(tl.float64)
                else:
                    # Scaled in float64: a float32 y would flush the terms below 2^-149
                    # of the tile's largest, 2^(-149 p) each, 1e-5 of the sum at p = 0.1.
                    y64 = a.to(tl.float64) * f1.to(tl.float64) * f2.to(tl.float64)
                    term = tl.where(y64 > 0, tl.exp2(p * tl.log2(tl.maximum(y64, 1e-300))), 0.0)
                    s = tl.sum(term, axis=0)
                s = tl.where(m > 0, s, 0.0)
                k = tl.where(m > 0, k, -100000)
                top = tl.maximum(run_e, k)
                run_s = (run_s * tl.exp2(p * (run_e - top).to(tl.float64))
                         + s * tl.exp2(p * (k - top).to(tl.float64)))
                run_e = top
        tl.store(out_e + pid, run_e)
        tl.store(out_s + pid, run_s)
        tl.store(out_m + pid, run_m.to(tl.float64))
        tl.store(out_counts + pid, nan)
        tl.store(out_counts + programs + pid, posinf)
        tl.store(out_counts + 2 * programs + pid, neginf)

    @triton.jit
    def tensors(first, count, chunk_e, chunk_s, chunk_m, chunk_counts, programs,
                out_e, out_s, out_m, out_counts, n, order, MODE: tl.constexpr,
                BLOCK: tl.constexpr):
        t = tl.program_id(0)
        p = tl.load(order)
        begin = tl.load(first + t)
        size = tl.load(count + t)
        offsets = tl.arange(0, BLOCK)
        run_e = tl.full((), -100000, tl.int32)
        run_s = tl.zeros((), dtype=tl.float64)
        run_m = tl.zeros((), dtype=tl.float64)
        nan = tl.zeros((), dtype=tl.int64)
        posinf = tl.zeros((), dtype=tl.int64)
        neginf = tl.zeros((), dtype=tl.int64)
        for s0 in range(0, size, BLOCK):
            inside = s0 + offsets < size
            where = begin + s0 + offsets
            e = tl.load(chunk_e + where, mask=inside, other=-100000)
            s = tl.load(chunk_s + where, mask=inside, other=0.0)
            m = tl.load(chunk_m + where, mask=inside, other=0.0)
            nan += tl.sum(tl.load(chunk_counts + where, mask=inside, other=0), axis=0)
            posinf += tl.sum(tl.load(chunk_counts + programs + where, mask=inside, other=0),
                             axis=0)
            neginf += tl.sum(tl.load(chunk_counts + 2 * programs + where, mask=inside,
                                     other=0), axis=0)
            run_m = tl.maximum(run_m, tl.max(m, axis=0))
            if MODE != 0:
                top = tl.maximum(run_e, tl.max(e, axis=0))
                part = tl.sum(s * tl.exp2(p * (e - top).to(tl.float64)), axis=0)
                run_s = run_s * tl.exp2(p * (run_e - top).to(tl.float64)) + part
                run_e = top
        tl.store(out_e + t, run_e)
        tl.store(out_s + t, run_s)
        tl.store(out_m + t, run_m)
        tl.store(out_counts + t, nan)
        tl.store(out_counts + n + t, posinf)
        tl.store(out_counts + 2 * n + t, neginf)

    return _Kernels(chunks, tensors)
