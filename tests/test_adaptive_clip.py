"""adaptive_clip_grad_ (AGC) against a float64 reference, timm's definition and a real run."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from benchmarks import host_ops
from gradclip_cli import adaptive_clip_grad_
from tests.devices import DEVICES


def reference_agc(weight: torch.Tensor, grad: torch.Tensor, clip_factor: float,
                  eps: float) -> torch.Tensor:
    """Brock et al.'s rule unit by unit in Python floats on float64 values (no torch norms)."""
    w = weight.detach().double().reshape(weight.shape[0], -1) if weight.dim() > 1 \
        else weight.detach().double().reshape(1, -1)
    g = grad.double().reshape(w.shape)
    out = g.clone()
    for i in range(w.shape[0]):
        def norm(row):
            top = max(abs(v) for v in row) or 1.0
            return top * math.sqrt(sum((v / top) ** 2 for v in row))
        w_norm = max(norm(w[i].tolist()), eps)
        g_norm = norm(g[i].tolist())
        if g_norm / w_norm > clip_factor:
            out[i] = g[i] * (clip_factor * w_norm / max(g_norm, 1e-6))
    return out.reshape(grad.shape)


def timm_agc(parameters, clip_factor: float, eps: float) -> None:
    """timm's adaptive_clip_grad, written from its definition: float32 norms over all
    dimensions but the first (whole-tensor for vectors), clip where not below the limit."""
    for p in parameters:
        if p.grad is None:
            continue
        dims = tuple(range(1, p.dim())) if p.dim() > 1 else None
        def unit(x, dims=dims):
            return x.norm(2, dim=dims, keepdim=True) if dims else x.norm(2)
        limit = unit(p.detach()).clamp(min=eps) * clip_factor
        g_norm = unit(p.grad)
        clipped = p.grad * (limit / g_norm.clamp(min=1e-6))
        p.grad.copy_(torch.where(g_norm < limit, p.grad, clipped))


def _params(shapes, dtype, grad_scale, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    params = []
    for k, shape in enumerate(shapes):
        p = nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype))
        p.grad = (torch.randn(shape, generator=g, dtype=torch.float64) * grad_scale
                  * 10.0 ** (k - 1)).to(device, dtype)
        params.append(p)
    return params


SHAPES = [(7,), (5, 9), (4, 3, 2, 2), ()]


