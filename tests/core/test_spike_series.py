"""``SpikeDetectors`` (many series in tensors) against one ``SpikeDetector`` per series.

The monitor judges its 1,000 groups with ``SpikeDetectors``; the contract is
that every decision, z-score, limit and piece of state is the scalar rule's
bit for bit, whatever the series: warm-up, NaN and inf, zeros, huge and tiny
norms, series that start late or skip steps.
"""

from __future__ import annotations

import math
import random
import struct
import sys
from fractions import Fraction
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradclip_cli.core import spikes
from gradclip_cli.core.spikes import (
    SpikeDetector,
    SpikeDetectors,
    _fsum_columns,
    _python_squares,
    fsum,
)

from .spike_reference import reference


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def same(a: float | None, b: float) -> bool:
    """``a`` (the scalar's, None when not judged) is ``b`` bit for bit (NaN for None)."""
    return bits(math.nan if a is None else a) == bits(b) or (
        (a is None or math.isnan(a)) and math.isnan(b)
    )


def check_against_scalar(steps, z=2.5, alpha=0.97, warmup=25, scores=True, threshold=None):
    """Run both on ``steps``: a list of {series: value} per step; compare everything.
    ``threshold``: each step's z to exceed (the groups', given at each update), if not ``z``.

    With ``scores=False`` (decisions only: z and limit given for spikes) the
    state is compared at the end, reading it settles what was put off.
    """
    count = 1 + max((k for step in steps for k in step), default=0)
    scalar = [SpikeDetector(z, alpha, warmup) for _ in range(count)]
    vector = SpikeDetectors(z, alpha, warmup)
    vector.add(count)
    for t, step in enumerate(steps):
        order = sorted(step)
        values = [step[k] for k in order]
        every = order == list(range(count))
        got = vector.update(
            torch.tensor(values, dtype=torch.float64),
            None if every else torch.tensor(order, dtype=torch.int64),
            scores=scores,
            threshold=threshold,
        )
        for i, (k, x) in enumerate(zip(order, values)):
            want = scalar[k].update(x, threshold)
            where = (t, k, x)
            assert bool(got.spike[i]) == want.spike, where
            assert bool(got.judged[i]) == (want.z is not None), where
            assert bool(got.nonfinite[i]) == want.nonfinite, where
            if scores or want.spike:
                assert same(want.z, float(got.z[i])), (where, want.z, float(got.z[i]))
                assert same(want.limit, float(got.limit[i])), (where, want.limit)
        if scores or t == len(steps) - 1:
            check_state(scalar, vector, t)


def check_state(scalar, vector, t):
    """Every series' counts, mean, spread and warm-up points, bit for bit."""
    for k, d in enumerate(scalar):
        assert int(vector.seen[k]) == d.seen and int(vector.accepted[k]) == d.accepted
        assert same(d.mean, float(vector.mean[k])), (t, k, d.mean, float(vector.mean[k]))
        assert same(d.spread, float(vector.spread[k])), (t, k, d.spread)
        again = vector.detector(k)
        assert again._seed == d._seed, (t, k)


norms = st.one_of(
    st.floats(min_value=0.0, max_value=1e6),
    st.floats(min_value=0.0, max_value=1.0),
    st.sampled_from([0.0, math.nan, math.inf, -math.inf, 1e-300, 5e-324, 1e154, 1e300, 1.0]),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(norms, min_size=3, max_size=3), min_size=1, max_size=40),
    st.sampled_from([1, 2, 5, 25]),
    st.sampled_from([1.5, 2.5]),
    st.booleans(),
)
def test_every_series_is_judged_as_its_own_detector_would(rows, warmup, z, scores):
    check_against_scalar([dict(enumerate(r)) for r in rows], z=z, warmup=warmup, scores=scores)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(norms, min_size=3, max_size=3), min_size=1, max_size=40),
    st.sampled_from([1, 5, 25]),
    st.sampled_from([2.0, 3.0253, 4.369]),
    st.booleans(),
)
def test_a_threshold_given_at_each_update_is_judged_as_the_scalar_rule_judges_it(
    rows, warmup, threshold, scores
):
    # The groups' threshold (group_threshold) is given at each update, not built in.
    check_against_scalar([dict(enumerate(r)) for r in rows], warmup=warmup, scores=scores,
                         threshold=threshold)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.dictionaries(st.integers(0, 4), norms, max_size=5), min_size=1, max_size=40))
def test_series_that_skip_steps_or_start_late_keep_their_own_history(steps):
    check_against_scalar(steps, warmup=4)
    check_against_scalar(steps, warmup=4, scores=False)


