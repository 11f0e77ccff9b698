"""The spike rule against a plain re-statement of it (docs/reference/spike-rule.md)."""

from __future__ import annotations

import math
import random

import pytest

from gradclip_cli.core.spikes import MIN_RELATIVE_STD, SpikeDetector, group_threshold

from .spike_reference import group_z, reference


def noisy(seed, n=200, spread=0.9):
    """Norm-like noise: positive, right-skewed, between 1 and ``1 + spread``."""
    rng = random.Random(seed)
    return [1.0 + spread * rng.random() ** 3 for _ in range(n)]


@pytest.mark.parametrize("warmup", [1, 3, 25])
@pytest.mark.parametrize("z", [1.5, 2.5])
def test_matches_the_definition_on_noisy_series_with_spikes(warmup, z):
    series = noisy(warmup)
    for at in (40, 41, 90, 150):
        series[at] *= 10
    series[120] = math.nan
    detector = SpikeDetector(z=z, warmup=warmup)
    got = [detector.update(x) for x in series]
    want = reference(series, z=z, warmup=warmup)
    for i, (judged, (score, spike, limit)) in enumerate(zip(got, want)):
        assert judged.spike == spike, i
        assert (judged.z is None) == (score is None) and (judged.limit is None) == (limit is None)
        if score is not None:
            assert judged.z == pytest.approx(score, rel=1e-9, abs=1e-9), i
            assert judged.limit == pytest.approx(limit, rel=1e-9), i
    spikes = [i for i, j in enumerate(got) if j.spike]
    if z == 2.5:  # noise stays below 2.25x the running mean: only the injected points
        assert spikes == [40, 41, 90, 150]
    else:
        assert {40, 41, 90, 150} <= set(spikes)
    assert got[120].nonfinite and not got[120].spike


def test_first_points_are_never_judged():
    detector = SpikeDetector()
    judged = [detector.update(x) for x in [1.0, 1.1, 0.9, 1.0, 1000.0]]
    assert all(j.z is None and not j.spike for j in judged)
    fresh = SpikeDetector()
    for x in [1.0, 1.1, 0.9, 1.0, 1.05]:
        fresh.update(x)
    assert fresh.update(1000.0).spike  # the sixth point is the first judged


def test_a_calm_history_does_not_make_noise_a_spike():
    # Five nearly equal points: their std is 0.001, so 1.5 would be z 500 without
    # the floor; with it, std is half the mean.
    def calm():
        detector = SpikeDetector()
        for x in [1.0, 1.001, 0.999, 1.0, 1.0]:
            detector.update(x)
        return detector

    judged = calm().update(1.5)
    assert not judged.spike and judged.z == pytest.approx(0.5 / (MIN_RELATIVE_STD * 1.0))
    assert judged.limit == pytest.approx(1.0 + 2.5 * 0.5)
    assert calm().update(2.3).spike  # above 2.25x the running mean


def test_a_spike_enters_the_history_at_its_limit():
    detector = SpikeDetector(warmup=3)
    for x in [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]:
        detector.update(x)
    mean, var = detector.mean, detector.var
    judged = detector.update(50.0)
    assert judged.spike and judged.limit == pytest.approx(2.25)
    # The exponential averages took in 2.25, not 50 (and not nothing).
    assert detector.mean == pytest.approx(0.97 * mean + 0.03 * 2.25)
    assert detector.var == pytest.approx(0.97 * var + 0.03 * (2.25 - detector.mean) ** 2)
    assert not detector.update(1.02).spike


def test_a_lasting_rise_is_taken_in():
    # A level that triples and stays: flagged at first, then part of the history.
    detector = SpikeDetector()
    flags = [detector.update(x).spike for x in [1.0] * 30 + [3.0] * 100]
    assert flags[30] and not any(flags[:30])
    assert not any(flags[-50:])


def check_against_reference(series, **rule):
    detector = SpikeDetector(**rule)
    got = [detector.update(x) for x in series]
    want = reference(series, **rule)
    for i, (judged, (score, spike, limit)) in enumerate(zip(got, want)):
        assert judged.spike == spike, (i, judged)
        assert (judged.z is None) == (score is None), (i, judged, score)
        assert (judged.limit is None) == (limit is None), i
        if score is not None:
            assert judged.z == pytest.approx(score, rel=1e-9, abs=1e-9), i
            assert judged.limit == pytest.approx(limit, rel=1e-9), i
    return got


@pytest.mark.parametrize("zeros", [1, 4, 5, 6, 30])
@pytest.mark.parametrize("warmup", [1, 3, 25])
def test_a_history_of_zeros_is_no_history(zeros, warmup):
    # A layer whose gradient is exact zeros for its first steps (a gated branch, an
    # MoE expert no token reached): its first nonzero point starts the history,
    # and it is judged from the fifth point after that on, against those points.
    series = [0.0] * zeros + noisy(zeros, n=60)
    series[zeros + 30] *= 10
    got = check_against_reference(series, warmup=warmup)
    assert [i for i, j in enumerate(got) if j.spike] == [zeros + 30]
    assert [i for i, j in enumerate(got) if j.z is None] == list(range(zeros + 5))
    # Judged as the same series without its zeros.
    alone = SpikeDetector(warmup=warmup)
    assert [alone.update(x) for x in series[zeros:]] == got[zeros:]