def assert_rounded_from(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` is the float64 ``want`` rounded to got's dtype, within one unit in the last place
    (the factor and the reference's are each correct to float64 rounding)."""
    rtol = 1e-12 if got.dtype == torch.float64 else torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=rtol, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("grad_scale", [1e-3, 1e-1, 10.0])
def test_matches_float64_reference(dtype, grad_scale, device):
    params = _params(SHAPES, dtype, grad_scale, device=device)
    want = [reference_agc(p, p.grad, 0.01, 1e-3) for p in params]
    adaptive_clip_grad_(params, clip_factor=0.01, eps=1e-3)
    for p, w in zip(params, want):
        assert_rounded_from(p.grad, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rounded_once_for_every_shape(dtype):
    """The product is formed in float64 and rounded once to the gradient's dtype, for a
    vector or a scalar (one unit: biases, gains) as for a matrix: the float64 reference
    rounded to the dtype, element for element."""
    params = _params([(4000,), (), (40, 100)], dtype, 10.0, seed=7)
    want = [reference_agc(p, p.grad, 0.01, 1e-3).to(dtype) for p in params]
    assert all(not torch.equal(p.grad, w) for p, w in zip(params, want))  # all are clipped
    adaptive_clip_grad_(params, clip_factor=0.01, eps=1e-3)
    for p, w in zip(params, want):
        assert torch.equal(p.grad, w), (tuple(p.shape), int((p.grad != w).sum()))


def test_extreme_magnitudes_where_float32_norms_overflow():
    params = _params([(6, 8), (16,)], torch.float32, 1.0)
    for p in params:
        p.data.mul_(1e20)
        p.grad.mul_(1e21)
    want = [reference_agc(p, p.grad, 0.02, 1e-3) for p in params]
    adaptive_clip_grad_(params, clip_factor=0.02)
    for p, w in zip(params, want):
        assert torch.isfinite(p.grad).all()
        assert_rounded_from(p.grad, w)
    # timm's float32 unit norms overflow to inf here: its limit and norm are inf
    check = _params([(6, 8)], torch.float32, 1.0)[0]
    check.data.mul_(1e20)
    check.grad.mul_(1e21)
    assert torch.isinf(check.detach().norm(2, dim=1)).all()


@pytest.mark.parametrize("clip_factor, eps", [(0.01, 1e-3), (0.1, 1e-2), (1e-3, 1e-6)])
def test_agrees_with_timms_definition(clip_factor, eps):
    ours = _params(SHAPES[:3], torch.float32, 1.0, seed=4)
    theirs = _params(SHAPES[:3], torch.float32, 1.0, seed=4)
    adaptive_clip_grad_(ours, clip_factor, eps)
    timm_agc(theirs, clip_factor, eps)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=0)


def test_units_of_real_layers_are_timms():
    """Units along dimension 0 for every layer, as timm: an embedding's rows, a transposed
    convolution's input channels (its weight is [in, out, ...]), Conv1d/Conv3d filters, a
    linear weight with one input feature (optax, in JAX's layout, would take it whole)."""
    torch.manual_seed(3)
    model = nn.ModuleList([nn.Embedding(12, 6), nn.ConvTranspose2d(3, 5, 3), nn.Conv1d(2, 4, 3),
                           nn.Conv3d(2, 3, 2), nn.Linear(1, 7), nn.LayerNorm(6)])
    model.register_parameter("scale", nn.Parameter(torch.tensor(0.5)))
    theirs = copy.deepcopy(model)
    for a, b in zip(model.parameters(), theirs.parameters()):
        a.grad = torch.randn(a.shape) * 0.1
        b.grad = a.grad.clone()
    adaptive_clip_grad_(model.parameters(), 0.02, 1e-3)
    timm_agc(list(theirs.parameters()), 0.02, 1e-3)
    for (name, a), b in zip(model.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=0, msg=name)
    rows = model[0].weight.grad.double().norm(dim=1)
    limits = 0.02 * model[0].weight.detach().double().norm(dim=1).clamp(min=1e-3)
    assert (rows <= limits * (1 + 1e-6)).all()  # each token's row within its own limit


def test_zero_weights_use_eps_and_small_units_are_untouched():
    w = nn.Parameter(torch.zeros(3, 4))
    w.grad = torch.tensor([[1e-8] * 4, [1.0] * 4, [0.0] * 4])
    before = w.grad.clone()
    adaptive_clip_grad_([w], clip_factor=0.01, eps=1e-3)
    assert torch.equal(w.grad[0], before[0])  # 2e-8 <= 0.01 * 1e-3
    assert torch.equal(w.grad[2], before[2])
    assert float(w.grad[1].norm()) == pytest.approx(0.01 * 1e-3, rel=1e-6)


def test_nonfinite_values_as_timm_and_optax():
    """A unit whose gradient or weights hold a NaN is clipped, as timm's and optax's
    ``where(norm < limit, g, clipped)`` clips it: the whole unit becomes NaN, so a NaN
    weight never lets its unit's gradient through unclipped. An infinite gradient unit is
    clipped (NaN at the inf, 0 elsewhere); an infinite weight unit has no limit."""
    ours = _params([(4, 5)], torch.float32, 1.0)
    theirs = _params([(4, 5)], torch.float32, 1.0)
    for ps in (ours, theirs):
        ps[0].grad[0, 1] = math.nan
        ps[0].grad[1, 2] = math.inf
        ps[0].data[2, 3] = math.nan
        ps[0].data[3, 0] = math.inf
        ps[0].grad[2:].mul_(100.0)
    before = ours[0].grad.clone()
    adaptive_clip_grad_(ours)
    timm_agc(theirs, 0.01, 1e-3)
    torch.testing.assert_close(ours[0].grad, theirs[0].grad, equal_nan=True)
    assert torch.isnan(ours[0].grad[0]).all() and torch.isnan(ours[0].grad[2]).all()
    assert torch.equal(ours[0].grad[3], before[3])
    bias = nn.Parameter(torch.tensor([1.0, math.nan]))
    bias.grad = torch.tensor([5.0, 5.0])
    adaptive_clip_grad_([bias])
    assert torch.isnan(bias.grad).all()


@pytest.mark.parametrize("options", [{"clip_factor": -0.01}, {"clip_factor": 0.0},
                                     {"clip_factor": math.nan}, {"eps": -1e-3},
                                     {"eps": math.nan}])
def test_bad_factors_are_refused_before_any_gradient_changes(options):
    """A negative clip_factor would flip every clipped unit's gradient, 0 would zero every
    gradient, NaN would make them NaN: refused, as is a negative or NaN eps."""
    params = _params([(3, 4)], torch.float32, 10.0)
    before = params[0].grad.clone()
    with pytest.raises(ValueError, match=next(iter(options))):
        adaptive_clip_grad_(params, **options)
    assert torch.equal(params[0].grad, before)


def test_sparse_gradients_are_refused_by_name():
    """A sparse gradient (nn.Embedding(sparse=True)) has no unit norms in torch (timm fails
    in torch.norm): refused with a message that says so, before any gradient changes."""
    emb = nn.Embedding(10, 4, sparse=True)
    head = nn.Linear(4, 2)
    head(emb(torch.tensor([1, 2, 2]))).sum().mul(1000).backward()
    before = head.weight.grad.clone()
    with pytest.raises(ValueError, match="sparse"):
        adaptive_clip_grad_([head.weight, emb.weight])
    assert torch.equal(head.weight.grad, before)


def test_no_host_read_and_no_growth_on_meta():
    def run(width):
        params = [nn.Parameter(torch.empty(64, width, device="meta")) for _ in range(3)]
        for p in params:
            p.grad = torch.empty_like(p)
        return host_ops.count(lambda: adaptive_clip_grad_(params))
    small, wide = run(16), run(64)
    assert small.reads == 0 and small == wide


def test_short_training_run():
    """An MLP trained with AGC: every step leaves each unit's gradient within the limit,
    units below it bit for bit as they were, and the loss goes down."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(256, 8)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, clipped_units = [], 0
    for _ in range(60):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        before = {p: p.grad.clone() for p in model.parameters()}
        want = {p: reference_agc(p, p.grad, 0.05, 1e-3) for p in model.parameters()}
        adaptive_clip_grad_(model.parameters(), clip_factor=0.05)
        for p in model.parameters():
            assert_rounded_from(p.grad, want[p])
            rows = p.grad.reshape(p.shape[0], -1) if p.dim() > 1 else p.grad.reshape(1, -1)
            w_rows = p.detach().reshape(rows.shape)
            old = before[p].reshape(rows.shape)
            for g_row, w_row, o_row in zip(rows, w_rows, old):
                limit = 0.05 * max(float(w_row.double().norm()), 1e-3)
                assert float(g_row.double().norm()) <= limit * (1 + 1e-6)
                if float(o_row.double().norm()) <= limit:
                    assert torch.equal(g_row, o_row)
                else:
                    clipped_units += 1
        optimizer.step()
        losses.append(float(loss.detach()))
    assert clipped_units > 0  # the run exercised the clipping
    assert losses[-1] < 0.5 * losses[0]
