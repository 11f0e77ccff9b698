"""The drop-ins with the tensors torch users really have: parameters, complex, sparse,
shared elements and totals beyond float64, each against torch or a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from gradclip_cli import clip_grad_norm_, clip_grad_value_, get_total_norm

from .core.reference import rel_err


def test_requires_grad_tensors_measure_as_torch():
    x = torch.randn(10, requires_grad=True)
    ours = get_total_norm([x])
    assert not ours.requires_grad
    assert rel_err(float(ours), float(torch.nn.utils.get_total_norm([x]))) <= 1e-6


def test_clip_after_create_graph_matches_torch():
    def grads_of(model_seed: int):
        torch.manual_seed(model_seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        loss = model(torch.randn(16, 4)).pow(2).sum()
        loss.backward(create_graph=True)
        return list(model.parameters())

    ours, theirs = grads_of(0), grads_of(0)
    total = clip_grad_norm_(ours, 0.1)
    want = torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    assert rel_err(float(total), float(want)) <= 1e-6
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad.detach(), b.grad.detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
def test_complex_gradients_count_with_modulus(p):
    g = torch.Generator().manual_seed(1)
    z = torch.complex(torch.randn(64, generator=g), torch.randn(64, generator=g))
    real = torch.randn(10, generator=g)
    want = torch.nn.utils.get_total_norm([z.to(torch.complex128), real.double()], p)
    assert rel_err(float(get_total_norm([z, real], p)), float(want)) <= 1e-6


def test_complex_gradients_are_clipped():
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    w.grad = torch.tensor([3 + 4j, 0, 0], dtype=torch.complex64)
    total = clip_grad_norm_([w], 1.0)
    assert rel_err(float(total), 5.0) <= 1e-6
    torch.testing.assert_close(w.grad, torch.tensor([0.6 + 0.8j, 0, 0], dtype=torch.complex64))


@pytest.mark.parametrize("foreach", [None, False])
def test_complex_gradients_are_not_clamped_as_torch(foreach):
    # torch's clamp raises NotImplementedError for complex types; the real gradient
    # listed after the complex one is left as it was, as torch leaves it
    def params():
        z = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
        z.grad = torch.tensor([3 + 4j, 1j], dtype=torch.complex64)
        x = torch.nn.Parameter(torch.zeros(2))
        x.grad = torch.tensor([5.0, -5.0])
        return [z, x]

    theirs, ours = params(), params()
    with pytest.raises(NotImplementedError):
        torch.nn.utils.clip_grad_value_(theirs, 1.0, foreach=foreach)
    with pytest.raises(NotImplementedError, match="complex"):
        clip_grad_value_(ours, 1.0, foreach=foreach)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


def test_sparse_embedding_gradients_are_measured_and_clipped():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2, 1, 7])).sum().backward()
    dense = emb.weight.grad.to_dense().double()
    total = clip_grad_norm_(emb.parameters(), 0.5)
    assert rel_err(float(total), float(dense.norm())) <= 1e-6
    after = emb.weight.grad.to_dense().double()
    assert rel_err(float(after.norm()), 0.5) <= 1e-6
    clip_grad_value_(emb.parameters(), 0.01)
    assert float(emb.weight.grad.coalesce().values().abs().max()) <= 0.01


def test_shared_elements_count_once_and_scale_once():
    m = torch.randn(6, 5, dtype=torch.float64)
    base = torch.randn(30, dtype=torch.float64)
    views = [m, m.t(), base[0:20], base[10:30], base[3:4].expand(100, 100)]
    want = math.sqrt(float(m.pow(2).sum()) + float(base.pow(2).sum()))
    assert rel_err(float(get_total_norm(views)), want) <= 1e-12
    params = [torch.nn.Parameter(torch.zeros_like(v)) for v in views]
    for p, v in zip(params, views):
        p.grad = v
    m0, base0 = m.clone(), base.clone()
    clip_grad_norm_(params, 1.0)
    c = 1.0 / (want + 1e-6)
    torch.testing.assert_close(m, m0 * c, rtol=1e-12, atol=0)
    torch.testing.assert_close(base, base0 * c, rtol=1e-12, atol=0)


def test_total_beyond_float64_clips_instead_of_zeroing():
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    w.grad = torch.full((4,), 1e308, dtype=torch.float64)
    total = clip_grad_norm_([w], 1.0)
    assert math.isinf(float(total))  # the float64 result cannot hold 2e308
    torch.testing.assert_close(w.grad, torch.full((4,), 0.5, dtype=torch.float64),
                               rtol=1e-12, atol=0)


def _log10_norm(tensors, p: float) -> float:
    """log10 of the p-norm, from float64 power sums (finite where the norm is not)."""
    return math.log10(sum(float(t.double().abs().pow(p).sum()) for t in tensors)) / p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("p", [0.003, 0.02, 0.05])
def test_tiny_p_norm_overflows_as_it_should_never_to_zero(dtype, p):
    # Below p = 1 a tensor's norm is up to n ** (1/p) times its largest |x|: its
    # root can overflow float64 though its power sum does not. That is a total
    # beyond the range, not a NaN among the elements to leave out.
    grads = [(torch.rand(35, generator=torch.Generator().manual_seed(0)) + 0.5).to(dtype)]
    expected = _log10_norm(grads, p)
    out_max = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    total = float(get_total_norm(grads, p))
    if expected > math.log10(out_max):
        assert total == math.inf
    else:
        assert abs(math.log10(total) - expected) <= 1e-6 / math.log(10)


def test_monitor_group_whose_norm_overflows_is_inf_not_zero(tmp_path):
    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model(torch.randn(3, 8)).sum().backward()
    p = 0.003
    record = GradMonitor(model, tmp_path / "log.jsonl", None, norm_type=p).step()
    assert _log10_norm([model.weight.grad], p) > 309  # beyond float64
    assert record["groups"]["weight"] == "inf"
    assert record["total_norm"] == "inf"
    bias = record["groups"]["bias"]
    assert abs(math.log10(bias) - _log10_norm([model.bias.grad], p)) <= 1e-6
    assert record["nonfinite"] == {"nan": 0, "posinf": 0, "neginf": 0}


@pytest.mark.parametrize("p", [0.01, 0.011])
def test_tiny_p_root_of_subnormals_is_the_norm_not_inf(p):
    # Subnormal float64 values at p = 0.01: the power sum over the largest |x|
    # is 4,096, whose root (4096 ** 100 = 2^1200) overflows alone, though the
    # norm, 2^-1074 times it, is about 2^126: within float64's range.
    grads = [torch.full((4096,), 2.0**-1074, dtype=torch.float64),
             torch.full((10,), 2.0**-1000, dtype=torch.float64)]
    expected = _log10_norm(grads, p)
    assert expected < math.log10(torch.finfo(torch.float64).max)
    for given in (grads, grads[:1]):
        total = float(get_total_norm(given, p))
        assert abs(math.log10(total) - _log10_norm(given, p)) <= 1e-6 / math.log(10)


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("p", [0.5, 1.0, 2.0, 7.0])
def test_float64_subnormal_gradients_of_several_sizes_total_to_1e_6(p, foreach):
    # float64 gradients of a few units of the smallest subnormal: each tensor's
    # norm is itself subnormal, and the small tensor's, rounded to float64 alone,
    # is a few percent off, which p < 1 carries into the total.
    # Exact reference: every value scaled by 2^1000 (exact), summed in float64.
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(2000, generator=g, dtype=torch.float64) * 2.0**-1072,
             torch.randn(2, generator=g, dtype=torch.float64) * 2.0**-1072]
    up = [t * 2.0**1000 for t in grads]
    expected = float(torch.linalg.vector_norm(torch.cat(up), p)) * 2.0**-1000
    total = float(get_total_norm(grads, p, foreach=foreach))
    # The total is a float64 subnormal too: it holds it to one unit in its last place.
    assert abs(total - expected) <= 1e-6 * expected + 2.0**-1074
