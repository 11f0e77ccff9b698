"""Drop-ins for ``torch.nn.utils``' gradient clipping functions.

Same names, arguments and in-place behaviour as torch's; the total norm is
accurate (relative error <= 1e-6 against float64) and never overflows or
underflows spuriously, whatever the gradients' dtype or magnitude. Elements
that several tensors share (tied weights, views, expansions) count once and
are scaled once; complex gradients count with ``|z|``, sparse ones with their
stored values; tensors that require grad are read without recording a graph.

    >>> from gradclip_cli import clip_grad_norm_
    >>> total = clip_grad_norm_(model.parameters(), max_norm=1.0)
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Iterable

import torch
from torch.utils._foreach_utils import _device_has_foreach_support

from .core import (
    Elements,
    PowerSums,
    clamp_elements_,
    clip_coefficient,
    distinct_elements,
    exact_clip_coefficient,
    readable,
    scale_elements_,
    total_power_sums,
)
from .core.adaptive import adaptive_clip_
from .core.kernels import FLOAT64_SAFE_P, total_on_device
from .distributed import dtensor

TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]

def _as_list(tensors: TensorOrTensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _parameters(parameters: TensorOrTensors) -> list[torch.Tensor]:
    """The parameters as a list; an exhausted generator warns, as torch's clip_grad_norm_."""
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    parameters = list(parameters)
    if is_generator and not parameters:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                      stacklevel=3)
    return parameters


def _grads(parameters: TensorOrTensors) -> list[torch.Tensor]:
    return [p.grad for p in _as_list(parameters) if p.grad is not None]


_WIDE = (torch.float64, torch.complex128)


def _wide(t: torch.Tensor) -> bool:
    return t.dtype in _WIDE


def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    r"""The p-norm of all elements of ``tensors`` taken as one vector.

    .. math:: \|g\|_p = \Big(\sum_i \sum_j |g_{ij}|^p\Big)^{1/p},
              \qquad \|g\|_\infty = \max_{i,j} |g_{ij}|

    Args:
        tensors: a tensor or an iterable of tensors (usually gradients).
        norm_type: p > 0, or ``inf``. Default 2. As torch, p <= 0 and
            ``-inf`` are also accepted with torch's meaning: the p-"norm" of
            the vector of per-tensor norms (for 0, the number of tensors
            with a nonzero element; for ``-inf``, the smallest ``|x|``),
            accumulated in float64.
        error_if_nonfinite: raise ``RuntimeError`` if the total is NaN or inf.
        foreach: as torch: None picks the fastest kernel, True requires the
            ``_foreach`` kernels, False forbids them.

    Returns:
        A 0-dim tensor on the first tensor's device: float32, or float64 when
        any tensor is float64. NaN if any element is NaN, inf if any is
        infinite; otherwise finite and accurate to 1e-6 relative (it is inf
        only when the true norm exceeds float32's range). On an accelerator
        nothing is read back to the host. With DTensor gradients (FSDP2,
        tensor parallel, on one mesh or several) it is the norm of the whole
        gradients, equal on every rank, as a DTensor replicated on the first
        gradient's mesh, as torch returns one (distributed/dtensor.py).
    """
    tensors = _as_list(tensors)
    norm_type = float(norm_type)
    if dtensor.has_dtensor(tensors):
        if norm_type > 0:
            total = dtensor.get_total_norm(tensors, norm_type, foreach, _sync_free_ok)
        else:  # torch's own definition, on the whole gradients (gathered: rare orders)
            total = _torch_defined_norm([dtensor.as_plain(t) for t in tensors], norm_type)
            total = total.to(dtype=torch.float64 if any(_wide(t) for t in tensors)
                             else torch.float32)
        return dtensor.replicated(_checked(total, norm_type, error_if_nonfinite), tensors)
    if len(tensors) == 0:
        return torch.tensor(0.0)
    total, _ = _total_norm(distinct_elements(tensors), tensors, norm_type, foreach)
    return _checked(total, norm_type, error_if_nonfinite)


