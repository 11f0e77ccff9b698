"""Unit-wise adaptive gradient clipping (AGC).

Each output unit ``i`` of a parameter (a row of a linear layer's weight, a
filter of a convolution: everything along dimension 0; a vector or scalar
parameter is one unit) has its gradient ``G_i`` rescaled when it is large
against the unit's weights ``W_i``:

.. math:: G_i \\leftarrow \\begin{cases}
    \\lambda \\frac{\\max(\\|W_i\\|, \\epsilon)}{\\|G_i\\|} G_i
        & \\text{if } \\frac{\\|G_i\\|}{\\max(\\|W_i\\|, \\epsilon)} > \\lambda \\\\
    G_i & \\text{otherwise}\\end{cases}

with ``lambda = clip_factor`` and Frobenius norms over each unit.

References:
    Brock, De, Smith, Simonyan, "High-Performance Large-Scale Image
    Recognition Without Normalization", ICML 2021 (arXiv:2102.06171),
    section 4.1. The same rule as optax's ``adaptive_grad_clip`` and timm's
    ``adaptive_clip_grad``, which also floor ``||G_i||`` at 1e-6 in the
    division and keep a unit only where ``||G_i|| < limit``
    (``where(norm < limit, g, clipped)``): a unit whose gradient or weights
    hold a NaN is clipped by a NaN factor and becomes NaN whole, so a NaN
    weight never passes its unit's gradient through unclipped.

Exact: unit norms of float16/bfloat16/float32 values are accumulated in
float64, where no finite square overflows or underflows (timm's float32
norm is inf for gradients near 1e20); float64 and complex ones are first
divided by each unit's largest ``|x|`` (complex ones measured as ``|z|``).
The factor is applied in float64 and rounded once to the gradient's dtype.
Fused: a fixed number of ops per tensor, no branch on values, so nothing is
read back from an accelerator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# timm and optax floor the gradient's unit norm at this in the division.
GRAD_NORM_FLOOR = 1e-6


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """The 2-norm of each output unit of ``x`` (along dimension 0), as float64.

    Shape ``(units, 1, ..., 1)`` for a tensor of two or more dimensions, so it
    broadcasts against ``x``; ``(1,)`` for a vector (one unit, as timm and
    optax treat biases and gains), a 0-dim tensor for a scalar.
    """
    dims = tuple(range(1, x.dim())) if x.dim() > 1 else None
    if x.is_complex():
        x = x.to(torch.complex128).abs()  # |z| in float64: hypot cannot overflow there
    if x.dtype != torch.float64:
        return torch.linalg.vector_norm(x, 2, dim=dims, keepdim=True, dtype=torch.float64)
    top = torch.linalg.vector_norm(x, float("inf"), dim=dims, keepdim=True)
    unit = torch.where((top > 0) & torch.isfinite(top), top, 1.0)
    return unit * torch.linalg.vector_norm(x / unit, 2, dim=dims, keepdim=True)


def adaptive_clip_factors(weights: torch.Tensor, grads: torch.Tensor, clip_factor: float,
                          eps: float) -> torch.Tensor:
    """Per unit, the factor AGC multiplies the gradient by (1 where it does not clip)."""
    limit = unitwise_norm(weights).clamp(min=eps) * clip_factor
    norm = unitwise_norm(grads)
    # Kept only where below the limit, as timm and optax: a NaN norm or limit clips.
    return torch.where(norm < limit, 1.0, limit / norm.clamp(min=GRAD_NORM_FLOOR))


@torch.no_grad()
def adaptive_clip_(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], clip_factor: float,
                   eps: float) -> None:
    """Clip each ``(weights, grads)`` pair's gradient unit-wise, in place (see the module)."""
    for weights, grads in pairs:
        if grads.numel() == 0:
            continue
        if grads.dim() == 0:  # a view with one dimension: written through to the scalar
            weights, grads = weights.unsqueeze(0), grads.unsqueeze(0)
        # The product is formed in float64 (the factors' dtype) and rounded once: the
        # factors have a dimension, so they take part in type promotion (a 0-dim
        # float64 factor would be cast to the gradients' dtype first and round twice).
        grads.mul_(adaptive_clip_factors(weights.detach(), grads, clip_factor, eps))
