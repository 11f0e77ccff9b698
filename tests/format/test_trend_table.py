"""The trend table on long runs: which rows it keeps, and sparklines that keep a spike."""

from __future__ import annotations

import io
import math

from gradclip_cli.format import markdown, shown, table
from gradclip_cli.report.trend import Observation, build_trend_report
from tests.cli.support import logical_lines, unwrapped


def long_run(n=500, spike_at=123):
    obs = [Observation("log.jsonl", s, 1.0 + 0.01 * (s % 7),
                       {"a": 1.0 + 0.01 * (s % 5), "b": 100.0 if s == spike_at else 0.5})
           for s in range(n)]
    return build_trend_report(obs, what="grads", norm_type=2.0, group_by="layer", z=2.5,
                              alpha=0.97, warmup=25, fail_on="newest")


def test_long_runs_keep_the_spikes_and_the_newest_rows():
    report = long_run()
    rows = shown.points_to_show(report)
    assert len(rows) == shown.MAX_POINTS
    steps = [p.step for p in rows]
    assert 123 in steps and steps[-1] == 499 and steps == sorted(steps)
    out = io.StringIO()
    table.render_trend(report, out)
    text = out.getvalue()
    assert f"{500 - shown.MAX_POINTS} unremarkable points not shown" in unwrapped(text)
    assert logical_lines(text)[-1].startswith("OK:")


def test_sparkline_folds_long_series_and_keeps_a_one_point_spike():
    values = [1.0] * 1000
    values[777] = 1000.0
    line = shown.sparkline(values)
    assert len(line) == shown.SPARK_WIDTH
    assert line.count("█") == 1 and set(line) == {"▁", "█"}
    assert line.index("█") == int(777 / (1000 / shown.SPARK_WIDTH))


def test_sparkline_marks_nonfinite_and_absent_points():
    line = shown.sparkline([1.0, None, math.nan, 10.0, math.inf])
    assert line == "▁ !█!"


def test_markdown_trend_keeps_the_same_rows():
    out = io.StringIO()
    markdown.render_trend(long_run(), out)
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| 1")]
    assert any(line.startswith("| 123 |") for line in rows)
