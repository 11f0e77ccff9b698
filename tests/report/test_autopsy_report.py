"""The autopsy's report data from series given directly: onsets judged as ``trend`` judges
each series, the episode that reaches the explained step, leads, changes, the ranking."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gradclip_cli.core.outliers import adam_outliers
from gradclip_cli.core.spikes import SpikeDetector
from gradclip_cli.report.autopsy import (
    CHECKPOINTS,
    EXPLAINED,
    INSUFFICIENT,
    LOG,
    NOTHING,
    QuantitySeries,
    build_autopsy_report,
    ratio,
)
from gradclip_cli.report.trend import Observation

RULE = {"z": 2.5, "alpha": 0.97, "warmup": 25}


def noise(seed: int, n: int, level: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + 0.1 * rng.uniform(-1, 1)) for _ in range(n)]


def log(groups: dict[str, list[float]], label: str = "grads.jsonl", first: int = 0,
        what: str = "grads", kind: str = LOG) -> QuantitySeries:
    n = len(next(iter(groups.values())))
    obs = []
    for i in range(n):
        values = {g: v[i] for g, v in groups.items()}
        total = math.sqrt(sum(v * v for v in values.values()))
        obs.append(Observation(label, first + i, total, values, None, what))
    return QuantitySeries(what, kind, label, tuple(obs))


def autopsy(series, step=None, window=50, outliers=None):
    return build_autopsy_report(series, step=step, window=window, outlier_k=6.0,
                                outliers=outliers, **RULE)


def test_a_one_layer_spike_is_ranked_first_with_its_onset_and_no_lead():
    a, b = noise(1, 60), noise(2, 60)
    b[40] *= 50
    report = autopsy([log({"a": a, "b": b})])
    assert report.status == EXPLAINED and report.step == 40
    first = report.groups[0]
    assert first.name == "b" and first.onset.step == 40 and first.lead == 0
    assert report.groups[1].onset is None and report.groups[1].lead is None
    assert first.changes["grads"].ratio == pytest.approx(b[40] / b[39], rel=1e-12)
    assert first.changes["grads"].before_step == 39 and first.changes["grads"].after_step == 40
    assert "began in b at step 40" in report.verdict and "grads.jsonl" in report.verdict


def test_a_precursor_that_stays_up_leads_the_total():
    # "a" rises 4 steps before the total crosses; "b" is where the total's spike is.
    a, b = noise(3, 60, 0.1), noise(4, 60, 10.0)
    for s in range(36, 41):
        a[s] = 0.1 * 3 ** (s - 35)
    b[40] *= 30
    report = autopsy([log({"a": a, "b": b})])
    first = report.groups[0]
    assert first.name == "a" and first.onset.step == 36
    assert report.total_onset.step == 40 and first.lead == 4
    assert report.groups[1].name == "b" and report.groups[1].lead == 0
    assert "4 steps before the total" in report.verdict and "then b" in report.verdict


def test_a_crossing_the_series_fell_back_from_is_not_the_onset():
    # Noise crossing at 15 that went back under its mean is another event.
    a, b = noise(5, 60), noise(6, 60)
    a[15] *= 4
    b[40] *= 40
    report = autopsy([log({"a": a, "b": b})])
    assert [g.name for g in report.groups] == ["b", "a"]
    assert report.groups[1].onset is None
    # Still, asked about step 15, "a" began there.
    early = autopsy([log({"a": a, "b": b})], step=15)
    assert early.status == EXPLAINED and early.groups[0].name == "a"


def test_the_window_bounds_the_onset():
    a = noise(7, 60, 0.1)
    for s in range(30, 41):
        a[s] = 0.1 * 1.6 ** (s - 29)
    report = autopsy([log({"a": a})], step=40, window=3)
    assert report.groups[0].onset.step >= 37
    full = autopsy([log({"a": a})], step=40)
    assert full.groups[0].onset.step < 37


def test_ties_in_onset_go_to_the_largest_change():
    a, b, c = noise(8, 60), noise(9, 60), noise(10, 60)
    a[40] *= 10
    b[40] *= 80
    report = autopsy([log({"a": a, "b": b, "c": c})])
    assert [g.name for g in report.groups] == ["b", "a", "c"]
    assert [g.rank for g in report.groups] == [1, 2, 3]


def test_non_finite_is_an_onset_and_is_said():
    a, b = noise(11, 60), noise(12, 60)
    b[40] = math.nan
    report = autopsy([log({"a": a, "b": b})])
    assert report.status == EXPLAINED and report.step == 40
    assert report.groups[0].name == "b" and report.groups[0].onset.nonfinite
    assert math.isnan(report.groups[0].changes["grads"].ratio)
    assert "non-finite" in report.verdict


def test_a_clean_series_has_nothing_and_a_short_one_is_insufficient():
    clean = autopsy([log({"a": noise(13, 60), "b": noise(14, 60)})])
    assert clean.status == NOTHING and clean.step is None and clean.groups == []
    short = autopsy([log({"a": noise(15, 4)})])
    assert short.status == INSUFFICIENT


def test_a_clean_step_given_is_nothing_with_its_changes():
    a = noise(16, 60)
    report = autopsy([log({"a": a})], step=30)
    assert report.status == NOTHING and report.step == 30
    assert report.groups[0].changes["grads"].ratio == pytest.approx(a[30] / a[29])
    assert "nothing to explain" in report.verdict


def test_a_step_given_before_the_rule_can_judge_is_insufficient():
    """Fewer than 5 points before it: the rule has not judged it, so it is not clean."""
    a = noise(16, 60)
    report = autopsy([log({"a": a})], step=3)
    assert report.status == INSUFFICIENT and report.step == 3
    assert "too few points before it to judge (3; the rule needs 5" in report.verdict
    assert autopsy([log({"a": a})], step=5).status == NOTHING  # 5 earlier: judged


def test_the_verdict_states_no_change_without_a_point_on_each_side():
    """Checkpoints that end before the spike give exp_avg a before and no after: the
    verdict names no such change, nor their files."""
    a, b = noise(17, 60), noise(18, 60)
    b[40] *= 50
    moments = log({"a": noise(19, 30), "b": noise(20, 30)}, "ckpts", what="exp_avg",
                  kind=CHECKPOINTS)
    report = autopsy([log({"a": a, "b": b}), moments])
    first = report.groups[0]
    assert report.step == 40 and first.name == "b"
    assert first.changes["exp_avg"].ratio is None and first.changes["exp_avg"].before_step == 29
    assert "exp_avg" not in report.verdict and "ckpts" not in report.verdict


def test_coarse_series_give_changes_from_the_nearest_points():
    a, b = noise(17, 60), noise(18, 60)
    b[40] *= 50
    moments = log({"a": [1.0] * 12, "b": [1.0] * 8 + [5.0] * 4}, "ckpts", what="exp_avg",
                  kind=CHECKPOINTS)
    # One point every 5 steps: 0, 5, ..., 55 (steps re-numbered below).
    moments = QuantitySeries("exp_avg", CHECKPOINTS, "ckpts", tuple(
        Observation(f"ckpt-{5 * i}", 5 * i, o.total_norm, o.groups, None, "exp_avg")
        for i, o in enumerate(moments.observations)))
    report = autopsy([log({"a": a, "b": b}), moments])
    first = report.groups[0]
    assert first.name == "b"
    change = first.changes["exp_avg"]
    assert (change.before_step, change.after_step) == (35, 40) and change.ratio == 5.0
    assert change.before_source == "ckpt-35" and change.after_source == "ckpt-40"
    assert "ckpt-35" in report.verdict and "ckpt-40" in report.verdict


def test_history_is_the_value_over_the_rules_running_mean():
    a = noise(19, 60)
    a[40] *= 20
    report = autopsy([log({"a": a})])
    detector = SpikeDetector()
    for x in a[:40]:
        detector.update(x)
    assert report.groups[0].onset.history == pytest.approx(a[40] / detector.mean, rel=1e-12)


def test_ratio_edges():
    assert ratio(0.0, 0.0) == 1.0 and ratio(0.0, 2.0) == math.inf
    assert math.isnan(ratio(math.nan, 1.0)) and ratio(None, 1.0) is None
    assert ratio(2.0, 3.0) == 1.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_outliers_against_a_float64_count(dtype):
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(1000, generator=gen) * 3).to(dtype)
    rms = torch.rand(1000, generator=gen).to(torch.float32) + 0.1
    expected = sum(abs(float(x)) > 6 * float(r) for x, r in zip(g.tolist(), rms.tolist()))
    assert adam_outliers(g, rms, 6.0) == expected
    assert 0 < expected < 1000


def test_outliers_count_inf_not_nan_and_refuse_other_shapes():
    g = torch.tensor([math.inf, math.nan, 0.5, -100.0])
    assert adam_outliers(g, torch.ones(4), 6.0) == 2
    with pytest.raises(ValueError, match="not one parameter"):
        adam_outliers(g, torch.ones(5), 6.0)
