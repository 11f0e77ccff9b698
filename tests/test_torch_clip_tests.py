"""torch's own tests for its clipping functions, run against gradclip's drop-ins.

Rewritten from pytorch's ``test/test_nn.py`` (``test_clip_grad_norm``,
``test_clip_grad_value``, ``test_clip_grad_norm_error_if_nonfinite``), on each
device as torch's device-type tests run them (the CPU, and CUDA where there is
one) with ``foreach`` None, True and False, keeping torch's assertions and its
tolerances (``torch.testing.assert_close`` is what torch's ``assertEqual``
uses for tensors). Where torch's expectation encodes torch's own overflow,
the expectation comes from a float64 reference instead, and says so.
"""

from __future__ import annotations

import math
import warnings
from itertools import product

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from gradclip_cli import clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_, get_total_norm
from tests.devices import DEVICES

FOREACH = [None, True, False]


def _linear_with_grads(grads, device) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(10, 10, device=device)
    for p, g in zip(layer.parameters(), grads):
        p.grad = None if g is None else g.to(device).view_as(p)
    return layer


def _norm_as_torch_tests_it(layer: nn.Module, norm_type) -> torch.Tensor:
    """torch's test reference: sum of |g|^p in the gradients' dtype, or the max for inf."""
    norm_type = float(norm_type)
    if norm_type == math.inf:
        return max(p.grad.abs().max() for p in layer.parameters())
    total = sum(p.grad.abs().pow(norm_type).sum() for p in layer.parameters())
    return pow(total, 1.0 / norm_type)


def _common_scale(layer: nn.Module, grads) -> torch.Tensor:
    """Every element scaled by one factor: the ratios have no spread."""
    ratios = torch.cat([p.grad.div(g).view(-1) for p, g in zip(layer.parameters(), grads)])
    assert_close(ratios.std(), torch.tensor(0.0, device=ratios.device))
    return ratios[0]


def _large_grads(device):
    return (torch.arange(1.0, 101, device=device).view(10, 10),
            torch.ones(10, device=device).div(1000))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("norm_type", [0.5, 1.5, 2, 4, "inf"])
def test_clip_grad_norm(norm_type, foreach, device):
    max_norm = 2
    grads = _large_grads(device)
    layer = _linear_with_grads(grads, device)
    before = _norm_as_torch_tests_it(layer, norm_type)
    norm = clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    after = _norm_as_torch_tests_it(layer, norm_type)
    assert_close(norm, before)
    assert_close(after, torch.tensor(float(max_norm), device=device))
    assert after <= before
    _common_scale(layer, grads)

    # the decomposed functions
    grads = _large_grads(device)
    layer = _linear_with_grads(grads, device)
    before = _norm_as_torch_tests_it(layer, norm_type)
    total = get_total_norm([p.grad for p in layer.parameters()], norm_type=norm_type,
                           foreach=foreach)
    clip_grads_with_norm_(layer.parameters(), max_norm, total, foreach=foreach)
    after = _norm_as_torch_tests_it(layer, norm_type)
    assert_close(total, before)
    assert_close(after, torch.tensor(float(max_norm), device=device))
    assert after <= before
    _common_scale(layer, grads)

    # small gradients are left as they are
    grads = (torch.rand(10, 10, device=device).div(10000),
             torch.ones(10, device=device).div(500))
    layer = _linear_with_grads(grads, device)
    before = _norm_as_torch_tests_it(layer, norm_type)
    norm = clip_grad_norm_(layer.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    after = _norm_as_torch_tests_it(layer, norm_type)
    assert_close(norm, before)
    assert_close(before, after)
    assert after <= max_norm
    assert_close(_common_scale(layer, grads), torch.tensor(1.0, device=device))

    # a single tensor is accepted
    p1, p2 = torch.randn(10, 10, device=device), torch.randn(10, 10, device=device)
    g = torch.arange(1.0, 101, device=device).view(10, 10)
    p1.grad, p2.grad = g.clone(), g.clone()
    clip_grad_norm_(p1, max_norm, norm_type=norm_type, foreach=foreach)
    clip_grad_norm_([p2], max_norm, norm_type=norm_type, foreach=foreach)
    assert_close(p1.grad, p2.grad)

    # an exhausted generator warns, as torch does
    params = layer.parameters()
    for _ in params:
        pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)
    assert [str(w.message) for w in caught] == [
        "`parameters` is an empty generator, no gradient clipping will occur."]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("foreach", FOREACH)
def test_clip_grad_value(foreach, device):
    clip_value = 2.5
    grad_w = torch.arange(-50.0, 50, device=device).view(10, 10).div_(5)
    grad_b = torch.ones(10, device=device).mul_(2)
    for grads in ([grad_w, grad_b], [grad_w, None]):
        layer = _linear_with_grads(grads, device)
        clip_grad_value_(layer.parameters(), clip_value, foreach=foreach)
        for p in (p for p in layer.parameters() if p.grad is not None):
            assert p.grad.max() <= clip_value
            assert p.grad.min() >= -clip_value

    p1, p2 = torch.randn(10, 10, device=device), torch.randn(10, 10, device=device)
    g = torch.arange(-50.0, 50, device=device).view(10, 10).div_(5)
    p1.grad, p2.grad = g.clone(), g.clone()
    clip_grad_value_(p1, clip_value, foreach=foreach)
    clip_grad_value_([p2], clip_value, foreach=foreach)
    assert_close(p1.grad, p2.grad)


# -- error_if_nonfinite, over every order torch accepts ------------------------

