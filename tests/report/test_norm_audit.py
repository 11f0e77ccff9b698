"""The norm audit's rule (``report/norm_audit.py``): the stored dtype, the tolerance it gives,
and which steps disagree. References: torch's own totals in each dtype against a float64
sum of squares of the same values."""

from __future__ import annotations

import math

import pytest
import torch

from gradclip_cli.report.norm_audit import (
    NormSeries,
    audit_norms,
    relative_difference,
    stored_precision,
    tolerance,
)


def f64_norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def grads(dtype, sizes, seed=0, top=2):
    """Normal values over five decades, the largest tensor's up to ``10**top``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 10.0 ** (i % 5 - 4 + top)).to(dtype)
            for i, n in enumerate(sizes)]


@pytest.mark.parametrize("dtype, name", [(torch.float32, "float32"), (torch.float64, "float64"),
                                         (torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_the_stored_dtype_is_read_from_torchs_own_totals(dtype, name):
    totals = [float(torch.nn.utils.get_total_norm(grads(dtype, [100, 37, 5], seed)))
              for seed in range(20)]
    assert torch.tensor(totals[0]).dtype == torch.float32  # a Python float is a float64
    assert stored_precision(totals) == name


def test_the_widest_value_decides_and_non_finite_values_say_nothing():
    assert stored_precision([1.0, 0.1]) == "float64"  # 0.1 is no float32
    assert stored_precision([1.0, float(torch.tensor(0.1))]) == "float32"
    assert stored_precision([math.nan, math.inf]) == "float32"
    assert stored_precision([]) == "float32"
    assert stored_precision([1e300]) == "float64"  # beyond float32's range


def test_the_tolerance_is_four_roundings_and_a_chain_of_additions():
    assert tolerance("float32") == 4 * 2.0**-24 + 2.0**16 * 2.0**-24
    assert tolerance("bfloat16") == 4 * 2.0**-8 + 2.0**16 * 2.0**-24
    assert tolerance("float16") == 4 * 2.0**-11 + 2.0**16 * 2.0**-24
    assert tolerance("float64") == 4 * 2.0**-53 + 2.0**16 * 2.0**-53
    assert 3.9e-3 < tolerance("float32") < 3.91e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_torchs_total_in_each_dtype_is_within_the_tolerance_of_its_stored_dtype(dtype, threads):
    # Sizes from one element to 2**22, magnitudes over five decades: torch's total as a
    # framework logs it, against the float64 norm of the very values it summed. On one
    # thread torch's CPU norm adds all 2**22 squares in one float32 chain (1.0e-4 off).
    # (float16's total of these stays below its largest value, 65504: see the next test.)
    sizes = [1, 3, 1000, 2**16 + 7, 2**22]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(3):
            tensors = grads(dtype, sizes, seed, top=0 if dtype == torch.float16 else 2)
            total = float(torch.nn.utils.get_total_norm(tensors))
            error = relative_difference(total, f64_norm(tensors))
            assert error <= tolerance(stored_precision([total])), (seed, error)
    finally:
        torch.set_num_threads(before)


def test_a_float16_total_that_overflowed_is_a_disagreement():
    # torch sums float16 squares in float32 but returns the total in float16: past
    # 65504 it is inf, while the gradients (and gradclip's norm of them) are finite.
    tensors = [torch.full((2**16,), 300.0, dtype=torch.float16)]  # norm 76,800
    logged = float(torch.nn.utils.get_total_norm(tensors))
    assert logged == math.inf
    audit = audit_norms(NormSeries("a", "k", {7: logged}),
                        NormSeries("b", "k", {7: f64_norm(tensors)}))
    [d] = audit.disagreements
    assert (d.step, d.framework, d.relative) == (7, math.inf, math.inf)


def test_a_norm_over_half_the_parameters_is_found_at_every_step():
    steps = range(10)
    whole, half = {}, {}
    for step in steps:
        tensors = grads(torch.float32, [64, 64, 64, 64], seed=step)
        whole[step] = f64_norm(tensors)
        half[step] = float(torch.nn.utils.get_total_norm(tensors[:2]))
    audit = audit_norms(NormSeries("state", "Trainer grad_norm", half),
                        NormSeries("log", "gradclip monitor log", whole))
    assert audit.precision == "float32" and audit.compared == tuple(steps)
    assert [d.step for d in audit.disagreements] == list(steps)
    for d in audit.disagreements:
        assert (d.framework, d.gradclip) == (half[d.step], whole[d.step])
        assert math.isclose(d.relative, 1 - half[d.step] / whole[d.step], rel_tol=1e-12)
    assert audit.largest.relative == max(d.relative for d in audit.disagreements)


def test_float32_rounding_of_the_same_norms_agrees():
    whole = {s: f64_norm(grads(torch.float32, [500, 20], seed=s)) for s in range(10)}
    rounded = {s: float(torch.tensor(v, dtype=torch.float32)) for s, v in whole.items()}
    audit = audit_norms(NormSeries("a", "k", rounded), NormSeries("b", "k", whole))
    assert audit.agrees and audit.largest is None


def test_a_gap_just_beyond_the_tolerance_is_found_and_one_within_is_not():
    limit = tolerance("float32")
    logged = {1: float(torch.tensor(1.0 - 2 * limit, dtype=torch.float32)),
              2: float(torch.tensor(1.0 - limit / 4, dtype=torch.float32))}
    audit = audit_norms(NormSeries("a", "k", logged), NormSeries("b", "k", {1: 1.0, 2: 1.0}))
    assert [d.step for d in audit.disagreements] == [1]


def test_non_finite_values_agree_only_with_themselves():
    fw = {1: math.nan, 2: math.inf, 3: math.nan, 4: 1.0}
    gc = {1: math.nan, 2: math.inf, 3: 1.0, 4: math.inf}
    audit = audit_norms(NormSeries("a", "k", fw), NormSeries("b", "k", gc))
    assert [(d.step, d.relative) for d in audit.disagreements] == [(3, math.inf), (4, math.inf)]


def test_zero_and_subnormal_totals_agree():
    fw = {1: 0.0, 2: 1e-45}
    gc = {1: 0.0, 2: 0.0}
    assert audit_norms(NormSeries("a", "k", fw), NormSeries("b", "k", gc)).agrees


def test_series_without_a_common_step_are_not_audited():
    assert audit_norms(NormSeries("a", "k", {1: 1.0}), NormSeries("b", "k", {2: 1.0})) is None
    assert audit_norms(NormSeries("a", "k", {}), NormSeries("b", "k", {2: 1.0})) is None


def test_a_total_of_the_gradients_gradclip_clipped_agrees_and_is_named():
    """At a step gradclip scaled (total 300, clip_coef 0.01: left at 3.0), a framework
    total of the clipped gradients (3.0 in float32) is the same gradients measured later;
    one of neither the gradients before nor after the clip is still a disagreement, and a
    step gradclip did not scale is judged against its total alone."""
    clipped = float(torch.tensor(300.0 * 0.01, dtype=torch.float32))
    fw = {1: 1.0, 2: clipped, 3: 2.0, 4: 3.0}
    gc = NormSeries("b", "k", {1: 1.0, 2: 300.0, 3: 300.0, 4: 30.0},
                    scaled={2: 300.0 * 0.01, 3: 300.0 * 0.01})
    audit = audit_norms(NormSeries("a", "k", fw), gc)
    assert audit.after_clip == (2,)
    assert [d.step for d in audit.disagreements] == [3, 4]
