"""The drop-ins' and the monitor's CPU 2-norm kernel (kernels.squares_on_cpu).

Judged against float64 (tests/core/reference.py) where a float32 lane sum is
at its worst: equal values, where every rounding of a long lane falls the
same way (torch's whole-tensor fp32 norm of 4,096 values 0.1 is 2.2e-6 off), and
one large element first, which every later rounding carries.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradclip_cli.core import tensor_power_sums, total_power_sums
from gradclip_cli.core.kernels import CHUNK, LANES, ROW, SMALL, squares_on_cpu
from gradclip_cli.core.norms import certified_group_norms, certified_group_norms_on_device

from .reference import norm, rel_err

TOL = 1e-6
# kernels.ROW's bound: ((ROW / L + L - 1) / 2 + 1) * 2**-24 for the lane counts it is chosen for.
BOUND = ((ROW // LANES + LANES - 1) / 2 + 1) * 2.0**-24
assert BOUND <= 1e-6
SIZES = [1, ROW - 1, ROW, ROW + 1, 4096, SMALL - 1, SMALL, SMALL + ROW + 3, 3 * CHUNK + 5]


def _norms(tensors):
    return tensor_power_sums(tensors, 2.0, with_max=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", SIZES)
def test_equal_values_are_accurate_at_every_size(n, dtype):
    for value in (0.1, 1.0 / 3.0, 7.0):
        t = torch.full((n,), value, dtype=dtype)
        got = _norms([t])
        assert rel_err(float(got.norm[0]), norm([t], 2)) <= BOUND
        assert rel_err(float(got.total().norm[0]), norm([t], 2)) <= TOL


@pytest.mark.parametrize("n", [4096, SMALL + ROW, CHUNK])
def test_a_large_first_element_is_carried_accurately(n):
    t = torch.full((n,), 1e-3)
    t.view(-1, ROW)[:, 0] = 1.0  # the first element of every row dominates it
    assert rel_err(float(_norms([t]).norm[0]), norm([t], 2)) <= BOUND


def test_small_tensors_of_several_shapes_and_blocks_keep_input_order():
    # Padding inside rows, 2-D and 0-d shapes, more than one block, big ones between.
    g = torch.Generator().manual_seed(1)
    shapes = [(3, 5), (ROW + 7,), (), (40, 40), (SMALL + 9,), (1,), (7, 3, 2)] * 40
    ts = [torch.randn(s, generator=g) * 10.0 ** (i % 7 - 3) for i, s in enumerate(shapes)]
    got = _norms(ts)
    assert [rel_err(x, norm([t], 2)) <= TOL for x, t in zip(got.norm.tolist(), ts)] == [True] * len(
        ts
    )
    assert rel_err(float(got.total().norm[0]), norm(ts, 2)) <= TOL


def test_runs_of_one_shape_are_stacked_beside_single_copies():
    # Runs of a shape that fills whole rows (stacked at once) between odd
    # shapes (copied one by one, padded), crossing block boundaries.
    g = torch.Generator().manual_seed(3)
    shapes = ([(4, ROW)] * 5 + [(ROW + 3,)] + [(2, ROW // 2)] * 3 + [(7,)]) * 40 + [(ROW,)] * 300
    ts = [torch.randn(s, generator=g) * 10.0 ** (i % 5 - 2) for i, s in enumerate(shapes)]
    for _ in range(2):  # the second call reuses the packing built by the first
        got = _norms(ts)
        assert got.norm.tolist() == pytest.approx([norm([t], 2) for t in ts], rel=TOL)
        assert rel_err(float(got.total().norm[0]), norm(ts, 2)) <= TOL


def test_padding_holds_no_other_block_values():
    # Two blocks: the second one's padding is where the first one's values were.
    per_block = CHUNK // (2 * ROW)
    ts = [torch.full((2 * ROW,), 1e3) for _ in range(per_block)] + [torch.ones(ROW + 1)] * 5
    for _ in range(2):
        got = _norms(ts)
        assert got.norm.tolist() == pytest.approx([norm([t], 2) for t in ts], rel=TOL)


def test_strided_tensors_are_read_as_they_are():
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(50, 30, generator=g).t(), torch.randn(400, 300, generator=g).t()[::2]]
    got = _norms(ts)
    for x, t in zip(got.norm.tolist(), ts):
        assert rel_err(x, norm([t], 2)) <= TOL


def test_sums_that_overflow_or_underflow_float32_are_recomputed():
    # 1e25 squared overflows float32, 1e-30 squared underflows it: both are
    # recomputed exactly, not reported as inf or 0.
    ts = [torch.full((5000,), 1e25), torch.full((300,), 1e-30), torch.full((SMALL,), 3e-23)]
    got = _norms(ts)
    for x, t in zip(got.norm.tolist(), ts):
        assert math.isfinite(x) and rel_err(x, norm([t], 2)) <= TOL


def test_rows_are_one_per_tensor_in_input_order():
    ts = [torch.ones(4), torch.empty(0), torch.full((SMALL,), 2.0)]
    rows = squares_on_cpu(ts)
    assert rows.tensor.tolist() == [0, 1, 2]
    assert rows.max_abs is None
    assert rows.length.tolist() == [4, 0, SMALL]
    # A row's norm is rounded to float32: sqrt(ROW * 4) is exact only where ROW
    # is a power of four (256 with AVX-512, 64 elsewhere; not AVX2's 128).
    two, zero, long = rows.norm.tolist()
    assert (two, zero) == (2.0, 0.0)
    assert rel_err(long, 2.0 * math.sqrt(SMALL)) <= BOUND


@pytest.mark.parametrize(
    "values",
    [
        [1.0, 2.0],  # certified from the sum
        [1e25, 1.0],  # float32 squares overflow: measured again, exactly
        [1e-30, 1e-31],  # the sum is below its underflow budget: measured again
    ],
)
def test_the_certified_total_matches_float64(values):
    ts = [torch.full((n,), v) for n, v in zip((5000, SMALL + 3), values)]
    got = float(total_power_sums(ts, 2.0).norm[0])
    assert rel_err(got, norm(ts, 2)) <= TOL


def test_the_certified_total_propagates_nan_then_inf_as_torch():
    a, b = torch.ones(100), torch.ones(SMALL)
    a[3] = math.inf
    assert float(total_power_sums([a, b], 2.0).norm[0]) == math.inf
    b[5] = math.nan
    assert math.isnan(float(total_power_sums([a, b], 2.0).norm[0]))


# certified_group_norms: the monitor's CPU step, groups certified from their own sums.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_certified_groups_match_float64(dtype):
    g = torch.Generator().manual_seed(3)
    sizes = [4096, 17, SMALL + ROW + 3, 1, ROW * 3, 0, 5000]
    ts = [torch.randn(n, generator=g, dtype=dtype) * 10.0 ** (i - 3) for i, n in enumerate(sizes)]
    ts[1].fill_(0.1)  # equal values: a lane sum at its worst
    index = torch.tensor([0, 0, 1, 2, 1, 2, 0])
    groups, total = certified_group_norms(ts, index, 3)
    for k in range(3):
        members = [t for t, i in zip(ts, index.tolist()) if i == k]
        assert rel_err(float(groups.norm[k]), norm(members, 2)) <= TOL
    assert rel_err(float(total.norm[0]), norm(ts, 2)) <= TOL
    assert total.nonfinite.tolist() == [0] and groups.nonfinite.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "spoil",
    [
        lambda t: t.fill_(0.0),  # a group of zeros: nothing to certify
        lambda t: t.fill_(1e-30),  # its squares underflow in float32
        lambda t: t.__setitem__(3, math.nan),
        lambda t: t.__setitem__(0, -math.inf),
        lambda t: t.fill_(3e38),  # finite, but its float32 squares overflow
    ],
)
def test_certified_groups_refuse_what_needs_an_exact_measure(spoil):
    ts = [torch.ones(300), torch.ones(4096)]
    spoil(ts[1])
    assert certified_group_norms(ts, torch.tensor([0, 1]), 2) is None
    # The exact path the monitor then takes gets them right.
    sums = tensor_power_sums(ts, 2.0, with_max=False)
    got = float(sums.total().norm[0])
    # float64 over the elements; NaN and inf propagated as torch propagates them.
    want = float(torch.linalg.vector_norm(torch.cat(ts).double()))
    if math.isnan(want):
        assert math.isnan(got)
    elif math.isinf(want) or want == 0:
        assert got == want
    else:
        assert rel_err(got, want) <= TOL


def test_the_same_sizes_in_other_shapes_have_their_own_packing():
    # 1-D tensors are packed by their sizes alone; 2-D ones of the same sizes,
    # and 1-D ones again, each get the packing of their own shapes.
    g = torch.Generator().manual_seed(4)
    lists = [
        [torch.randn(2 * ROW, generator=g) for _ in range(30)],
        [torch.randn(2, ROW, generator=g) for _ in range(30)],
        [torch.randn(ROW, 2, generator=g) for _ in range(30)],
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a packing of other shapes would resize its places
        for ts in lists + lists:
            got = _norms(ts)
            assert got.norm.tolist() == pytest.approx([norm([t], 2) for t in ts], rel=TOL)


# certified_group_norms_on_device: the monitor's step on an accelerator. Run here
# on the CPU, where torch has no fused _foreach kernels (one vector_norm per
# tensor, in float64, as on such a device), and on CUDA when there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# float64 sums of a few thousand squares, a square root and a square again.
DEVICE_TOL = 1e-12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_certified_groups_on_device_match_float64_at_each_dtypes_limits(dtype, device):
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(5)
    sizes = [4096, 17, 1, 0, 3000, 5, 257]
    ts = [torch.rand(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
    ts[0].fill_(0.1)  # equal values
    ts[1].fill_(info.max)  # their squares overflow the dtype, not float64
    ts[2].fill_(info.smallest_normal * 2.0**-3)  # a subnormal: its square underflows the dtype
    ts[4].zero_()  # a group of zeros: 0, exactly
    ts[6].mul_(info.smallest_normal)  # normals and subnormals near the bottom
    ts = [t.to(device) for t in ts]
    index = torch.tensor([0, 1, 2, 3, 3, 2, 4])
    groups, total = certified_group_norms_on_device(ts, index, 5)
    for k in range(5):
        members = [t for t, i in zip(ts, index.tolist()) if i == k]
        assert rel_err(float(groups.norm[k]), norm(members, 2)) <= DEVICE_TOL, k
    assert float(groups.norm[3]) == 0.0
    assert rel_err(float(total.norm[0]), norm(ts, 2)) <= DEVICE_TOL
    assert total.nonfinite.tolist() == [0] and groups.nonfinite.tolist() == [0] * 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_certified_groups_on_device_leave_nan_and_inf_to_the_exact_path(bad, device):
    ts = [torch.ones(300, dtype=torch.bfloat16, device=device),
          torch.ones(64, dtype=torch.bfloat16, device=device)]
    ts[1][7] = bad
    assert certified_group_norms_on_device(ts, torch.tensor([0, 1]), 2) is None
