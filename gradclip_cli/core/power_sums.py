"""Scaled power sums: the representation every norm in gradclip is built from.

A set of values ``x`` is summarised by ``scale = max |x|`` and
``power_sum = sum (|x| / scale) ** p``, so that ``||x||_p = scale * power_sum ** (1/p)``.
This is the scale/sum-of-squares pair of LAPACK's ``dnrm2`` (Blue, "A portable
Fortran program to find the Euclidean norm of a vector", ACM TOMS 4(1), 1978;
Hammarling's scaled update), generalised to any p. Each ratio is at most 1, so
combining pieces never overflows, and pieces far below the largest underflow
harmlessly to zero. Everything here is float64 on the CPU: it works on one
number per row, tensor or group, never on gradient elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64


@dataclass(frozen=True)
class PowerSums:
    """Norm summaries of ``n`` pieces (rows, tensors or groups), float64 on the CPU.

    ``scale`` and ``power_sum`` describe the finite part; ``max_abs`` is
    ``max |x|`` with torch's propagation (NaN if any NaN, else inf if any inf).
    ``nan``, ``posinf`` and ``neginf`` count non-finite elements.
    ``certified``: each piece's norm, where the maker has proved every
    piece finite and knows it (``norms.certified_group_norms``); ``norm``
    then returns it without working it out. Derived summaries drop it.
    """

    norm_type: float
    scale: torch.Tensor
    power_sum: torch.Tensor
    max_abs: torch.Tensor
    nan: torch.Tensor
    posinf: torch.Tensor
    neginf: torch.Tensor
    certified: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.scale.numel()

    @property
    def nonfinite(self) -> torch.Tensor:
        """Elements that are NaN or infinite, per piece (int64)."""
        return self.nan + self.posinf + self.neginf

    @property
    def norm(self) -> torch.Tensor:
        """The p-norm of each piece: NaN if it holds a NaN, inf if it holds an inf."""
        if self.certified is not None:
            return self.certified
        if math.isinf(self.norm_type):
            finite = self.scale
        else:
            finite = self.scale * self.power_sum.pow(1.0 / self.norm_type)
            # Below p = 1 the root alone can overflow where the norm does not (a
            # scale far below 1: subnormal values at p = 0.01): there the norm is
            # formed from the logarithms, inf only where it is beyond float64's range.
            finite = torch.where(torch.isinf(finite), torch.exp2(self.log2_norm), finite)
        inf = torch.full_like(finite, math.inf)
        out = torch.where(self.posinf + self.neginf > 0, inf, finite)
        return torch.where(self.nan > 0, torch.full_like(finite, math.nan), out)

    @property
    def log2_norm(self) -> torch.Tensor:
        """``log2`` of each piece's finite norm, defined where ``norm`` overflows float64.

        ``log2 ||x|| = log2 scale + log2(power_sum) / p``: the summary holds a
        norm of any size; only its rounding to one float64 can overflow.
        """
        if math.isinf(self.norm_type):
            return self.scale.log2()
        return self.scale.log2() + self.power_sum.log2() / self.norm_type

    @property
    def overflow(self) -> torch.Tensor:
        """Pieces whose norm is finite but beyond float64's range (``norm`` says inf)."""
        return (self.nonfinite == 0) & torch.isinf(self.norm)

    def take(self, index: torch.Tensor) -> PowerSums:
        """The pieces at ``index``, in that order (a piece may appear several times)."""
        index = index.to(torch.int64)
        return PowerSums(self.norm_type, *(getattr(self, f)[index] for f in
                                           ("scale", "power_sum", "max_abs", "nan", "posinf",
                                            "neginf")))

    def reduce(self, index: torch.Tensor, size: int) -> PowerSums:
        """Combine pieces into ``size`` larger ones; piece ``i`` goes to ``index[i]``.

        ``S = sum_i s_i * (m_i / M) ** p`` with ``M = max_i m_i``: the ratio is at
        most 1, so the sum cannot overflow.
        """
        index = index.to(torch.int64)
        scale = torch.zeros(size, dtype=F64).scatter_reduce(
            0, index, self.scale, reduce="amax", include_self=True
        )
        if math.isinf(self.norm_type):
            power_sum = (scale > 0).to(F64)
        else:
            big = scale[index]
            ratio = torch.where(big > 0, self.scale / _nonzero(big), 0.0)
            power_sum = torch.zeros(size, dtype=F64).index_add(
                0, index, self.power_sum * pointwise_pow(ratio, self.norm_type)
            )
        return PowerSums(
            norm_type=self.norm_type,
            scale=scale,
            power_sum=power_sum,
            max_abs=_max_with_nan(self.max_abs, index, size),
            nan=_count(self.nan, index, size),
            posinf=_count(self.posinf, index, size),
            neginf=_count(self.neginf, index, size),
        )

    def total(self) -> PowerSums:
        """All pieces combined into one."""
        return self.reduce(torch.zeros(len(self), dtype=torch.int64), 1)