def test_zeros_before_a_first_nonzero_point_are_not_judged_whatever_comes():
    # A tiny first nonzero point starts the history too; the zeros after it are in it.
    got = check_against_reference([0.0] * 8 + [1e-30] + [0.0] * 3 + [1.0, 2.0, 50.0])
    assert [i for i, j in enumerate(got) if j.z is not None] == [13, 14]


def test_a_series_that_stays_zero_is_never_judged():
    got = check_against_reference([0.0] * 40)
    assert all(j.z is None and j.limit is None and not j.spike for j in got)


@pytest.mark.parametrize("warmup", [3, 25])
def test_a_series_that_decays_to_zero_keeps_its_history(warmup):
    # Nonzero first: its running mean is not 0, zeros are judged, and a rise after
    # them is judged against that history (a spike when it is one).
    series = noisy(3, n=40) + [0.0] * 20 + [1.2, 30.0]
    got = check_against_reference(series, warmup=warmup)
    assert all(j.z is not None and not j.spike for j in got[40:61])
    assert got[61].spike


def test_non_finite_points_among_the_zeros_are_non_finite():
    series = [0.0, math.nan, 0.0, 0.0, math.inf, 0.0, 1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 9.0]
    got = check_against_reference(series)
    assert [i for i, j in enumerate(got) if j.nonfinite] == [1, 4]
    assert [i for i, j in enumerate(got) if j.z is not None] == [11, 12] and got[12].spike


@pytest.mark.parametrize("bad", [{"z": 0}, {"z": math.inf}, {"alpha": 1.0}, {"warmup": 0}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SpikeDetector(**bad)


@pytest.mark.parametrize("scale", [1e154, 1e200, 1e307])
def test_norms_near_floats_range_are_judged_without_overflow(scale):
    """A finite norm whose square (or whose sum with others) is past float's range is
    still judged: a flat history stays calm, and a 10x rise from 1e-3 of the range is a
    spike (squares of 1e154 raised OverflowError before)."""
    detector = SpikeDetector()
    calm = [detector.update(scale * (1 + 0.01 * (i % 3))) for i in range(30)]
    assert not any(j.spike for j in calm)
    detector = SpikeDetector()
    for i in range(30):
        detector.update(scale * 1e-3 * (1 + 0.01 * (i % 3)))
    jump = detector.update(scale * 1e-2)
    assert jump.spike and math.isfinite(jump.z)


@pytest.mark.parametrize("z", [1.5, 2.5, 4.0, 6.0])
@pytest.mark.parametrize("groups", [0, 1, 2, 5, 15, 35, 1000])
def test_the_groups_threshold_keeps_the_chance_of_any_crossing_that_of_one_series(z, groups):
    got = group_threshold(z, groups)
    assert got == pytest.approx(group_z(z, groups), rel=1e-9)
    assert got >= z and (groups > 1) == (got > z)


def test_the_groups_threshold_grows_with_the_groups_and_stays_finite_past_the_tail():
    assert [round(group_threshold(2.5, g), 3) for g in (1, 5, 1000)] == [2.5, 3.025, 4.369]
    thresholds = [group_threshold(2.5, g) for g in range(1, 200)]
    assert thresholds == sorted(thresholds)
    # Q(40) underflows float64: the tail's asymptote, sqrt(z**2 + 2 ln G), still above z.
    assert group_threshold(40.0, 5) == pytest.approx(math.sqrt(1600 + 2 * math.log(5)))


def test_a_threshold_given_for_one_point_is_its_threshold_and_its_limit():
    series = noisy(3)
    series[60] = 2.4 * sum(series[:60]) / 60  # 2.4x the running mean
    series[90] *= 20
    for threshold in (2.5, 3.025):
        detector = SpikeDetector()
        got = [detector.update(x, threshold) for x in series]
        want = reference(series, z=threshold)
        assert [j.spike for j in got] == [w[1] for w in want]
        for j, (_, _, limit) in zip(got, want):
            assert (j.limit is None) == (limit is None)
            if limit is not None:
                assert j.limit == pytest.approx(limit, rel=1e-9)
    # 2.4x the running mean: past one series' bar (2.25x), not five groups' (2.51x).
    assert spikes_at(series, 2.5) == [60, 90] and spikes_at(series, 3.025) == [90]


def spikes_at(series, threshold):
    detector = SpikeDetector()
    return [i for i, x in enumerate(series) if detector.update(x, threshold).spike]
