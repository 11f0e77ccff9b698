"""Whether an fp32 master copy is the model's weight: one rule for every mixed-precision layout.

Megatron's ``Float16OptimizerWithFloat16Params`` and distributed optimizer, and
DeepSpeed's ``FP16_UnfusedOptimizer``, keep an fp32 copy of each 16-bit parameter
and copy it, rounded, into the parameter after every step. So the rounded master
equals the model's tensor, and the layouts use that equality as evidence: which
slice of a flat buffer is whose, which parameters are trained.

The NaN policy: a NaN element of the master must be a NaN of the model's tensor
at the same place, and nowhere else a NaN. Rounding keeps a NaN a NaN, so a run
that diverged saves NaN in both, and that is the checkpoint a user brings to
find out what happened: refusing it as "the weights disagree" (``torch.equal``,
which holds NaN unequal to itself) would hide the finding behind a false
refusal. A NaN on one side only is a real disagreement and stays one. An
infinity must match an infinity of the same sign, as any other value.

Copies of one tensor (a DCP piece replicated on ranks, a layer tied across pipeline
stages) are one rule stricter: written from the same tensor, they are the same bits
(``same_bits``), a NaN included.
"""

from __future__ import annotations

import torch


def rounds_to(master: torch.Tensor, model: torch.Tensor) -> bool:
    """Whether ``master`` rounded to ``model``'s dtype is ``model``, element for element,
    a NaN matching a NaN (the module's docstring gives the policy)."""
    if master.shape != model.shape:
        return False
    cast = master.to(model.dtype)
    return bool(((cast == model) | (cast.isnan() & model.isnan())).all())


def head_key(value: torch.Tensor, dtype: torch.dtype, count: int = 64) -> tuple:
    """A hashable key of ``value``'s shape and its first ``count`` elements rounded to
    ``dtype``, under which tensors that ``rounds_to`` may call equal meet: NaN elements
    are keyed by place (a float NaN is unequal to itself, so it cannot key a dict)."""
    head = value.flatten()[:count].to(dtype)
    nan = head.isnan()
    values = torch.where(nan, torch.zeros_like(head), head)
    return (tuple(value.shape), dtype, tuple(values.tolist()), tuple(nan.tolist()))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two stored copies are one tensor: the same dtype, shape and bits, a NaN
    included (a copy is written from the same tensor, so even its NaN payloads match)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