def concat(norm_type: float, parts: list[PowerSums]) -> PowerSums:
    """The pieces of several summaries, one after another."""
    if not parts:
        empty = torch.empty(0, dtype=F64)
        zero = torch.empty(0, dtype=torch.int64)
        return PowerSums(norm_type, empty, empty, empty, zero, zero, zero)
    return PowerSums(
        norm_type,
        *(torch.cat([getattr(p, f) for p in parts])
          for f in ("scale", "power_sum", "max_abs", "nan", "posinf", "neginf")),
    )


def from_rows(
    norm_type: float, row_max: torch.Tensor, row_norm: torch.Tensor | None
) -> PowerSums:
    """Summaries of rows whose ``max |x|`` and fast p-norm are known.

    Rows whose max is not finite get scale 0 (their tensor is flagged and
    counted separately); counts start at zero and are filled by the caller.
    """
    row_max = row_max.to(F64)
    finite = torch.isfinite(row_max)
    scale = torch.where(finite, row_max, 0.0)
    if row_norm is None or math.isinf(norm_type):
        power_sum = (scale > 0).to(F64)
    else:
        ratio = row_norm.to(F64) / _nonzero(scale)
        power_sum = torch.where(scale > 0, pointwise_pow(ratio, norm_type), 0.0)
    zeros = torch.zeros(row_max.numel(), dtype=torch.int64)
    return PowerSums(norm_type, scale, power_sum, row_max, zeros, zeros, zeros)


def pointwise_pow(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """``x ** exponent`` elementwise (float64), each result a function of its own element only.

    A vectorised ``pow`` rounds the elements of a SIMD block and those of the
    scalar tail differently (1 ulp), so a tensor's power sum would depend on
    where it sat among its neighbours: on how work was split across ranks or
    threads. Squares and square roots are correctly rounded either way; any
    other exponent goes through ``math.pow`` one number at a time (a number
    per row or tensor, never per element). The reports of one process and of
    many are then the same to the last digit.
    """
    if exponent == 1.0:
        return x.clone()
    if exponent == 2.0:
        return x * x
    if exponent == 0.5:
        return x.sqrt()
    values = [_scalar_pow(v, exponent) for v in x.reshape(-1).tolist()]
    return torch.tensor(values, dtype=F64).reshape(x.shape)


def _scalar_pow(value: float, exponent: float) -> float:
    """``math.pow`` that overflows to inf, as a tensor ``pow`` does, instead of raising."""
    try:
        return math.pow(value, exponent)
    except OverflowError:
        return math.inf


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zeros replaced by 1, for divisions masked where ``x == 0``.

    Not clamp_min(tiny): subnormal scales are real values and must divide as such.
    """
    return torch.where(x > 0, x, 1.0)


def _count(counts: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int64).index_add(0, index, counts)


def _max_with_nan(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    # scatter_reduce's NaN handling is not documented; make torch.max's rule explicit.
    is_nan = torch.isnan(values)
    clean = torch.where(is_nan, 0.0, values)
    out = torch.zeros(size, dtype=F64).scatter_reduce(0, index, clean, reduce="amax")
    any_nan = torch.zeros(size, dtype=torch.int64).index_add(0, index, is_nan.to(torch.int64))
    return torch.where(any_nan > 0, math.nan, out)
