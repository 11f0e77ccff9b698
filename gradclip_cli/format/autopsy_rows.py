"""What every format shows of an autopsy: the ranked rows as plain strings.

``table`` and ``markdown`` draw the same rows (``rows``) and header lines
(``header``); ``github`` and ``junit`` list the same finding
(``findings.autopsy_findings``). Plain data and strings: no rich.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..report.autopsy import QUANTITIES, times
from ..report.tag import tag_words
from .text import kept_visible, visible
from .words import group_rule

if TYPE_CHECKING:
    from ..report.autopsy import AutopsyReport, GroupAutopsy

# Rows a person reads; --format json lists every group.
MAX_ROWS = 30
SPARK_AROUND = 40  # points of each group's series drawn around the spike


# Column headings: update_to_weights is the one too wide for a table of nine columns.
HEADINGS = {"update_to_weights": "upd/w"}


def heading(quantity: str) -> str:
    return HEADINGS.get(quantity, quantity)


def quantities(report: AutopsyReport) -> list[str]:
    """The quantities some group has a change for, in the report's order."""
    present = {q for g in report.groups for q in g.changes}
    return [q for q in QUANTITIES if q in present]


def header(report: AutopsyReport) -> list[str]:
    """The lines above the table: what was explained, from what, and the notes."""
    step = "-" if report.step is None else str(report.step)
    # A tag --tag named: its values, not the total of gradient norms (``TagRead``).
    total = "total" if report.tag is None else tag_words(report.tag.name)
    of = "" if report.tag is None else f"{total} of "
    lines = [f"step {step} of {of}{visible(report.finest)} (window {report.window}, outliers "
             f"beyond {report.outlier_k:g} sqrt(v_hat)); spike: z > {report.z_threshold:g} "
             f"({group_rule(report.group_thresholds())}"
             f"alpha {report.alpha:g}, warmup {report.warmup})"]
    if report.total_onset is not None:
        o = report.total_onset
        how = "non-finite" if o.nonfinite else "crossed the rule"
        lines.append(f"{total}: onset at step {o.step} ({how})")
    elif report.step is not None:
        lines.append(f"{total}: did not cross the rule within the window")
    if "update_to_weights" in quantities(report):
        lines.append("changes are after / before; upd/w: update_to_weights, the update's "
                     "RMS over the weights' RMS")
    lines += [kept_visible(n) for n in report.notes]  # escaped where made
    return lines


def onset_text(g: GroupAutopsy) -> str:
    if g.onset is None:
        return "-"
    o = g.onset
    mark = " (non-finite)" if o.nonfinite else ""
    return f"{o.step} {o.what}{mark}"


def lead_text(g: GroupAutopsy) -> str:
    return "-" if g.lead is None else str(g.lead)


def outliers_text(g: GroupAutopsy) -> str:
    if g.outliers is None:
        return "-"
    return f"{100 * g.outliers.fraction:.3g}%"


def change_text(g: GroupAutopsy, quantity: str) -> str:
    c = g.changes.get(quantity)
    return "-" if c is None else times(c.ratio)


def shown(report: AutopsyReport) -> list[GroupAutopsy]:
    return report.groups[:MAX_ROWS]