def _torch_defined_norm(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """torch's total for p <= 0 and -inf: the p-"norm" of the per-tensor norms.

    These are not norms, and torch defines the total this way: p = 0 counts
    nonzero elements, so the total counts the tensors that have one; -inf is
    the smallest ``|x|``; p < 0 is ``(sum |x|^p)^(1/p)``, which a zero makes 0.
    No host read; p < 0 is scaled so that nothing overflows or underflows.
    """
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    first = tensors[0].device
    if norm_type == 0 or math.isinf(norm_type):
        norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float64).to(first)
                 for t in tensors]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)
    norms = torch.stack([_negative_order_norm(t, norm_type).to(first) for t in tensors])
    return _negative_order_norm(norms, norm_type)


def _negative_order_norm(x: torch.Tensor, norm_type: float) -> torch.Tensor:
    r"""``(sum |x|^p)^(1/p)`` for p < 0, in float64, as ``m (sum (|x|/m)^p)^(1/p)``.

    With ``m = min |x|`` every term ``(|x|/m)^p`` is at most 1 and the
    smallest element's is 1, so the sum neither overflows nor underflows
    (torch's own underflows for ``|x| = 1e200`` at p = -2 and returns inf).
    """
    x = x.to(torch.float64)
    low = torch.linalg.vector_norm(x, -math.inf)
    unit = torch.where((low > 0) & torch.isfinite(low), low, 1.0)
    return unit * torch.linalg.vector_norm(x / unit, norm_type)


