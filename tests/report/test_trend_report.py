"""The trend report: one detector per series, what makes a point a spike, and the status."""

from __future__ import annotations

import math

import pytest

from gradclip_cli.core.spikes import SpikeDetector
from gradclip_cli.errors import UsageError
from gradclip_cli.report import NonFinite
from gradclip_cli.report.trend import Observation, build_trend_report, order_by_step

from ..core.spike_reference import group_z, reference


def build(observations, fail_on="newest", **kw):
    opts = {"z": 2.5, "alpha": 0.97, "warmup": 25, **kw}
    return build_trend_report(observations, what="grads", norm_type=2.0, group_by="layer",
                              fail_on=fail_on, **opts)


def obs(step, total, groups=None, nonfinite=None):
    return Observation(f"s{step}", step, total, groups or {}, nonfinite)


def wobble(i):
    return 1.0 + 0.02 * ((i * 7) % 5)


def test_total_z_is_the_detector_fed_the_totals():
    totals = [wobble(i) for i in range(30)] + [9.0, 1.0]
    report = build([obs(i, x) for i, x in enumerate(totals)])
    detector = SpikeDetector()
    assert [p.z for p in report.points] == [detector.update(x).z for x in totals]
    assert [p.step for p in report.points if p.spike] == [30]


def test_a_group_spike_makes_the_point_a_spike_and_is_named():
    points = [obs(i, 10.0, {"a": wobble(i), "b": 3.0 * wobble(i + 1)}) for i in range(20)]
    points.append(obs(20, 10.0, {"a": wobble(20), "b": 30.0}))
    report = build(points)
    newest = report.points[-1]
    assert newest.spike and newest.spike_groups == ("b",) and report.status == "spike"
    assert newest.z is not None and newest.z < 2.5  # the total itself did not move


def test_a_group_that_appears_late_needs_its_own_history():
    points = [obs(i, 1.0, {"a": 1.0}) for i in range(10)]
    points += [obs(10 + i, 1.0, {"a": 1.0, "late": 1.0 + i}) for i in range(3)]
    report = build(points)
    assert all(p.group_z.get("late") is None for p in report.points)
    assert not any(p.spike for p in report.points)


def test_status_nonfinite_beats_spike_and_covers_what_fail_on_says():
    points = [obs(i, wobble(i)) for i in range(12)]
    spiky = points + [obs(12, 50.0)]
    assert build(spiky).status == "spike"
    bad = spiky + [obs(13, math.nan)]
    assert build(bad).status == "nonfinite" and build(bad).failing == [build(bad).points[-1]]
    # counted non-finite elements with a finite (clamped, say) total still count
    counted = points + [obs(12, 1.0, nonfinite=NonFinite(0, 2, 0))]
    assert build(counted).status == "nonfinite"
    healed = spiky + [obs(13, 1.0)]
    assert build(healed).status == "ok" and build(healed).failing == []
    assert build(healed, fail_on="any").status == "spike"
    assert [p.step for p in build(healed, fail_on="any").failing] == [12]


def test_insufficient_history():
    assert build([]).status == "insufficient_history"
    assert build([obs(i, 1.0) for i in range(5)]).status == "insufficient_history"
    assert build([obs(i, 1.0) for i in range(6)]).status == "ok"
    nan_last = [obs(i, 1.0) for i in range(3)] + [obs(3, math.nan)]
    assert build(nan_last).status == "nonfinite"


def test_order_by_step_is_stable_and_only_when_every_step_is_known():
    a, b, c = obs(5, 1.0), Observation("x", 5, 2.0), obs(1, 3.0)
    assert order_by_step([a, b, c]) == [c, a, b]
    unknown = Observation("u", None, 1.0)
    assert order_by_step([c, unknown, a]) == [c, unknown, a]
    # The order given may not contradict the steps that are known.
    with pytest.raises(UsageError, match=r"^u: no step .* s1 \(step 1\) comes after s5 \(step 5\)"):
        order_by_step([a, unknown, c])


def test_the_groups_of_a_point_are_judged_at_once_against_the_groups_threshold():
    # Five groups, as OLMo-core's olmo2_1M in GradMonitor's default grouping. Batch
    # noise of the kind measured there (one group at 2.3-2.7x its history while the
    # total stays below 2.25x) is past one series' bar (2.25x the running mean) but
    # not five groups' (z > 3.025: 2.51x); a 20x spike of one group still is one.
    names = ["embeddings", "blocks.0", "blocks.1", "lm_head.norm", "lm_head.w_out"]
    series = {g: [(k + 1) * wobble(i + k) for i in range(50)] for k, g in enumerate(names)}
    mean = sum(series["embeddings"][:30]) / 30
    series["embeddings"][30] = 2.4 * mean
    series["blocks.1"][42] *= 20
    points = []
    for i in range(50):
        groups = {g: series[g][i] for g in names}
        points.append(obs(i, math.sqrt(sum(v * v for v in groups.values())), groups))
    report = build(points, fail_on="any")
    threshold = group_z(2.5, len(names))
    for g in names:
        want = [i for i, (_, spike, _) in enumerate(reference(series[g], z=threshold)) if spike]
        assert [p.step for p in report.points if g in p.spike_groups] == want, g
    assert [(p.step, p.spike_groups) for p in report.points if p.spike] == [(42, ("blocks.1",))]
    # One series at the total's threshold would flag the noise: it is the groups' bar
    # that keeps it out.
    assert reference(series["embeddings"], z=2.5)[30][1]
