"""What each report counts as a finding, for the formats that list findings one by one.

``--format github`` writes one workflow command per finding; ``--format
junit`` turns each into a ``<failure>`` of its group's testcase. Both read
them from here, so the two always agree with each other and with the exit
code: an ``error`` is what makes the exit code 1; a ``warning`` is worth a
look but does not fail the run (non-finite values under
``--allow-nonfinite``, an earlier spike when only the newest point counts).

Names in findings are raw data; each format makes them safe its own way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..report.model import NONFINITE, OVERFLOW
from .words import fmt as number
from .words import (
    judged_in,
    nonfinite_rows,
    nonfinite_words,
    origin_text,
    overflowed_total,
    threshold_applied,
    unchecked_total,
    z_text,
)

if TYPE_CHECKING:
    from ..report import ClipReport, InspectReport
    from ..report.compare import CompareReport
    from ..report.trend import TrendPoint, TrendReport

ERROR, WARNING = "error", "warning"
TOTAL = "(total)"  # the series / testcase of the total norm; no layer is named so
RUN = "(run)"  # the testcase of a run that failed before it could report (exit 2 or 3)


@dataclass(frozen=True)
class Finding:
    severity: str  # ERROR (a cause of exit 1) or WARNING
    series: str  # the group it concerns, or TOTAL
    title: str
    message: str
    source: str | None = None  # the file it concerns, when not the report's own


def _counts(n) -> str:
    return f"{n.nan} NaN, {n.posinf} +inf, {n.neginf} -inf"


def inspect_findings(report: InspectReport) -> list[Finding]:
    found = []
    severity = WARNING if report.allow_nonfinite else ERROR
    what = judged_in(report)
    # One per tensor, as the table and -q name them; its group is the testcase.
    for t in report.tensors:
        if t.nonfinite.total:
            found.append(Finding(severity, t.group, f"non-finite {what.plural}",
                                 f"tensor {t.name} (group {t.group}): {_counts(t.nonfinite)}"))
    exceeded = report.max_norm is not None and report.total_norm > report.max_norm
    if exceeded:
        found.append(Finding(ERROR, TOTAL, f"{what.attribute} total norm exceeds --max-norm",
                             f"{what.attribute} total norm {number(report.total_norm)} > "
                             f"--max-norm {number(report.max_norm)}"
                             f"{threshold_applied(report)}"))
    # Exit 1 with no tensor at fault: the total itself is the finding, so that a
    # failing run is never a lone ::notice or a JUnit suite without failures.
    if report.status == OVERFLOW and not exceeded:
        found.append(Finding(ERROR, TOTAL, f"{what.attribute} total norm beyond float64's range",
                             overflowed_total(report)))
    if report.status == NONFINITE and report.allow_nonfinite:
        found.append(Finding(ERROR, TOTAL, f"{what.attribute} total norm not checked "
                             "against --max-norm", unchecked_total(report)))
    return found


def clip_findings(report: ClipReport) -> list[Finding]:
    if report.refused is not None:
        return [Finding(ERROR, TOTAL, "refused to clip", report.refused)]
    if report.nonfinite.total:
        return [Finding(WARNING, TOTAL, "non-finite gradients clipped",
                        f"{_counts(report.nonfinite)} clipped under --allow-nonfinite")]
    return []


def total_spiked(point: TrendPoint, report: TrendReport) -> bool:
    return point.z is not None and point.z > report.z_threshold


def trend_findings(report: TrendReport) -> list[Finding]:
    """One per spiking or non-finite series at each point; errors for the points
    ``--fail-on`` covers, warnings for the others."""
    failing = {id(p) for p in report.failing}
    what = judged_in(report, show=str)  # names raw: each format escapes them
    spike = f"{what.attribute} spike"
    found = []
    for p in report.points:
        severity = ERROR if id(p) in failing else WARNING
        at = f"step {p.step}" if p.step is not None else p.source
        if not math.isfinite(p.total_norm) or (p.nonfinite is not None and p.nonfinite.total):
            found.append(Finding(severity, TOTAL, f"{nonfinite_words([p], what)} at {at}",
                                 f"{p.source}: {what.total} {number(p.total_norm)}"
                                 f"{origin_text(p)}", p.source))
        elif total_spiked(p, report):
            found.append(Finding(severity, TOTAL, f"{spike} at {at}",
                                 f"{p.source}: {what.total} {number(p.total_norm)}, "
                                 f"z {z_text(p.z)} > {report.z_threshold:g}", p.source))
        for g in p.nonfinite_groups:
            found.append(Finding(severity, g, f"{nonfinite_words([p], what)} at {at}",
                                 f"{p.source}: group {g} norm {number(p.groups[g])}", p.source))
        for g in p.spike_groups:
            found.append(Finding(severity, g, f"{spike} at {at}",
                                 f"{p.source}: group {g} norm {number(p.groups[g])}, "
                                 f"z {z_text(p.group_z[g])} > "
                                 f"{report.groups_threshold_at(p):.3g}", p.source))
    # The norm audit: each step where a framework's logged total disagrees with gradclip's.
    for a in report.disagreeing:
        for d in a.disagreements:
            found.append(Finding(ERROR, TOTAL, f"logged total norm disagrees at step {d.step}",
                                 f"{a.framework.kind} ({a.framework.source}): "
                                 f"{number(d.framework)}; {a.gradclip.kind} "
                                 f"({a.gradclip.source}): {number(d.gradclip)}; relative "
                                 f"difference {number(d.relative)} > {a.tolerance:.2g} "
                                 f"({a.precision} totals)", a.framework.source))
    return found


def compare_findings(report: CompareReport) -> list[Finding]:
    found = []
    what = judged_in(report)
    if report.status == NONFINITE:
        rows = [report.total] if report.total.nonfinite else []
        for g in rows + nonfinite_rows(report):
            series = TOTAL if g is report.total else g.name
            # A NaN norm says its values hold a NaN; an infinite one may be finite values
            # beyond float64's range (compare holds no counts): the norm, as the verdict.
            nan = any(v is not None and math.isnan(v) for v in (g.a, g.b))
            title = f"non-finite {what.plural}" if nan else f"non-finite {what.attribute} norm"
            found.append(Finding(ERROR, series, title,
                                 f"{g.name}: norm {number(g.a)} in A, {number(g.b)} in B"))
    t = report.total
    if report.total_beyond:
        total = f"{what.attribute} total norm"
        found.append(Finding(ERROR, TOTAL, f"{total} changed {number(t.ratio)}x",
                             f"{total}: {number(t.a)} -> {number(t.b)}, ratio "
                             f"{number(t.ratio)} beyond --fail-above {report.fail_above:g}"))
    for g in report.beyond:
        found.append(Finding(ERROR, g.name, f"{what.attribute} norm changed {number(g.ratio)}x",
                             f"group {g.name}: {number(g.a)} -> {number(g.b)}, ratio "
                             f"{number(g.ratio)} beyond --fail-above {report.fail_above:g}"))
    # A group on one side only fails under --fail-above; without it, it is worth a look.
    severity = ERROR if report.fail_above is not None else WARNING
    for g in report.one_sided:
        side, other = ("A", "B") if g.only == "a" else ("B", "A")
        norm = g.a if g.only == "a" else g.b
        found.append(Finding(severity, g.name, f"group in {side} only",
                             f"group {g.name}: norm {number(norm)} in {side}, absent from {other}"))
    return found


def autopsy_findings(report) -> list[Finding]:
    """An explained spike or non-finite step is one error: the verdict, under the group it
    began in."""
    if report.status != "explained":
        return []
    began = next((g for g in report.groups if g.onset is not None), None)
    series = TOTAL if began is None else began.name
    what = "non-finite" if report.nonfinite else "spike"
    return [Finding(ERROR, series, f"{what} at step {report.step}", report.verdict)]
