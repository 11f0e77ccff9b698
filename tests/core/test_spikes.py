"""The spike rule against a plain re-statement of the contract's definition."""

from __future__ import annotations

import math
import random

import pytest

from gradclip_cli.core.spikes import MIN_HISTORY, SpikeDetector


def reference(series, z=2.5, alpha=0.97, warmup=25):
    """The contract's rule written out directly: (z or None, spike) per point."""
    accepted: list[float] = []
    mean = var = 0.0
    out = []
    for i, x in enumerate(series):
        if not math.isfinite(x):
            out.append((None, False))
            continue
        if i < MIN_HISTORY or not accepted:
            out.append((None, False))
            spike = False
        else:
            score = (x - mean) / max(math.sqrt(var), 1e-12 * max(abs(mean), 5e-324))
            spike = score > z
            out.append((score, spike))
        if not spike:
            accepted.append(x)
            if len(accepted) <= warmup:
                mean = sum(accepted) / len(accepted)
                var = sum((v - mean) ** 2 for v in accepted) / len(accepted)
            else:
                mean = alpha * mean + (1 - alpha) * x
                var = alpha * var + (1 - alpha) * (x - mean) ** 2
    return out


@pytest.mark.parametrize("warmup", [1, 3, 25])
def test_matches_the_definition_on_noisy_series_with_spikes(warmup):
    rng = random.Random(warmup)
    # Uniform noise: |z| stays below sqrt(3) < 2.5, so only the injected points spike.
    series = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(200)]
    for at in (40, 41, 90, 150):
        series[at] *= 8
    series[120] = math.nan
    detector = SpikeDetector(warmup=warmup)
    got = [detector.update(x) for x in series]
    want = reference(series, warmup=warmup)
    for i, (judged, (z, spike)) in enumerate(zip(got, want)):
        assert judged.spike == spike, i
        assert (judged.z is None) == (z is None), i
        if z is not None:
            assert judged.z == pytest.approx(z, rel=1e-9, abs=1e-9), i
    spikes = [i for i, j in enumerate(got) if j.spike]
    assert {40, 41, 90, 150} <= set(spikes)
    if warmup == 25:  # a short seed underestimates the variance; a full one does not
        assert spikes == [40, 41, 90, 150]
    assert got[120].nonfinite and not got[120].spike


def test_first_points_are_never_judged():
    detector = SpikeDetector()
    judged = [detector.update(x) for x in [1.0, 1.1, 0.9, 1.0, 1000.0]]
    assert all(j.z is None and not j.spike for j in judged)
    fresh = SpikeDetector()
    for x in [1.0, 1.1, 0.9, 1.0, 1.05]:
        fresh.update(x)
    assert fresh.update(1000.0).spike  # the sixth point is the first judged


def test_a_spike_stays_out_of_the_history():
    detector = SpikeDetector()
    for x in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95]:
        detector.update(x)
    mean = detector.mean
    assert detector.update(50.0).spike
    assert detector.mean == mean
    assert not detector.update(1.02).spike


@pytest.mark.parametrize("bad", [{"z": 0}, {"z": math.inf}, {"alpha": 1.0}, {"warmup": 0}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SpikeDetector(**bad)
