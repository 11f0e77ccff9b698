"""The norm core against float64 references, over dtypes, sizes and magnitudes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradclip_cli.core import tensor_power_sums
from gradclip_cli.core.kernels import CHUNK, SMALL

from .reference import max_abs, norm, rel_err

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NORMS = [0.5, 1.0, 2.0, 3.0, math.inf]
TOL = 1e-6

# log10 of the largest magnitude an element may have, per dtype, leaving room
# for the lognormal tail below so no element overflows the dtype itself.
MAG_RANGE = {
    torch.float16: (-7.0, 3.5),
    torch.bfloat16: (-38.0, 36.0),
    torch.float32: (-44.0, 36.0),
    torch.float64: (-300.0, 300.0),
}


def make(sizes, dtype, log10_mag, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        x = torch.randn(n, generator=g, dtype=torch.float64)
        x = x * torch.randn(n, generator=g, dtype=torch.float64).exp() * 10.0**log10_mag
        limit = torch.finfo(dtype).max / 2  # finite inputs: the tail must not overflow
        out.append(x.clamp(-limit, limit).to(dtype))
    return out


@st.composite
def gradients(draw, dtypes=DTYPES):
    dtype = draw(st.sampled_from(dtypes))
    lo, hi = MAG_RANGE[dtype]
    log10_mag = draw(st.floats(lo, hi))
    sizes = draw(st.lists(
        st.one_of(st.integers(0, 40), st.integers(4094, 4098), st.integers(1, 12288),
                  st.integers(SMALL - 2, SMALL + 2), st.sampled_from([CHUNK, CHUNK + 1])),
        min_size=1, max_size=6,
    ))
    seed = draw(st.integers(0, 2**31 - 1))
    return make(sizes, dtype, log10_mag, seed)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=gradients(dtypes=[torch.float16, torch.bfloat16, torch.float32]),
       p=st.sampled_from(NORMS), foreach=st.sampled_from([None, True]),
       workers=st.sampled_from([1, 2]))
def test_total_and_per_tensor_norms_match_float64(ts, p, foreach, workers):
    sums = tensor_power_sums(ts, p, foreach=foreach, workers=workers)
    assert rel_err(float(sums.total().norm[0]), norm(ts, p)) <= TOL
    for t, got in zip(ts, sums.norm.tolist()):
        assert rel_err(got, norm([t], p)) <= TOL
    assert sums.max_abs.tolist() == [max_abs([t]) for t in ts]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log10_mag=st.floats(-300, 300), p=st.sampled_from(NORMS),
       sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=3),
       seed=st.integers(0, 2**31 - 1))
def test_float64_matches_exactly_rounded_reference(log10_mag, p, sizes, seed):
    ts = make(sizes, torch.float64, log10_mag, seed)
    sums = tensor_power_sums(ts, p)
    assert rel_err(float(sums.total().norm[0]), norm(ts, p)) <= 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("edge", ["largest", "smallest_normal", "subnormal"])
def test_magnitudes_at_each_dtypes_limits(dtype, p, edge):
    info = torch.finfo(dtype)
    # "largest": as large as elements can be while the true norm still fits the
    # dtype (for p < 1 the norm exceeds the sum of elements).
    top = {"largest": info.max / 4 / 5008 ** max(1.0, 1.0 / p), "smallest_normal": info.tiny,
           "subnormal": info.tiny * 2.0 ** -(info.bits // 4)}[edge]
    g = torch.Generator().manual_seed(1)
    ts = [(torch.rand(n, generator=g, dtype=torch.float64) * top).to(dtype) for n in (5000, 7, 1)]
    want = norm(ts, p)
    got = float(tensor_power_sums(ts, p).total().norm[0])
    assert math.isfinite(got)
    assert rel_err(got, want) <= TOL


def test_torch_overflows_and_underflows_where_gradclip_does_not():
    big = [torch.full((1000,), 1e20)]
    tiny = [torch.full((1000,), 1e-25)]
    assert torch.nn.utils.get_total_norm(big).isinf()
    assert torch.nn.utils.get_total_norm(tiny) == 0
    assert rel_err(float(tensor_power_sums(big, 2).total().norm[0]), norm(big, 2)) <= TOL
    assert rel_err(float(tensor_power_sums(tiny, 2).total().norm[0]), norm(tiny, 2)) <= TOL


def test_fp16_norm_past_65504_is_finite():
    ts = [torch.full((10000,), 60000.0, dtype=torch.float16)]
    assert torch.linalg.vector_norm(ts[0]).isinf()
    got = float(tensor_power_sums(ts, 2).total().norm[0])
    assert rel_err(got, 60000.0 * 100) <= TOL


def test_large_fp32_tensor_is_accurate_where_torch_drifts():
    # 16M elements: torch's single fp32 reduction drifts by ~1e-4 here.
    x = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0))
    want = norm([x], 2)
    assert rel_err(float(tensor_power_sums([x], 2).total().norm[0]), want) <= TOL


@settings(max_examples=60, deadline=None)
@given(ts=gradients(), data=st.data())
def test_nonfinite_counts_are_exact(ts, data):
    ts = [t for t in ts if t.numel()] or [torch.ones(3)]
    want = []
    for t in ts:
        flat = t.view(-1)
        idx = data.draw(st.lists(st.integers(0, flat.numel() - 1), max_size=5, unique=True))
        kinds = data.draw(st.lists(st.sampled_from(["nan", "inf", "-inf"]),
                                   min_size=len(idx), max_size=len(idx)))
        for i, k in zip(idx, kinds):
            flat[i] = float(k)
        want.append((int(torch.isnan(t).sum()), int(torch.isposinf(t).sum()),
                     int(torch.isneginf(t).sum())))
    sums = tensor_power_sums(ts, 2.0)
    got = list(zip(sums.nan.tolist(), sums.posinf.tolist(), sums.neginf.tolist()))
    assert got == want
    for (nan, pos, neg), n in zip(want, sums.norm.tolist()):
        if nan:
            assert math.isnan(n)
        elif pos or neg:
            assert n == math.inf
        else:
            assert math.isfinite(n)


def test_mixed_dtypes_keep_input_order():
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(10, generator=g).to(d) for d in (torch.float16, torch.float64,
                                                         torch.float32, torch.bfloat16)]
    sums = tensor_power_sums(ts, 2)
    for t, got in zip(ts, sums.norm.tolist()):
        assert rel_err(got, norm([t], 2)) <= TOL
    assert rel_err(float(sums.total().norm[0]), norm(ts, 2)) <= TOL


def test_grouped_reduction_equals_direct_total():
    ts = make([100, 5000, 3, 70000], torch.float32, 0.0, 9)
    sums = tensor_power_sums(ts, 2)
    groups = sums.reduce(torch.tensor([0, 1, 0, 1]), 2)
    want = [norm([ts[0], ts[2]], 2), norm([ts[1], ts[3]], 2)]
    for got, w in zip(groups.norm.tolist(), want):
        assert rel_err(got, w) <= TOL
    assert rel_err(float(groups.total().norm[0]), norm(ts, 2)) <= TOL


def test_non_contiguous_and_empty_tensors():
    x = torch.randn(64, 70).t()  # a transposed view
    ts = [x, torch.empty(0), torch.zeros(5)]
    sums = tensor_power_sums(ts, 2)
    assert rel_err(sums.norm[0].item(), norm([x], 2)) <= TOL
    assert sums.norm[1:].tolist() == [0.0, 0.0]


def test_no_tensors_and_bad_norm_type():
    assert len(tensor_power_sums([], 2)) == 0
    with pytest.raises(ValueError):
        tensor_power_sums([torch.ones(2)], 0.0)


def test_batches_and_progress_cover_every_byte():
    ts = make([1000, 2000, 3000], torch.float32, 0.0, 4)
    seen = []
    sums = tensor_power_sums(ts, 2, batch_bytes=5000, on_batch=seen.append)
    assert [t for batch in seen for t in batch] == ts and len(seen) > 1
    assert rel_err(float(sums.total().norm[0]), norm(ts, 2)) <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    ts = make([100000, 77, 4096], dtype, 0.0, 5)
    cpu = tensor_power_sums(ts, 2)
    gpu = tensor_power_sums(ts, 2, device="cuda")
    for a, b in zip(cpu.norm.tolist(), gpu.norm.tolist()):
        assert rel_err(b, a) <= TOL


def test_small_tensors_of_equal_size_but_different_shapes():
    g = torch.Generator().manual_seed(6)
    ts = [torch.randn(32, 32, generator=g), torch.randn(1024, generator=g),
          torch.randn(4, 256, generator=g), torch.randn(64, 16, generator=g).t(),
          torch.randn(32, 32, generator=g)]
    sums = tensor_power_sums(ts, 2, workers=2)
    for t, got in zip(ts, sums.norm.tolist()):
        assert rel_err(got, norm([t], 2)) <= TOL
    assert sums.max_abs.tolist() == [max_abs([t]) for t in ts]


# -- without the max (the drop-ins and the monitor): certified from the sums ----


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=gradients(), p=st.sampled_from([0.5, 1.0, 2.0, 3.0, 8.0]),
       foreach=st.sampled_from([None, True]))
def test_norms_without_the_max_match_float64(ts, p, foreach):
    # float64 with foreach=True and p = 8 take the scaled kernel: every tensor
    # divided by the group's largest |x|, rows far below it recomputed exactly.
    sums = tensor_power_sums(ts, p, foreach=foreach, with_max=False)
    assert rel_err(float(sums.total().norm[0]), norm(ts, p)) <= TOL
    for t, got in zip(ts, sums.norm.tolist()):
        assert rel_err(got, norm([t], p)) <= TOL
    assert sums.nonfinite.tolist() == [0] * len(ts)


@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_far_below_the_group_are_recomputed(foreach, dtype):
    info = torch.finfo(dtype)
    ts = [torch.full((300,), info.max / 100, dtype=dtype), torch.full((5,), info.tiny, dtype=dtype),
          torch.zeros(4, dtype=dtype)]
    for p in (2.0, 8.0):
        sums = tensor_power_sums(ts, p, foreach=foreach, with_max=False)
        for t, got in zip(ts, sums.norm.tolist()):
            assert rel_err(got, norm([t], p)) <= TOL


@settings(max_examples=25, deadline=None)
@given(ts=gradients(), data=st.data(), foreach=st.sampled_from([None, True]))
def test_nonfinite_counts_without_the_max(ts, data, foreach):
    ts = [t for t in ts if t.numel()] or [torch.ones(3)]
    for t in ts:
        flat = t.view(-1)
        for i in data.draw(st.lists(st.integers(0, flat.numel() - 1), max_size=3, unique=True)):
            flat[i] = float(data.draw(st.sampled_from(["nan", "inf", "-inf"])))
    sums = tensor_power_sums(ts, 2.0, foreach=foreach, with_max=False)
    want = [(int(torch.isnan(t).sum()), int(torch.isposinf(t).sum()),
             int(torch.isneginf(t).sum())) for t in ts]
    assert list(zip(sums.nan.tolist(), sums.posinf.tolist(), sums.neginf.tolist())) == want
    for (nan, pos, neg), n, t in zip(want, sums.norm.tolist(), ts):
        if nan:
            assert math.isnan(n)
        elif pos or neg:
            assert n == math.inf
        else:
            assert rel_err(n, norm([t], 2.0)) <= TOL


# -- the accelerator drop-ins' total, on the device, no read (kernels.total_on_device) --
# Device-agnostic: run here on CPU tensors with the fused (foreach) kernels.


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=gradients(), p=st.sampled_from([0.5, 1.0, 2.0, 3.0, 8.0, math.inf]),
       foreach=st.sampled_from([None, False]))
def test_total_on_device_matches_float64(ts, p, foreach):
    from gradclip_cli.core.kernels import total_on_device

    got = total_on_device(ts, p, foreach)
    assert got.dtype == torch.float64 and got.dim() == 0
    want = norm(ts, p)
    if math.isinf(want):  # beyond float64 (float64 inputs near 1e300, p < 1)
        assert math.isinf(float(got))
    else:
        assert rel_err(float(got), want) <= TOL


def test_total_on_device_mixed_dtypes_and_nonfinite():
    from gradclip_cli.core.kernels import total_on_device

    ts = [torch.full((100,), 1e300, dtype=torch.float64), torch.full((10,), 3e38),
          torch.ones(7, dtype=torch.bfloat16), torch.empty(0)]
    for p in (1.0, 2.0, 7.0, math.inf):
        assert rel_err(float(total_on_device(ts, p)), norm(ts, p)) <= TOL
    with_inf = [*ts, torch.tensor([math.inf, 1.0])]
    with_nan = [*with_inf, torch.tensor([math.nan], dtype=torch.float16)]
    for p in (2.0, 8.0, math.inf):
        assert float(total_on_device(with_inf, p)) == math.inf
        assert math.isnan(float(total_on_device(with_nan, p)))
    assert float(total_on_device([torch.empty(0)], 2.0)) == 0.0
    assert float(total_on_device([torch.zeros(3, dtype=torch.float64)], 8.0)) == 0.0
