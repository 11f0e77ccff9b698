"""Clipping rules: norm clipping by a coefficient, and element-wise clamping.

Both follow ``torch.nn.utils.clip_grad``: one fused ``_foreach_*`` call per
(device, dtype) group where the device supports it, else a loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from .elements import Elements
from .power_sums import PowerSums

# torch.nn.utils.clip_grads_with_norm_ adds this to the norm before dividing.
EPS = 1e-6


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))``, as torch computes it.

    The division happens in ``total_norm``'s dtype, float32 or wider: a bf16
    coefficient would be off by up to 0.4%.
    """
    if total_norm.dtype not in (torch.float32, torch.float64):
        total_norm = total_norm.float()
    return torch.clamp(max_norm / (total_norm + EPS), max=1.0)


@dataclass(frozen=True)
class Coefficient:
    """A clip coefficient ``c = mantissa * 2**exponent``, ``mantissa`` in [0.5, 1).

    A total beyond float64's range still has an exact coefficient, below
    float64's range; the pair holds it to float64's relative precision, where
    ``log2 c`` as one float64 would lose 1e-13 near 2**-1024. A coefficient of
    0 (an infinite total) has mantissa 0; a NaN one, mantissa NaN.
    """

    mantissa: float
    exponent: int = 0

    @classmethod
    def of(cls, value: float) -> Coefficient:
        mantissa, exponent = math.frexp(value)
        return cls(mantissa, exponent)

    def times(self, factor: float) -> Coefficient:
        mantissa, exponent = math.frexp(self.mantissa * factor)
        return Coefficient(mantissa, self.exponent + exponent)

    def shifted(self, exponent: int) -> Coefficient:
        """``c * 2**exponent``, exactly."""
        return Coefficient(self.mantissa, self.exponent + exponent)

    @property
    def value(self) -> float:
        """``c`` rounded to float64: 0.0 or subnormal when below its range."""
        return math.ldexp(self.mantissa, self.exponent)

    @property
    def log2(self) -> float:
        if math.isnan(self.mantissa):
            return math.nan
        if self.mantissa == 0:
            return -math.inf
        return math.log2(self.mantissa) + self.exponent

    @property
    def is_one(self) -> bool:
        return self.value == 1.0


def exact_clip_coefficient(total: PowerSums, max_norm: float) -> Coefficient:
    """``min(1, max_norm / (||g|| + 1e-6))`` for the one-piece summary ``total``.

    Within float64's range this is torch's formula in float64. Beyond it
    (``||g|| = scale * power_sum ** (1/p)`` > 1.8e308, where the 1e-6 no
    longer matters) each factor is split into mantissa and power of two:
    ``scale = m_s 2^e_s`` exactly, ``power_sum ** (1/p) = 2^t`` with
    ``t = log2(power_sum) / p``, and ``c = (m_x / (m_s 2^frac t)) 2^(e_x - e_s - floor t)``.
    """
    norm = float(total.norm[0])
    if not math.isinf(norm) or int(total.nonfinite[0]):
        c = max_norm / (norm + EPS)
        # torch.clamp keeps a NaN (Python's min would return 1.0).
        return Coefficient.of(1.0 if c >= 1.0 else c)
    scale_m, scale_e = math.frexp(float(total.scale[0]))
    p = total.norm_type
    t = 0.0 if math.isinf(p) else math.log2(float(total.power_sum[0])) / p
    whole = math.floor(t)
    limit_m, limit_e = math.frexp(max_norm)
    ratio = Coefficient.of(limit_m / (scale_m * 2.0 ** (t - whole)))
    return ratio.shifted(limit_e - scale_e - whole)


def rounds_to_zero(max_abs: float, dtype: torch.dtype, coef: Coefficient) -> bool:
    """Whether ``max_abs * c`` rounds to zero in ``dtype`` (half the smallest subnormal or less)."""
    if not (max_abs > 0 and math.isfinite(max_abs)) or math.isnan(coef.log2):
        return False
    info = torch.finfo(dtype)
    smallest = info.smallest_normal * info.eps  # the smallest subnormal
    return math.log2(max_abs) + coef.log2 <= math.log2(smallest) - 1


def unit_roundoff(dtype: torch.dtype) -> float:
    """The largest relative error of rounding to ``dtype`` (half an ulp at 1)."""
    real = {torch.complex32: torch.float16, torch.complex64: torch.float32,
            torch.complex128: torch.float64}.get(dtype, dtype)
    return torch.finfo(real).eps / 2


_MARGIN_STEPS = (0.0, 0.25, 1.0, 2.5)