NORMS_POS = [0.1, 1, 2, 3.5, math.inf]
NORMS_NEG = [-0.1, -1, -2, -3.5]
NORMS_EXCEPT_0 = NORMS_POS + NORMS_NEG
NORMS_ALL = [*NORMS_EXCEPT_0, 0]

# (one element only, a finite parameter first, scalars, orders torch finds
# non-finite, orders torch finds finite), as torch's table.
CASES = [
    (False, False, [math.inf, -math.inf], NORMS_EXCEPT_0, [0]),
    (False, True, [math.inf, -math.inf], NORMS_POS, [*NORMS_NEG, 0]),
    (True, False, [math.inf, -math.inf], NORMS_POS, [*NORMS_NEG, 0]),
    (True, True, [math.inf, -math.inf], NORMS_POS, [*NORMS_NEG, 0]),
    (False, False, [math.nan], NORMS_EXCEPT_0, [0]),
    (False, True, [math.nan], NORMS_EXCEPT_0, [0]),
    (True, False, [math.nan], NORMS_EXCEPT_0, [0]),
    (True, True, [math.nan], NORMS_EXCEPT_0, [0]),
    (False, False, [2e22, -2e22], [], NORMS_ALL),
    (False, True, [2e22, -2e22], [], NORMS_ALL),
    (True, False, [2e22, -2e22], [], NORMS_ALL),
    (True, True, [2e22, -2e22], [], NORMS_ALL),
    # torch: non-finite for [3.5, 2, -2, -3.5] (the first row) or [3.5, 2]: its
    # float64 sums of 2e200 ** p overflow (and, for p < 0, underflow to a
    # zero sum whose root is inf). The true norms are finite (float64
    # reference below): gradclip returns them and does not raise.
    (False, False, [2e200, -2e200], [3.5, 2, -2, -3.5], [math.inf, 1, 0.1, 0, -1, -0.1]),
    (False, True, [2e200, -2e200], [3.5, 2], [*NORMS_NEG, math.inf, 1, 0.1, 0]),
    (True, False, [2e200, -2e200], [3.5, 2], [*NORMS_NEG, math.inf, 1, 0.1, 0]),
    (True, True, [2e200, -2e200], [3.5, 2], [*NORMS_NEG, math.inf, 1, 0.1, 0]),
]


def _parameters(scalar: float, one_element: bool, finite_first: bool,
                device: str) -> list[nn.Parameter]:
    param = torch.ones(10, dtype=torch.float64, device=device, requires_grad=True)
    (param[1] if one_element else param).mul(scalar).sum().backward()
    if not finite_first:
        return [param]
    first = torch.ones(1, dtype=torch.float64, device=device, requires_grad=True)
    first.mul(1).sum().backward()
    return [first, param]


def _reference(values: list[list[float]], p: float) -> float:
    """torch's definition of the total (the p-"norm" of per-tensor norms), in exact-enough
    Python float arithmetic, scaled so that no power overflows or underflows."""
    def one(xs):
        xs = [abs(x) for x in xs]
        if p == 0:  # a NaN is not zero: it counts
            return float(sum(x != 0 for x in xs))
        if any(math.isnan(x) for x in xs):
            return math.nan
        if math.isinf(p):
            return max(xs) if p > 0 else min(xs)
        m = max(xs) if p > 0 else min(xs)
        if m == 0 or math.isinf(m):
            return m if p > 0 else (0.0 if m == 0 else math.inf)
        terms = [math.inf if x == 0 and p < 0 else (x / m) ** p for x in xs]
        return m * sum(terms) ** (1 / p)
    return one([one(v) for v in values])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_clip_grad_norm_error_if_nonfinite(case, device):
    one_element, finite_first, scalars, torch_nonfinite, torch_finite = CASES[case]
    orders = [(p, True) for p in torch_nonfinite] + [(p, False) for p in torch_finite]
    for (norm_type, torch_says_nonfinite), scalar, error_if_nonfinite in product(
            orders, scalars, [False, True]):
        parameters = _parameters(scalar, one_element, finite_first, device)
        expected = _reference([p.grad.tolist() for p in parameters], float(norm_type))
        nonfinite = not math.isfinite(expected)
        if abs(scalar) != 2e200:
            assert nonfinite == torch_says_nonfinite  # torch's table, where it is right
        where = (norm_type, scalar, one_element, finite_first, error_if_nonfinite)
        if nonfinite and error_if_nonfinite:
            before = [p.grad.clone() for p in parameters]
            with pytest.raises(RuntimeError,
                               match=f"The total norm of order {float(norm_type)} for gradients"):
                clip_grad_norm_(parameters, 1, norm_type=norm_type, error_if_nonfinite=True)
            assert_close([p.grad for p in parameters], before, equal_nan=True)
        else:
            total = clip_grad_norm_(parameters, 1, norm_type=norm_type,
                                    error_if_nonfinite=error_if_nonfinite)
            if nonfinite:
                assert not math.isfinite(float(total)), where
            else:
                assert float(total) == pytest.approx(expected, rel=1e-12), where


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [0, -1, -0.5, -2, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orders_at_most_zero_match_torch(norm_type, dtype, device):
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(s, generator=g, dtype=dtype).to(device) for s in [(5, 4), (9,), (3, 3)]]
    grads[1][3] = 0.0  # p < 0 of a tensor with a zero is 0
    ours = get_total_norm(grads, norm_type)
    theirs = torch.nn.utils.get_total_norm(grads, norm_type)
    assert ours.dtype == dtype
    assert_close(ours, theirs.to(dtype))