def test_many_real_looking_series_through_warmup_and_after():
    # Norm-like noise with injected spikes over 200 series: the warm-up sums
    # meet exact ties and near-midpoint squares by the hundred.
    rng = random.Random(7)
    base = [rng.uniform(0.01, 10) for _ in range(200)]
    steps = []
    for t in range(60):
        step = {
            k: b * rng.lognormvariate(0, 0.3) * (10 if rng.random() < 0.02 else 1)
            for k, b in enumerate(base)
        }
        step[3] = 0.0  # a layer whose gradient is always zero
        if t == 20:
            step[4] = math.nan
        steps.append(step)
    check_against_scalar(steps)
    check_against_scalar(steps, warmup=7, alpha=0.9)
    check_against_scalar(steps, scores=False)  # the monitor's way: decisions only
    check_against_scalar(steps[:20], scores=False)  # its state read mid-warm-up


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 12), min_size=3, max_size=3),
    st.lists(st.lists(norms, min_size=3, max_size=3), min_size=1, max_size=30),
    st.sampled_from([1, 4, 25]),
    st.booleans(),
)
def test_series_led_by_zeros_are_judged_as_their_own_detectors_would(zeros, rows, warmup, scores):
    # Each series starts with its own run of exact zeros, then any points (tiny,
    # zero, non-finite among them): bit for bit, with every series at every step
    # (in step while the counts agree) and with series that start late.
    every = [{k: 0.0 if t < zeros[k] else rows[t][k] for k in range(3)}
             for t in range(len(rows))]
    check_against_scalar(every, warmup=warmup, scores=scores)
    lead = max(zeros)
    late = [{k: 0.0 for k in range(3) if t >= lead - zeros[k]} for t in range(lead)]
    check_against_scalar(late + [dict(enumerate(r)) for r in rows], warmup=warmup, scores=scores)


def test_series_whose_first_points_are_zero_start_their_history_at_their_first_nonzero():
    # Layers whose gradient is exact zeros for their first steps (an MoE expert no token
    # reached, a gated branch): each starts at its own step, some never; the tensors
    # judge each as its own detector, in step and out of it, during warm-up and after.
    rng = random.Random(11)
    starts = [0, 1, 4, 5, 6, 12, 30, 31, 70, None]
    steps = []
    for t in range(80):
        step = {}
        for k, start in enumerate(starts):
            on = start is not None and t >= start
            step[k] = (1 + k) * rng.lognormvariate(0, 0.3) if on else 0.0
        if t in (3, 40):
            step[7] = math.nan
        if t == 50:
            step[5] *= 20  # a real spike, after a zero start
        steps.append(step)
    for warmup in (1, 7, 25):
        check_against_scalar(steps, warmup=warmup)
        check_against_scalar(steps, warmup=warmup, scores=False)
    check_against_scalar(steps[:20], scores=False)  # state read mid-warm-up
    check_series_against_scalar(steps, few=4, warmup=7)
    # And against the rule as written (tests/core/spike_reference.py).
    every = SpikeDetectors()
    every.add(len(starts))
    got = [every.update(torch.tensor([s[k] for k in range(len(starts))], dtype=torch.float64))
           for s in steps]
    for k in range(len(starts)):
        want = reference([s[k] for s in steps])
        for t, (j, (score, spike, limit)) in enumerate(zip(got, want)):
            assert bool(j.spike[k]) == spike and bool(j.judged[k]) == (score is not None), (t, k)
            if score is not None:
                assert float(j.z[k]) == pytest.approx(score, rel=1e-9, abs=1e-9), (t, k)
                assert float(j.limit[k]) == pytest.approx(limit, rel=1e-9), (t, k)
    assert [(t, k) for t, j in enumerate(got) for k in j.spike.nonzero().flatten().tolist()] == [
        (50, 5)
    ]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-1e300, max_value=1e300), min_size=1, max_size=30))
def test_the_warm_up_sum_is_fsum(values):
    column = torch.tensor(values, dtype=torch.float64)[:, None]
    assert bits(float(_fsum_columns(column)[0])) == bits(math.fsum(values))


def test_the_warm_up_sum_is_fsum_at_ties():
    # 1 + 2**-53 is a tie between 1 and its neighbour: fsum rounds it to even.
    for values in (
        [1.0, 2.0**-53],
        [1.0, 2.0**-53, 2.0**-106],
        [1.0 + 2.0**-52, 2.0**-53],
        [0.1] * 10,
        [1e16, 1.0, -1e16],
        [0.0, -0.0],
    ):
        column = torch.tensor(values, dtype=torch.float64)[:, None]
        assert bits(float(_fsum_columns(column)[0])) == bits(math.fsum(values)), values


