"""The torch drop-ins: same behaviour as torch.nn.utils where torch is right,
the float64 reference where it is not."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradclip_cli as gc
from tests.core.reference import norm, rel_err
from tests.test_adaptive_clip import reference_agc


def model_with_grads(seed=0, scale=1.0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    m = m.to(dtype)
    m(torch.randn(5, 8, dtype=dtype)).pow(2).sum().backward()
    for p in m.parameters():
        p.grad.mul_(scale)
    return m


def grads(m):
    return [p.grad for p in m.parameters()]


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 3.0, math.inf])
def test_get_total_norm_agrees_with_torch_and_float64(p):
    g = grads(model_with_grads())
    ours = gc.get_total_norm(g, p)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert rel_err(float(ours), norm(g, p)) <= 1e-6
    assert torch.allclose(ours, torch.nn.utils.get_total_norm(g, p), rtol=1e-5)


def test_clip_grad_norm_matches_torch_in_a_training_loop():
    a, b = model_with_grads(1), model_with_grads(1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    for step in range(3):
        total_a = gc.clip_grad_norm_(a.parameters(), 0.5)
        total_b = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
        assert torch.allclose(total_a, total_b, rtol=1e-5)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-8)
        opt_a.step()
        opt_b.step()
        for m in (a, b):
            m.zero_grad()
            torch.manual_seed(step)
            m(torch.randn(5, 8)).pow(2).sum().backward()
    assert rel_err(float(gc.get_total_norm(grads(a))), norm(grads(a), 2)) <= 1e-6


def test_huge_fp32_gradients_are_clipped_not_zeroed():
    m = model_with_grads(scale=1e20)
    ref = norm(grads(m), 2)
    assert math.isinf(ref) is False
    assert torch.nn.utils.get_total_norm(grads(m)).isinf()  # torch overflows
    total = gc.clip_grad_norm_(m.parameters(), 1.0)
    assert rel_err(float(total), ref) <= 1e-6
    after = norm(grads(m), 2)
    assert rel_err(after, 1.0) <= 1e-5  # clipped to max_norm, not to zero


def test_tiny_gradients_are_not_zero():
    g = grads(model_with_grads(scale=1e-25))
    assert torch.nn.utils.get_total_norm(g) == 0
    assert rel_err(float(gc.get_total_norm(g)), norm(g, 2)) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_return_accurate_float32(dtype):
    g = [(torch.rand(20000, generator=torch.Generator().manual_seed(2)) * 600).to(dtype)]
    total = gc.get_total_norm(g)
    assert total.dtype == torch.float32
    assert rel_err(float(total), norm(g, 2)) <= 1e-6


def test_float64_gradients_give_float64():
    g = grads(model_with_grads(dtype=torch.float64))
    total = gc.get_total_norm(g)
    assert total.dtype == torch.float64
    assert rel_err(float(total), norm(g, 2)) <= 1e-12


def test_error_if_nonfinite_raises_like_torch():
    g = [torch.tensor([1.0, float("nan")])]
    with pytest.raises(RuntimeError, match="non-finite"):
        gc.get_total_norm(g, error_if_nonfinite=True)
    assert gc.get_total_norm(g).isnan()
    assert gc.get_total_norm([torch.tensor([1.0, float("inf")])]).isinf()


def test_nonfinite_clip_behaves_as_torch_without_error_flag():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = p.grad.clone()
    gc.clip_grad_norm_([p], 1.0)
    torch.nn.utils.clip_grad_norm_([q], 1.0)
    assert torch.equal(p.grad.isnan(), q.grad.isnan())
    with pytest.raises(RuntimeError):
        gc.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


def test_tied_parameters_count_once_and_are_scaled_once():
    shared = torch.nn.Parameter(torch.zeros(4))
    shared.grad = torch.full((4,), 3.0)
    other = torch.nn.Parameter(torch.zeros(1))
    other.grad = torch.tensor([4.0])
    # The same parameter listed twice (as a tied weight appears under two names).
    total = gc.clip_grad_norm_([shared, other, shared], 5.0)
    assert rel_err(float(total), math.sqrt(4 * 9 + 16)) <= 1e-6
    coef = 5.0 / (float(total) + 1e-6)
    assert torch.allclose(shared.grad, torch.full((4,), 3.0 * coef))


def test_clip_grads_with_norm_uses_torch_coefficient():
    m = model_with_grads()
    before = [g.clone() for g in grads(m)]
    total = gc.get_total_norm(grads(m))
    gc.clip_grads_with_norm_(m.parameters(), 0.1, total)
    coef = min(1.0, 0.1 / (float(total) + 1e-6))
    for b, g in zip(before, grads(m)):
        assert torch.allclose(g, b * coef, rtol=1e-6)


def test_clip_grads_with_norm_bf16_coefficient_in_float32():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    p.grad = torch.tensor([300.0, 400.0], dtype=torch.bfloat16)
    total = gc.get_total_norm([p.grad])
    gc.clip_grads_with_norm_([p], 1.0, total)
    assert p.grad.dtype == torch.bfloat16
    assert torch.allclose(p.grad.float(), torch.tensor([0.6, 0.8]), rtol=1e-2)


def test_clip_grad_value_matches_torch():
    a, b = model_with_grads(3, scale=10.0), model_with_grads(3, scale=10.0)
    gc.clip_grad_value_(a.parameters(), 0.5)
    torch.nn.utils.clip_grad_value_(b.parameters(), 0.5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)


def test_single_tensor_empty_and_foreach_flags():
    t = torch.tensor([3.0, 4.0])
    assert float(gc.get_total_norm(t)) == 5.0
    assert float(gc.get_total_norm([])) == 0.0
    assert float(gc.get_total_norm([t], foreach=True)) == 5.0
    assert float(gc.get_total_norm([t], foreach=False)) == 5.0
    p = torch.nn.Parameter(torch.zeros(2))
    assert float(gc.clip_grad_norm_([p], 1.0)) == 0.0  # no grads at all


def _raised(call):
    try:
        call()
    except Exception as error:  # the class and the text are what is compared
        return type(error), str(error)
    return None


NO_GRADS = [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(("name", "args"), [
    ("clip_grad_norm_", (NO_GRADS, 1.0, None)),  # norm_type
    ("clip_grad_norm_", (NO_GRADS, None)),  # max_norm
    ("clip_grads_with_norm_", (NO_GRADS, "one", torch.tensor(1.0))),
    ("clip_grad_value_", (NO_GRADS, None)),
])
def test_arguments_are_checked_with_no_gradients_as_torch(name, args):
    # torch converts norm_type, max_norm and clip_value with float() before it
    # looks for gradients: a bad value raises even when there is nothing to clip
    theirs = _raised(lambda: getattr(torch.nn.utils, name)(*args))
    assert theirs is not None
    assert _raised(lambda: getattr(gc, name)(*args)) == theirs


@pytest.mark.parametrize("total", [5.0, 5, np.float32(5.0), torch.tensor([5.0, 6.0])],
                         ids=["float", "int", "numpy", "two elements"])
def test_clip_grads_with_norm_refuses_a_total_torch_refuses(total):
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    theirs = _raised(lambda: torch.nn.utils.clip_grads_with_norm_([p], 1.0, total))
    assert theirs is not None and torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0]))
    ours = _raised(lambda: gc.clip_grads_with_norm_([p], 1.0, total))
    assert ours is not None and ours[0] is theirs[0]
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0]))


@pytest.mark.parametrize("p", [2.0, math.inf, 0.0, -1.0, -math.inf])
def test_foreach_true_on_a_device_without_foreach_kernels_raises_as_torch(p):
    # meta has no _foreach kernels; torch refuses foreach=True there for every order
    grads = [torch.empty(4, 3, device="meta"), torch.empty(7, device="meta")]
    theirs = _raised(lambda: torch.nn.utils.get_total_norm(grads, p, foreach=True))
    assert theirs is not None and theirs[0] is RuntimeError
    assert _raised(lambda: gc.get_total_norm(grads, p, foreach=True)) == theirs
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for param, g in zip(params, grads):
        param.grad = g
    assert _raised(lambda: gc.clip_grad_norm_(params, 1.0, p, error_if_nonfinite=True,
                                              foreach=True)) == theirs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_cuda_total_matches_float64(dtype):
    g = [(torch.randn(100_000, generator=torch.Generator().manual_seed(4)) * 1e3).to(dtype)]
    total = gc.get_total_norm([x.cuda() for x in g])
    assert total.device.type == "cuda"
    assert rel_err(float(total), norm(g, 2)) <= 1e-6


# Magnitudes at which torch's own float32 (half: float16) sums of squares overflow.
CUDA_SCALES = {torch.float16: 3e2, torch.bfloat16: 1e30, torch.float32: 1e30,
               torch.float64: 1e200}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("p", [1.0, 2.0, 8.0, math.inf])
@pytest.mark.parametrize("dtype", list(CUDA_SCALES))
def test_cuda_drop_ins_never_synchronise_and_match_float64(dtype, p):
    """On CUDA every drop-in runs under torch's sync debug mode set to raise on any
    host-device synchronisation (torch's own clip_grad_norm_ passes it too), and each
    one's result matches float64 applied to what it was given: the total, the clipped
    gradients, the clamp, AGC."""
    g = torch.Generator().manual_seed(7)
    shapes = [(300, 17), (4096,), (3,), (64, 64), (1,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda", dtype)) for s in shapes]
    for param in params:
        param.grad = (torch.randn(param.shape, generator=g, dtype=torch.float64)
                      * CUDA_SCALES[dtype]).to("cuda", dtype)
    listed = [*params, params[1]]  # a tied parameter listed twice counts once
    bound = 0.05 * CUDA_SCALES[dtype]
    control = [torch.nn.Parameter(torch.ones(8, device="cuda")) for _ in range(2)]
    for param in control:
        param.grad = torch.ones_like(param)
    snapshots = []

    def snapshot():
        snapshots.append([param.grad.clone() for param in params])

    snapshot()
    want = norm([b.cpu() for b in snapshots[0]], p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.nn.utils.clip_grad_norm_(control, 1.0)  # the mode lets torch's own call pass
        total = gc.get_total_norm([param.grad for param in listed], p)
        clipped = gc.clip_grad_norm_(listed, want / 10, p)
        snapshot()
        gc.clip_grads_with_norm_(listed, 1e300, clipped)  # coefficient 1: nothing moves
        snapshot()
        gc.clip_grad_value_(listed, bound)
        snapshot()
        gc.adaptive_clip_grad_(listed)
        snapshot()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    assert total.device.type == clipped.device.type == "cuda"
    assert total.dtype == clipped.dtype == wide and total.dim() == 0
    assert rel_err(float(total), want) <= 1e-6 and rel_err(float(clipped), want) <= 1e-6
    info = torch.finfo(dtype)
    half = dtype in (torch.float16, torch.bfloat16)
    # One rounding to the dtype; a coefficient within 1e-6 (the total's bound) of float64's.
    # Half types: the coefficient rounded to the dtype too (torch's way), one more rounding.
    rtol, atol = max(2e-6, (2 if half else 1) * info.eps), info.tiny * info.eps
    start, scaled, unmoved, clamped, agc = snapshots
    coef = (want / 10) / (want + 1e-6)
    # torch's formula on the returned total, in its dtype (float32 for half types). Wider
    # types multiply by it and round once; half types are scaled as torch scales them
    # (the contract): the coefficient in their own dtype, through the fused multiply.
    applied = torch.clamp((want / 10) / (clipped + 1e-6), max=1.0)
    for i, param in enumerate(params):
        torch.testing.assert_close(scaled[i].double().cpu(), start[i].double().cpu() * coef,
                                   rtol=rtol, atol=atol)
        if half:
            assert torch.equal(scaled[i], start[i] * applied.to(dtype))
        else:
            assert torch.equal(scaled[i], (start[i].to(applied.dtype) * applied).to(dtype))
        assert torch.equal(unmoved[i], scaled[i])
        assert torch.equal(clamped[i], scaled[i].clamp(-bound, bound))
        want_agc = reference_agc(param, clamped[i], 0.01, 1e-3)
        torch.testing.assert_close(agc[i].double().cpu(), want_agc.cpu(), rtol=rtol, atol=atol)
