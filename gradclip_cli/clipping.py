"""What ``clip`` does with the gradients it measured: refuse, scale or clamp, and check.

The decisions on plain data, apart from files and ranks (``commands/clip.py``
wires them): ``refusal`` (a non-finite total, or a coefficient or clamp bound
that would round every gradient to zero), ``to_norm`` (torch's coefficient, computed exactly, and
lowered until the stored total is within the limit, as ``inspect --max-norm``
measures it) and ``to_value`` (the clamp). The tensor math is the core's
(``core/clipping.py``); changing the gradients in place, reading them again and
measuring them after are the command's, passed in as one function each, as
``measuring`` takes its progress.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradclip_cli.core import (
    Coefficient,
    PowerSums,
    exact_clip_coefficient,
    lowered_coefficient,
    rounds_to_zero,
    unit_roundoff,
)

# Lowering steps tried before giving up (two suffice in practice; see
# core.lowered_coefficient for why four always do).
MAX_LOWERINGS = 8


@dataclass(frozen=True)
class Clipped:
    """What clip did: the total norm ``after``, whether any element ``changed``, and for
    ``--max-norm`` the coefficient used (``coef``; None for a clamp) and torch's own
    (``torch_coef``) where rounding to the stored dtype made a lower one necessary."""

    after: float
    changed: bool
    coef: Coefficient | None = None
    torch_coef: Coefficient | None = None

    @property
    def lowered(self) -> bool:
        return self.torch_coef is not None


def refusal(total: PowerSums, maxima: Sequence[float], dtypes: Sequence[torch.dtype], *,
            p: float, limit: float | None, allow_nonfinite: bool,
            value: float | None = None) -> tuple[str, str] | None:
    """Why not to clip, and what would clip anyway; None to go on.

    ``total``: the gradients' total as one piece; ``maxima`` and ``dtypes``: each
    held tensor's largest magnitude and stored dtype. A total with NaN or
    infinities is refused unless ``allow_nonfinite``; a coefficient (``limit``)
    or a clamp bound (``value``) that would round every gradient to zero is
    refused always. Every rank has the same total, so every rank decides (and
    exits) alike.
    """
    nan, posinf, neginf = (int(c[0]) for c in (total.nan, total.posinf, total.neginf))
    if nan + posinf + neginf:
        if allow_nonfinite:
            return None
        return (f"gradient total norm is {float(total.norm[0])} ({nan} NaN, {posinf} +inf, "
                f"{neginf} -inf)", " (--allow-nonfinite clips anyway)")
    if value is not None:
        if not clamp_zeroes_everything(maxima, dtypes, value):
            return None
        return (f"--clip-value {value:g} rounds to zero in the gradients' dtype "
                f"({_dtype_names(dtypes)}), which would set every gradient to zero", "")
    if limit is None:
        return None
    coef = exact_clip_coefficient(total, limit)
    if not zeroes_everything(maxima, dtypes, coef):
        return None
    return (f"clipping to --max-norm {limit:g} needs a coefficient of 2^{coef.log2:.6g} "
            f"(gradient total norm {_described(total)}, p={p:g}), "
            "which would round every gradient to zero", "")


def to_norm(total: PowerSums, limit: float, dtypes: Sequence[torch.dtype],
            scaled: Callable[[Coefficient, bool], float]) -> Clipped:
    """Clip to ``--max-norm limit``: scale by torch's coefficient for ``total``.

    ``scaled(c, again)`` scales the gradients in place by ``c`` (read from the
    file again first where ``again``) and returns their total norm after, as
    stored in ``dtypes``. Rounding to a narrow stored dtype can leave that total
    just above the limit: then it starts again from the file with a lower
    coefficient (``core.lowered_coefficient``). ``inspect`` measures the output
    with this same code, so the comparison it makes is this one.
    """
    coef = torch_coef = exact_clip_coefficient(total, limit)
    after = scaled(coef, False)
    roundoff = max(unit_roundoff(dtype) for dtype in dtypes)
    attempt = 0
    while after > limit and math.isfinite(after) and attempt < MAX_LOWERINGS:
        coef = lowered_coefficient(coef, after, limit, roundoff, attempt)
        attempt += 1
        after = scaled(coef, True)
    return Clipped(after, not coef.is_one, coef, torch_coef if attempt else None)


def to_value(value: float, maxima: Sequence[float], tensors: Sequence[torch.Tensor],
             clamped: Callable[[float], float]) -> Clipped:
    """Clip to ``--clip-value value``: ``clamped(value)`` clamps the gradients ``tensors``
    (largest magnitudes ``maxima``) in place and returns their total norm after."""
    changed = clamp_changes(maxima, tensors, value)
    return Clipped(clamped(value), changed)


def zeroes_everything(maxima: Sequence[float], dtypes: Sequence[torch.dtype],
                      coef: Coefficient) -> bool:
    """Whether scaling by ``coef`` would round every nonzero gradient element to zero.

    Each tensor's largest element (``maxima``, in its ``dtypes``) decides for it:
    if that rounds to zero in the tensor's dtype, so does every other. Gradients
    that are all zero already are no evidence either way.
    """
    nonzero = [(m, dtype) for m, dtype in zip(maxima, dtypes) if m > 0]
    return bool(nonzero) and all(rounds_to_zero(m, dtype, coef) for m, dtype in nonzero)


def clamp_zeroes_everything(maxima: Sequence[float], dtypes: Sequence[torch.dtype],
                            value: float) -> bool:
    """Whether clamping to ``[-value, value]`` would set every nonzero gradient element to zero.

    torch casts the bound to each tensor's dtype: where it rounds to zero there,
    every element of the tensor becomes zero; elsewhere a nonzero element stays
    nonzero. Gradients that are all zero already are no evidence either way.
    """
    nonzero = [dtype for m, dtype in zip(maxima, dtypes) if m > 0]
    one = Coefficient.of(1.0)
    return bool(nonzero) and all(rounds_to_zero(value, dtype, one) for dtype in nonzero)


def clamp_changes(maxima: Sequence[float], tensors: Sequence[torch.Tensor],
                  value: float) -> bool:
    """Whether clamping ``tensors`` to ``[-value, value]`` changes some element.

    A tensor's largest magnitude (``maxima``) decides for it, except where it
    holds a NaN: its largest magnitude is then NaN, while the clamp keeps the
    NaN and still changes the elements beyond the bound (an infinity among
    them), so those are looked for.
    """
    for m, t in zip(maxima, tensors):
        if m > value or (math.isnan(m) and bool((t.abs() > value).any())):
            return True
    return False


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(sorted({str(dtype).removeprefix("torch.") for dtype in dtypes}))


def _described(total: PowerSums) -> str:
    norm = float(total.norm[0])
    if math.isinf(norm) and bool(total.overflow[0]):
        return f"> 1.8e308, about 10^{float(total.log2_norm[0]) * math.log10(2):.6g}"
    return f"{norm:g}"