def test_squares_are_pythons_even_where_pow_is_not_r_times_r():
    rng = random.Random(3)
    values = [rng.uniform(-1, 1) for _ in range(200_000)] + [0.0, -0.0, 1.0, -1.0, 1e-200]
    differ = [v for v in values if v**2 != v * v]
    got = _python_squares(torch.tensor(values, dtype=torch.float64)).tolist()
    assert [bits(g) for g in got] == [bits(v**2) for v in values]
    # On a C library whose pow is correctly rounded there is nothing to catch here.
    assert len(differ) < len(values) / 100


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0.0, max_value=1e300), st.integers(1, 30))
def test_the_warm_up_sum_of_equal_norms_is_fsum(value, n):
    # A steady series: n equal terms, where most sums end in an exact tie;
    # settled by the second tree (none left to math.fsum) and by math.fsum.
    values = [value / n] * n
    column = torch.tensor(values, dtype=torch.float64)[:, None]
    for few in (0, spikes._FEW_IN_DOUBT):
        with mock.patch.object(spikes, "_FEW_IN_DOUBT", few):
            assert bits(float(_fsum_columns(column)[0])) == bits(math.fsum(values))


def test_many_sums_in_doubt_at_once_are_fsum():
    # 1 + k 2**-52 (k odd) plus 1 is an exact tie; a tiny third term can tip it.
    rng = random.Random(5)
    columns = []
    for _ in range(400):
        k = 2 * rng.randrange(1 << 20) + 1
        tip = rng.choice([0.0, 2.0**-60, 2.0**-53 * 3, 1e-300])
        columns.append([1 + k * 2.0**-52, 1.0, tip, rng.choice([0.0, 0.25])])
    terms = torch.tensor(columns, dtype=torch.float64).T.contiguous()
    with mock.patch.object(spikes, "_two_sums", wraps=spikes._two_sums) as tree:
        got = _fsum_columns(terms).tolist()
        trees = tree.call_count
    assert [bits(g) for g in got] == [bits(math.fsum(c)) for c in columns]
    assert trees == 2  # more in doubt than math.fsum is asked for: the second pass ran


def test_a_steady_series_is_judged_as_its_own_detector_would():
    check_against_scalar([{k: 0.1 * (k + 1) for k in range(200)}] * 40)
    check_against_scalar([{k: 0.1 * (k + 1) for k in range(200)}] * 40, scores=False)


def test_sums_in_another_order_than_cumsums_are_still_fsum():
    # Should torch's cumsum ever add in another order, the pairwise tree sums.
    rng = random.Random(9)
    terms = torch.tensor(
        [[rng.uniform(0, 1) for _ in range(300)] for _ in range(13)], dtype=torch.float64
    )
    terms[:, :150] = terms[:, :1]  # half of them steady: exact ties
    columns = terms.T.tolist()
    real = torch.cumsum
    with mock.patch.object(spikes.torch, "cumsum", lambda x, dim: real(x.flip(dim), dim).flip(dim)):
        got = _fsum_columns(terms).tolist()
    assert [bits(g) for g in got] == [bits(math.fsum(c)) for c in columns]


def test_points_at_the_threshold_are_decided_as_the_scalar_rule_decides():
    # Each series' sixth point at its limit, or one float either side of it:
    # z within rounding of the threshold, where only the exact rule can decide.
    rng = random.Random(4)
    history = [[rng.uniform(0.5, 2.0) for _ in range(200)] for _ in range(5)]
    probes = []
    for k in range(200):
        d = SpikeDetector()
        for row in history:
            d.update(row[k])
        limit = d.mean + d.threshold * d.std()
        probes.append(
            math.nextafter(limit, (-math.inf, 0.0, math.inf)[k % 3]) if k % 3 != 1 else limit
        )
    steps = [dict(enumerate(row)) for row in history] + [dict(enumerate(probes))]
    steps += [dict(enumerate(row)) for row in history]
    check_against_scalar(steps, scores=False)
    check_against_scalar(steps)


def check_series_against_scalar(steps, few, warmup=4):
    """``SpikeSeries`` with ``few`` on ``steps`` (a list of {series: value} per step,
    series numbered as they first appear), against one ``SpikeDetector`` each."""
    scalar: list[SpikeDetector] = []
    rule = spikes.SpikeSeries(warmup=warmup, few=few)
    for t, step in enumerate(steps):
        count = 1 + max(step, default=-1)
        if count > len(rule):
            rule.add(count - len(rule))
            scalar += [SpikeDetector(warmup=warmup) for _ in range(count - len(scalar))]
        order = sorted(step)
        every = order == list(range(len(rule)))
        series = None if every else order
        rows = None if series is None or t % 2 else torch.tensor(order, dtype=torch.int64)
        x = torch.tensor([step[k] for k in order], dtype=torch.float64)
        # As the monitor judges its groups: against the threshold for as many at once.
        threshold = spikes.group_threshold(spikes.DEFAULT_Z, len(order))
        got, settled = rule.spikes(x, series, rows, threshold)
        want, want_settled = [], False
        for i, k in enumerate(order):
            earlier = scalar[k].seen
            if scalar[k].update(step[k], threshold).spike:
                want.append(i)
                want_settled = want_settled or earlier >= warmup
        assert (got, settled) == (want, want_settled), (t, step)
    assert (rule.many is None) == (len(rule) <= few)
    if rule.many is not None:
        check_state(scalar, rule.many, len(steps))


