"""Clip's decisions (``clipping.py``) on plain data, with no file or rank: the scaling
passed in is a float64 reference written here, rounded to the stored dtype."""

from __future__ import annotations

import math

import torch

from gradclip_cli import clipping
from gradclip_cli.core import tensor_power_sums


def total(*tensors: torch.Tensor):
    return tensor_power_sums(list(tensors), 2.0).total()


def norm64(tensors) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def test_the_coefficient_is_lowered_from_the_file_until_the_stored_total_is_within():
    g = torch.Generator().manual_seed(11)
    grads = [torch.randn(200, generator=g).bfloat16() for _ in range(3)]
    calls, stored = [], []

    def scaled(coef, again):  # scaled in float64 from the file's values, stored as bf16
        calls.append(again)
        stored[:] = [(t.double() * coef.value).bfloat16() for t in grads]
        return norm64(stored)

    done = clipping.to_norm(total(*grads), 3.3, [torch.bfloat16], scaled)
    torch_coef = min(1.0, 3.3 / (norm64(grads) + 1e-6))
    assert abs(done.torch_coef.value - torch_coef) <= 1e-6 * torch_coef  # the contract
    assert calls[0] is False and all(calls[1:]) and done.lowered and done.changed
    assert done.coef.value < torch_coef and done.after == norm64(stored) <= 3.3


def test_a_coefficient_of_one_changes_nothing_and_is_not_lowered():
    grads = [torch.tensor([0.3, 0.4])]
    done = clipping.to_norm(total(*grads), 1.0, [torch.float32], lambda c, again: 0.5)
    assert done.coef.is_one and not done.changed and not done.lowered


def test_a_nonfinite_total_is_refused_unless_allowed():
    t = torch.tensor([1.0, math.nan, math.inf, -math.inf, -math.inf])
    why, then = clipping.refusal(total(t), [math.nan], [t.dtype], p=2.0, limit=1.0,
                                 allow_nonfinite=False)
    assert why == "gradient total norm is nan (1 NaN, 1 +inf, 2 -inf)"
    assert then == " (--allow-nonfinite clips anyway)"
    assert clipping.refusal(total(t), [math.nan], [t.dtype], p=2.0, limit=1.0,
                            allow_nonfinite=True) is None


def test_a_coefficient_that_rounds_every_gradient_to_zero_is_refused():
    # 1e-50 is below float32's smallest subnormal (1.4e-45), not float64's (4.9e-324).
    t = torch.tensor([1.0, -0.5])
    assert clipping.refusal(total(t), [1.0], [torch.float32], p=2.0, limit=1e-50,
                            allow_nonfinite=False) is not None
    assert clipping.refusal(total(t), [1.0], [torch.float64], p=2.0, limit=1e-50,
                            allow_nonfinite=False) is None


def test_a_clamp_changes_what_lies_beyond_the_bound_even_beside_a_nan():
    nan_inf, nan_small = torch.tensor([math.nan, math.inf]), torch.tensor([math.nan, 0.5])
    assert clipping.clamp_changes([math.nan], [nan_inf], 1.0)
    assert not clipping.clamp_changes([math.nan], [nan_small], 1.0)
    done = clipping.to_value(1.0, [2.0], [torch.tensor([2.0])], lambda value: value)
    assert done.changed and done.after == 1.0 and done.coef is None and not done.lowered


def test_a_clamp_bound_that_rounds_to_zero_in_every_dtype_is_refused():
    # The reference is torch's own clamp: the bound is cast to the tensor's dtype.
    # (float64's half subnormal is 0.0 itself, which --clip-value refuses as a usage error.)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        info = torch.finfo(dtype)
        smallest = info.smallest_normal * info.eps
        for value in (smallest * 0.5, smallest * 0.51):
            t = torch.tensor([1.0, -0.25], dtype=dtype)
            zeroed = not bool(t.clamp(-value, value).any())
            refused = clipping.refusal(total(t), [1.0], [dtype], p=2.0, limit=None,
                                       allow_nonfinite=False, value=value)
            assert (refused is not None) is zeroed, (dtype, value)
    # One dtype keeps a value: not every gradient would be zero.
    assert clipping.refusal(total(torch.ones(2)), [1.0, 1.0], [torch.float32, torch.float64],
                            p=2.0, limit=None, allow_nonfinite=False, value=1e-50) is None