def _checked(total: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    return total


def _total_norm(
    elements: Elements, tensors: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> tuple[torch.Tensor, PowerSums | None]:
    """The total as the 0-dim result tensor, and its exact summary when it was read back."""
    device = tensors[0].device
    out_dtype = torch.float64 if any(t.dtype in _WIDE for t in tensors) else torch.float32
    pieces = elements.whole or [p.measure for p in elements.owned]
    if not norm_type > 0:
        _refuse_foreach_where_unsupported(tensors, foreach)
        return _torch_defined_norm(pieces, norm_type).to(device, out_dtype), None
    if device.type != "cpu":
        # A fixed number of fused ops per (device, dtype) group, nothing read back.
        return total_on_device(pieces, norm_type, foreach).to(device, out_dtype), None
    sums = total_power_sums(pieces, norm_type, foreach)
    return sums.norm[0].to(dtype=out_dtype), sums


def _refuse_foreach_where_unsupported(tensors: list[torch.Tensor], foreach: bool | None) -> None:
    """``foreach=True`` on a device without ``_foreach`` kernels raises, as torch's total does
    for every order: the p <= 0 totals use no fused kernel, so nothing else would check it."""
    if not foreach:
        return
    for device in {t.device for t in tensors}:
        if not _device_has_foreach_support(device):
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )


def _sync_free_ok(tensors: list[torch.Tensor], norm_type: float) -> bool:
    """Whether float64 sums of ``tensors`` cannot overflow (DTensor's on-device path)."""
    narrow = all(t.dtype != torch.float64 for t in tensors)
    return narrow and (math.isinf(norm_type) or 0 < norm_type <= FLOAT64_SAFE_P)


def clip_grads_with_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    r"""Scale the gradients of ``parameters`` in place, given their total norm.

    Every gradient is multiplied by

    .. math:: c = \min\Big(1, \frac{\text{max\_norm}}{\text{total\_norm} + 10^{-6}}\Big)

    computed in float32 or wider whatever the gradients' dtype. An element
    that several gradients share (tied weights, views) is scaled once.
    """
    grads = dtensor.local_tensors(_grads(parameters))
    max_norm = float(max_norm)  # checked with nothing to clip, as torch does
    if not grads:
        return
    if not isinstance(total_norm, torch.Tensor):  # torch's torch.clamp refuses a number
        raise TypeError(f"total_norm must be a Tensor, as get_total_norm returns, "
                        f"not {type(total_norm).__name__}")
    total_norm = readable(dtensor.as_plain(total_norm))
    if total_norm.numel() != 1:
        raise RuntimeError(f"total_norm must hold one element, not {total_norm.numel()}")
    scale_elements_(distinct_elements(grads), clip_coefficient(total_norm, max_norm), foreach)


def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to total norm ``max_norm``, in place.

    ``get_total_norm`` of the gradients, then ``clip_grads_with_norm_``.
    Returns the total norm before clipping (see ``get_total_norm``). On the
    CPU the coefficient comes from the exact summary: a total beyond the
    result dtype's range (reported as inf) still clips to ``max_norm``
    instead of zeroing every gradient. On an accelerator it is torch's
    formula on the returned total, computed there, nothing read back: a
    float32 total past float32's range is inf, and zeroes the gradients as
    torch's does.
    """
    parameters = _parameters(parameters)
    grads = _grads(parameters)
    norm_type = float(norm_type)
    if dtensor.has_dtensor(grads):
        total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        clip_grads_with_norm_(parameters, max_norm, total, foreach)
        return total
    if not grads:
        float(max_norm)  # checked with nothing to clip, as torch does
        return torch.tensor(0.0)
    elements = distinct_elements(grads)
    total, sums = _total_norm(elements, grads, norm_type, foreach)
    total = _checked(total, norm_type, error_if_nonfinite)
    if sums is not None:
        coef = exact_clip_coefficient(sums, float(max_norm))
    else:
        coef = clip_coefficient(total, float(max_norm))
    scale_elements_(elements, coef, foreach)
    return total


def clip_grad_value_(
    parameters: TensorOrTensors,
    clip_value: float,
    foreach: bool | None = None,
) -> None:
    """Clamp every gradient element of ``parameters`` to ``[-clip_value, clip_value]``, in place."""
    clip_value = float(clip_value)  # checked with nothing to clamp, as torch does
    clamp_elements_(distinct_elements(dtensor.local_tensors(_grads(parameters))), clip_value,
                    foreach)


def adaptive_clip_grad_(
    parameters: TensorOrTensors,
    clip_factor: float = 0.01,
    eps: float = 1e-3,
) -> None:
    r"""Unit-wise adaptive gradient clipping (AGC, Brock et al. 2021), in place.

    For each output unit ``i`` of each parameter (dimension 0: a row of a
    linear weight, a convolution filter; a vector parameter is one unit)

    .. math:: G_i \leftarrow G_i \cdot \min\Big(1, \lambda
              \frac{\max(\|W_i\|, \epsilon)}{\|G_i\|}\Big)

    as timm's ``adaptive_clip_grad`` and optax's ``adaptive_grad_clip``
    define it, with unit norms accumulated in float64 (exact in every dtype)
    and no host-device read (core/adaptive.py).

    Args:
        parameters: a tensor or an iterable of tensors with ``.grad``.
        clip_factor: ``lambda``, the largest ratio of a unit's gradient norm
            to its weight norm. Default 0.01.
        eps: the floor of a unit's weight norm, so that units whose weights
            start at zero can still move. Default 1e-3.

    Raises ``ValueError``, before any gradient changes, for ``clip_factor``
    <= 0 or NaN (a negative one would flip the clipped units' gradients, 0
    zero them all), ``eps`` < 0 or NaN, and sparse gradients, which have no
    unit norms in torch.
    """
    clip_factor, eps = float(clip_factor), float(eps)
    if not clip_factor > 0:
        raise ValueError(f"clip_factor must be > 0, got {clip_factor}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    pairs = [(i, p, p.grad) for i, p in enumerate(_parameters(parameters))
             if p.grad is not None]
    for i, _, grad in pairs:
        if grad.layout != torch.strided:
            raise ValueError(f"adaptive_clip_grad_ takes dense gradients; parameter {i}'s is "
                             f"sparse ({grad.layout}): clip it with clip_grad_norm_ instead")
    adaptive_clip_([(p, grad) for _, p, grad in pairs], clip_factor, eps)
