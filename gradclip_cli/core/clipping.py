"""Clipping rules: norm clipping by a coefficient, and element-wise clamping.

Both follow ``torch.nn.utils.clip_grad``: one fused ``_foreach_*`` call per
(device, dtype) group where the device supports it, else a loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

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


def _use_foreach(group: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    if foreach is None:
        return _has_foreach_support(group, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return foreach


def scale_(
    tensors: Sequence[torch.Tensor], coef: torch.Tensor, foreach: bool | None = None
) -> None:
    """Multiply every tensor in place by the 0-dim tensor ``coef``.

    Multiplying by a clamped coefficient, rather than branching on
    ``coef < 1``, avoids a host-device synchronisation (torch does the same).
    """
    if not tensors:
        return
    grouped = _group_tensors_by_device_and_dtype([list(tensors)])
    for (device, _), ([group], _) in grouped.items():
        for c in _factors(coef):
            c = c.to(device)
            if _use_foreach(group, device, foreach):
                torch._foreach_mul_(group, c)
            else:
                for t in group:
                    t.mul_(c)


# Half and float32 tensors multiply in float32, where a coefficient below
# 2**-126 is subnormal (imprecise) or zero: clipping a 1e38 gradient to 1e-6
# would zero it. Such coefficients are applied as a few normal factors.
_SMALLEST_FACTOR = 2.0**-100


def _factors(coef: torch.Tensor) -> list[torch.Tensor]:
    """``coef`` as one factor, or several whose product is ``coef``, each normal in float32.

    Only a CPU coefficient is looked at: reading one from an accelerator would
    synchronise, and totals there that need it (> 1e38 * max_norm) do not arise.
    """
    if coef.device.type != "cpu":
        return [coef]
    c = float(coef)
    if not (0.0 < c < _SMALLEST_FACTOR):
        return [coef]
    n = math.ceil(math.log(c) / math.log(_SMALLEST_FACTOR))
    part = c ** (1.0 / n)
    rest = c / part ** (n - 1)
    return [torch.tensor(part, dtype=torch.float64)] * (n - 1) + [
        torch.tensor(rest, dtype=torch.float64)
    ]


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
        bound = min(float(clip_value), torch.finfo(dtype).max)
        if _use_foreach(group, device, foreach):
            torch._foreach_clamp_min_(group, -bound)
            torch._foreach_clamp_max_(group, bound)
        else:
            for t in group:
                t.clamp_(min=-bound, max=bound)