def lowered_coefficient(coef: Coefficient, after: float, max_norm: float,
                        roundoff: float, attempt: int) -> Coefficient:
    """A lower coefficient, where rounding to the stored dtype left the total above the limit.

    Rounding each element moves it by at most ``u`` relative (``roundoff``),
    so the rounded total after ``c`` is ``c ||g|| (1 + e)`` with ``|e| <= u``.
    ``c' = c * max_norm / after * (1 - m)`` aims just below the limit; the
    margin ``m`` grows with each attempt (0, u/4, u, 2.5u, ...), and from
    ``m >= 2u`` the result cannot exceed ``max_norm``, so few attempts are
    ever needed.
    """
    steps = _MARGIN_STEPS[attempt] if attempt < len(_MARGIN_STEPS) else 2.5 * 2 ** (attempt - 3)
    margin = min(roundoff * steps, 0.5)
    return coef.times(max_norm / after * (1.0 - margin))


def _use_foreach(group: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    if foreach is None:
        return _has_foreach_support(group, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return foreach


_HALF = (torch.float16, torch.bfloat16)
# torch's CPU kernels cannot multiply float8 tensors; they are scaled in float32.
_FLOAT8 = {getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                             "float8_e5m2fnuz") if hasattr(torch, name)}


@torch.no_grad()
def scale_(
    tensors: Sequence[torch.Tensor], coef: torch.Tensor | Coefficient, foreach: bool | None = None
) -> None:
    """Multiply every tensor in place by ``coef`` (a 0-dim tensor, or an exact ``Coefficient``).

    Multiplying by a clamped coefficient, rather than branching on
    ``coef < 1``, avoids a host-device synchronisation (torch does the same).
    float8 tensors are multiplied in float32 and rounded back.

    A coefficient of exactly 1 changes no bit, and where it is known without
    a synchronisation (a ``Coefficient``, or a CPU tensor) the pass is
    skipped: on the CPU, a step that does not clip then costs the norm alone.

    On the CPU, half types are multiplied in float32 by the float32
    coefficient and rounded once, as torch's CPU kernel does (its ``mul`` of
    a bfloat16 or float16 tensor by a 0-dim tensor reads the coefficient in
    float32): results equal torch's ``clip_grads_with_norm_`` bit for bit for
    the same total, and the CLI's ``clip`` keeps its guarantee there.

    On an accelerator, half types are scaled as torch scales them (the
    contract, Python API): the coefficient rounded to the gradients' dtype,
    through the fused ``_foreach_mul_`` (one launch per group; torch's fused
    kernel takes a device coefficient only of the tensors' own dtype, and
    its fallback, one ``mul_`` per tensor, rounds the coefficient to that
    dtype as well, so the products are the same). The product is rounded to
    that dtype anyway; the float32 multiply per tensor this replaces cost
    2.2x torch's clip on an H200 (BENCHMARKS.md, "On a GPU"). A coefficient
    known on the host (the monitor's) is rounded the same way, unless it is
    below the dtype's normal range (float16's starts at 6.1e-5): there it is
    applied in float32, where torch would round it to a subnormal or zero.
    """
    if not tensors or _is_one(coef):
        return
    host = isinstance(coef, Coefficient) or coef.device.type == "cpu"
    grouped = _group_tensors_by_device_and_dtype([list(tensors)])
    for (device, dtype), ([group], _) in grouped.items():
        for c in _factors(coef, dtype):
            if device.type != "cpu" and dtype in _HALF:
                c = _as_torch_on_device(c, dtype, device, host)
            else:
                c = float(c) if host and device.type != "cpu" else c.to(device)
            if dtype in _FLOAT8:
                for t in group:
                    t.copy_(t.float().mul_(c))
            elif _use_foreach(group, device, foreach):
                torch._foreach_mul_(group, c)
            else:
                for t in group:
                    t.mul_(c)


def _as_torch_on_device(c: torch.Tensor, dtype: torch.dtype, device: torch.device,
                       host: bool) -> torch.Tensor | float:
    """The factor for half tensors on an accelerator: ``c`` in ``dtype``, as torch applies it.

    A device coefficient becomes a 0-dim tensor of ``dtype`` there (no read,
    one cast). A host one becomes the number that ``dtype`` rounds it to,
    which the fused kernel multiplies by in float32, exactly as by the
    rounded tensor; one below ``dtype``'s normal range stays as it is.
    """
    if not host:
        return c.to(device=device, dtype=dtype)
    value = float(c)
    rounded = float(torch.tensor(value, dtype=torch.float32).to(dtype))
    return rounded if rounded >= torch.finfo(dtype).tiny else value


def _is_one(coef: torch.Tensor | Coefficient) -> bool:
    if isinstance(coef, Coefficient):
        return coef.is_one
    return coef.device.type == "cpu" and coef.numel() == 1 and bool(coef == 1.0)


def scale_elements_(elements: Elements, coef: torch.Tensor | Coefficient,
                    foreach: bool | None = None) -> None:
    """Scale every distinct element of ``elements`` once, in place."""
    _each_element_once(elements, lambda group, fe: scale_(group, coef, fe), foreach)


def clamp_elements_(elements: Elements, clip_value: float, foreach: bool | None = None) -> None:
    """Clamp every distinct element of ``elements`` once, in place.

    An uncoalesced sparse COO tensor stores one element as several entries
    that add up: the sum is clamped, kept in the first entry, the rest zeroed.
    """
    loose = [p for p in elements.owned if p.sparse is not None and not p.sparse.is_coalesced()]
    for p in loose:
        _clamp_uncoalesced_(p.sparse, clip_value)
    _each_element_once(elements, lambda group, fe: clamp_(group, clip_value, fe), foreach,
                       skip={id(p) for p in loose})


@torch.no_grad()
def _clamp_uncoalesced_(t: torch.Tensor, clip_value: float) -> None:
    values = t._values()
    _, group = torch.unique(t._indices(), dim=1, return_inverse=True)
    sums = torch.zeros((int(group.max()) + 1, *values.shape[1:]), dtype=values.dtype)
    sums.index_add_(0, group, values)
    clamp_([sums], clip_value, foreach=False)
    first = torch.full((sums.shape[0],), group.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, group, torch.arange(group.numel()), reduce="amin")
    values.zero_()
    values.index_copy_(0, first, sums)


@torch.no_grad()
def _each_element_once(elements: Elements, apply, foreach: bool | None, skip=frozenset()) -> None:
    """``apply`` to the views of owned pieces at once; gathered pieces go out and back."""
    if elements.whole is not None and not skip:
        apply(elements.whole, foreach)
        return
    views, gathered = [], []
    for p in elements.owned:
        if p.target is not None:
            if id(p) not in skip:
                views.append(p.target)
        elif p.index is not None and p.index.numel():
            gathered.append(p)
    apply(views, foreach)
    for p in gathered:
        values = p.base.index_select(0, p.index)
        apply([values], False)
        p.base.index_copy_(0, p.index, values)


# Half and float32 tensors multiply in float32, where a coefficient below
# 2**-126 is subnormal (imprecise) or zero: clipping a 1e38 gradient to 1e-6
# would zero it. Such coefficients are applied as a few normal factors, as are
# coefficients below float64's own normal range for float64 tensors.
_SMALLEST_FACTOR_EXP = -100
_SMALLEST_FACTOR_EXP_F64 = -1000


def _factors(coef: torch.Tensor | Coefficient, dtype: torch.dtype) -> list[torch.Tensor]:
    """``coef`` as one factor, or several whose product is ``coef``, each normal where applied.

    A small coefficient is applied as its mantissa, then powers of two (exact
    multiplications), each at least the dtype's smallest factor.
    Only a CPU coefficient is looked at: reading one from an accelerator would
    synchronise, and totals there that need it (> 1e38 * max_norm) do not arise.
    """
    if isinstance(coef, torch.Tensor):
        if coef.device.type != "cpu":
            return [coef]
        coef = Coefficient.of(float(coef))
    wide = dtype in (torch.float64, torch.complex128)
    smallest = _SMALLEST_FACTOR_EXP_F64 if wide else _SMALLEST_FACTOR_EXP
    # Narrower tensors multiply in float32 whatever the factor's type, and a
    # float32 factor spares the kernel a cast per tensor (1.4x the time of
    # torch's _foreach_mul_ on 1,000 small tensors with a float64 one).
    factor_dtype = torch.float64 if wide else torch.float32
    if not (coef.mantissa > 0) or coef.exponent > smallest:
        return [torch.tensor(coef.value, dtype=factor_dtype)]
    factors = [coef.mantissa]
    exponent = coef.exponent
    while exponent < 0:
        step = max(exponent, smallest)
        factors.append(math.ldexp(1.0, step))
        exponent -= step
    return [torch.tensor(f, dtype=factor_dtype) for f in factors]


@torch.no_grad()
def clamp_(tensors: Sequence[torch.Tensor], clip_value: float, foreach: bool | None = None) -> None:
    """Clamp every element of every tensor to ``[-clip_value, clip_value]`` in place.

    A bound beyond a dtype's range is that dtype's largest finite value (torch
    refuses a scalar it cannot represent): finite elements are left alone and
    infinities become the largest finite value, the nearest to the bound.
    """
    if not tensors:
        return
    grouped = _group_tensors_by_device_and_dtype([list(tensors)])
    for (device, dtype), ([group], _) in grouped.items():
        if dtype.is_complex:
            # torch raises NotImplementedError ("clamp is not supported for complex types")
            raise NotImplementedError(
                "complex tensors cannot be clamped: complex numbers have no order")
        bound = min(float(clip_value), torch.finfo(dtype).max)
        if dtype in _FLOAT8:
            for t in group:
                t.copy_(t.float().clamp_(min=-bound, max=bound))
        elif _use_foreach(group, device, foreach):
            torch._foreach_clamp_min_(group, -bound)
            torch._foreach_clamp_max_(group, bound)
        else:
            for t in group:
                t.clamp_(min=-bound, max=bound)