growing_steps = st.lists(
    st.dictionaries(st.integers(0, 7), norms, max_size=8), min_size=1, max_size=40
)


@settings(max_examples=40, deadline=None)
@given(growing_steps, st.sampled_from([0, 2, 5, 100]))
def test_series_are_decided_as_their_detectors_whether_few_many_or_moving(steps, few):
    check_series_against_scalar(steps, few, warmup=7)  # spikes before and after warmup


def test_series_move_into_tensors_mid_warm_up_and_after_it_keeping_their_history():
    # Series appear over time: the first three past their warm-up, the next in
    # the middle of theirs when the eighth arrives and all move into tensors;
    # series 4 and 6 spike before their warm-up ends (not settled), 1 and 7 after.
    rng = random.Random(3)
    steps = []
    spiked = {(25, 1), (27, 4), (36, 6), (45, 7)}
    for t in range(60):
        live = 3 if t < 20 else 6 if t < 30 else 8
        step = {k: rng.lognormvariate(0, 0.2) * (10 if (t, k) in spiked else 1)
                for k in range(live)}
        if t == 33:
            step[2] = math.nan
        steps.append(step)
    check_series_against_scalar(steps, few=6, warmup=8)


def test_tensors_made_of_detectors_hold_their_state_and_go_on_as_they_would():
    rng = random.Random(5)
    detectors = [SpikeDetector(warmup=6) for _ in range(5)]
    for t in range(12):  # series 0 past the warm-up, the others at 11, 8, 3 and 0 points
        for k, d in enumerate(detectors):
            if t < (12, 11, 8, 3, 0)[k]:
                d.update(rng.uniform(1, 2) if t != 4 else math.inf)
    many = SpikeDetectors.of(detectors)
    check_state(detectors, many, -1)
    for t in range(10):
        x = [rng.uniform(1, 2) * (20 if t == 7 else 1) for _ in detectors]
        got = many.update(torch.tensor(x, dtype=torch.float64))
        for k, d in enumerate(detectors):
            want = d.update(x[k])
            assert bool(got.spike[k]) == want.spike and same(want.z, float(got.z[k])), (t, k)
    check_state(detectors, many, 10)


def test_the_timing_benchmark_steps_both_ways_to_the_same_decisions():
    # benchmarks/spike_series_bench.py times floats against tensors; it checks
    # at every step that both decided alike, which this runs once each side
    # of FEW_SERIES.
    import time

    from benchmarks import spike_series_bench

    for count in (3, spikes.FEW_SERIES + 1):
        seconds = spike_series_bench.one_run(count, 0, time.perf_counter)
        assert {k: len(v) for k, v in seconds.items()} == {
            "floats": spike_series_bench.STEPS, "tensors": spike_series_bench.STEPS}


def _rounded(exact: Fraction) -> float:
    """An exact value rounded to float64 as IEEE does: past float's largest by half its
    last place (2**970) or more, inf."""
    return math.inf if exact >= Fraction(sys.float_info.max) + 2**970 else float(exact)


def test_sums_near_floats_largest_round_as_ieee_where_math_fsum_raises():
    # math.fsum raises "intermediate overflow" on sums near float's largest; the
    # warm-up mean and spread then take IEEE's rounding of the exact sum, which is inf
    # past float's largest, in the scalar detector and the many-series one alike.
    top = sys.float_info.max
    with pytest.raises(OverflowError):
        math.fsum([top / 3] * 3)
    for terms in ([top / 3] * 3, [top / 3, top / 3, 1.0, -1.0], [top, top], [top, -top, top],
                  [top / 2, top / 4, top / 8, top / 8]):
        assert fsum(terms) == _rounded(sum(map(Fraction, terms))), terms
    detector = SpikeDetector(2.5, 0.97, 3)
    for _ in range(3):
        detector.update(top)
    assert detector.mean == _rounded(Fraction(top / 3) * 3)
    check_against_scalar([{0: top, 1: 1.0}] * 3 + [{0: top / 3, 1: 2.0}] * 4, warmup=3)
    check_against_scalar([{0: top, 1: top / 3, 2: 1e300}] * 6, warmup=3, scores=False)
