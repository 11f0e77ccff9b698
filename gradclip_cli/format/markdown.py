"""``--format markdown``: GitHub-flavoured Markdown for ``$GITHUB_STEP_SUMMARY`` or a PR comment.

A verdict line, then tables (GFM pipe tables). Text from files is data, not
markup: after ``visible()`` makes it one printable line, ``escape`` puts a
backslash before every character that can open inline markup in CommonMark,
GFM or GitHub's renderer: emphasis and strikethrough, code, links and images,
raw HTML, entities, math (``$``), a new table cell (GFM reads ``\\|`` as a
literal pipe) and GFM's bare autolinks (``:`` of ``https://``, ``@`` of an
e-mail address, the dot of ``www.``). Everything else (dots, dashes, slashes in
names and paths) stays as it is, so the source still reads as the name.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, TextIO

from ..report.model import NONFINITE, SPIKE
from .shown import (
    MAX_GROUPS,
    MAX_SPARK_GROUPS,
    groups_to_show,
    largest_norm,
    points_to_show,
    sparkline,
)
from .text import kept_visible, visible
from .words import (
    audit_lines,
    coef_lowered_line,
    compare_verdict,
    fmt,
    fmt_p,
    fmt_ratio,
    group_rule,
    judged_in,
    measured_line,
    point_state,
    ratio_cell,
    trend_quantity,
    trend_verdict,
    verdict_line,
    z_text,
)

if TYPE_CHECKING:
    from ..report import ClipReport, FailureReport, InspectReport, NonFinite
    from ..report.compare import CompareReport
    from ..report.trend import TrendReport

_ESCAPES = {ord(c): "\\" + c for c in "\\`*_[]<>|~&!$:@"}
_WWW = re.compile(r"(?i)(?<=www)\.")


def escape(text: object) -> str:
    """``text`` as literal Markdown text, safe inside a table cell."""
    return _markup(visible(text))


def escape_shown(text: str) -> str:
    """A line made of ``visible()`` pieces already (a note, the measured line, an audit),
    as literal Markdown text: its escapes are not escaped again (``kept_visible``)."""
    return _markup(kept_visible(text))


def _markup(line: str) -> str:
    return _WWW.sub(r"\\.", line.translate(_ESCAPES))


def _table(header: list[str], rows: list[list[str]], align: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(" ---: " if a == "right" else " --- " for a in align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _counts(n: NonFinite | None) -> str:
    if n is None:
        return "\\-"
    if not n.total:
        return "0"
    return ", ".join(f"{c} {label}" for c, label in ((n.nan, "NaN"), (n.posinf, "+inf"),
                                                     (n.neginf, "-inf")) if c)


def _num(x: float | None) -> str:
    # Numbers are ours, but "-" and "+" would start a list item at a line's start.
    return escape(fmt(x))


def _verdict(text: str, failed: bool) -> str:
    # A verdict is made of visible() pieces already (a raw one, autopsy's or a refusal,
    # is made visible by its renderer): its names show as in the rows.
    return f"**{'❌' if failed else '✅'} {_markup(kept_visible(text))}**\n\n"


def render_inspect(report: InspectReport, out: TextIO, *, top: int = 5) -> None:
    out.write(f"### gradclip inspect: {escape(report.source)}\n\n")
    out.write(_verdict(verdict_line(report), report.status != "ok"))
    step = "" if report.step is None else f" at step {report.step}"
    out.write(f"{escape(report.what)}{step}: {report.num_tensors} tensors, "
              f"{report.num_elements:,} elements, p={escape(fmt_p(report.norm_type))}, "
              f"groups by {escape(report.group_by)}\n\n")
    measured = measured_line(report)
    if measured is not None:
        out.write(f"{escape_shown(measured)}\n\n")
    for note in report.notes:  # what the file's name or layout would mislead about
        out.write(f"note\\: {escape_shown(note)}\n\n")
    shown = groups_to_show(report)
    # ratio: each norm over the norm of the same parameters' weights, where the
    # checkpoint holds them (the update-to-weight ratio, for --what update).
    ratio = any(g.ratio is not None for g in report.groups)
    rows = [[escape(g.name), _num(g.norm), *_ratio_cell(ratio, g.ratio),
             "\\-" if math.isnan(g.share) else f"{100 * g.share:.1f}%", _num(g.max_abs),
             f"{g.num_elements:,}", _counts(g.nonfinite)] for g in shown]
    rows.append(["**total**", _num(report.total_norm), *([""] if ratio else []), "100%",
                 _num(report.max_abs), f"{report.num_elements:,}", _counts(report.nonfinite)])
    max_header = escape(judged_in(report).max_header)
    out.write(_table(["group", "norm", *(["ratio"] if ratio else []), "share", max_header,
                      "elements", "non-finite"],
                     rows, ["left", "right", *(["right"] if ratio else []), "right", "right",
                            "right", "left"]))
    if len(shown) < len(report.groups):
        out.write(f"\n{len(report.groups) - len(shown):,} smaller groups not shown "
                  "(`--format json` lists all).\n")
    if top > 0 and report.tensors:
        ranked = sorted(report.tensors,
                        key=lambda t: -t.norm if math.isfinite(t.norm) else -math.inf)[:top]
        ratio = any(t.ratio is not None for t in ranked)
        out.write(f"\n**Top {len(ranked)} tensors by norm**\n\n")
        out.write(_table(["tensor", "norm", *(["ratio"] if ratio else []), max_header, "shape",
                          "dtype"],
                         [[escape(t.name), _num(t.norm), *_ratio_cell(ratio, t.ratio),
                           _num(t.max_abs), escape("x".join(map(str, t.shape)) or "scalar"),
                           escape(t.dtype)] for t in ranked],
                         ["left", "right", *(["right"] if ratio else []), "right", "left", "left"]))


def _ratio_cell(shown: bool, ratio: float | None) -> list[str]:
    """The ratio column's cell, or no cell when the table has no such column."""
    if not shown:
        return []
    return ["\\-" if ratio is None else escape(fmt_ratio(ratio))]


def render_clip(report: ClipReport, out: TextIO) -> None:
    out.write(f"### gradclip clip: {escape(report.source)}\n\n")
    if report.refused is not None:  # nothing was written: no table of what was
        out.write(_verdict(f"FAIL: {visible(report.refused)}", True))
        _notes(report.notes, out)
        return
    out.write(_table(["", "value"], [
        ["output", escape(report.output)],
        ["total norm before", _num(report.total_norm_before)],
        ["clip coefficient", _num(report.clip_coef)],
        ["total norm after", _num(report.total_norm_after)],
        ["clipped", "yes" if report.clipped else "no"],
        ["non-finite values", _counts(report.nonfinite)],
    ], ["left", "right"]))
    lowered = coef_lowered_line(report)
    if lowered is not None:
        out.write(f"\n{escape(lowered)}\n")
    if report.notes:
        out.write("\n")
    _notes(report.notes, out)


def _notes(notes, out: TextIO) -> None:
    """The report's notes (what --verify could not check), one item each; each already
    ``visible``."""
    out.write("".join(f"- {escape_shown(note)}\n" for note in notes))


def render_trend(report: TrendReport, out: TextIO) -> None:
    out.write("### gradclip trend\n\n")
    out.write(_verdict(trend_verdict(report),
                       report.status in (SPIKE, NONFINITE) or bool(report.disagreeing)))
    out.write(f"{len(report.points)} points, {escape_shown(trend_quantity(report))}; "
              f"spike: z \\> {report.z_threshold:g} "
              f"({escape(group_rule(report.group_thresholds()))}"
              f"alpha {report.alpha:g}, warmup {report.warmup})\n\n")
    if report.notes:  # where each series came from, what --verify could not check...
        out.write("".join(f"- {escape_shown(note)}\n" for note in report.notes) + "\n")
    audits = audit_lines(report)  # the norm audit
    if audits:
        out.write("".join(f"- {escape_shown(line)}\n" for line in audits) + "\n")
    shown = points_to_show(report)
    rows = []
    for p in shown:
        state = point_state(p) if p.is_nonfinite else "**spike**" if p.spike else ""
        groups = ", ".join(escape(g) for g in p.spike_groups + p.nonfinite_groups)
        rows.append(["\\-" if p.step is None else str(p.step), escape(p.source),
                     _num(p.total_norm), escape(z_text(p.z)),
                     state, groups])
    out.write(_table(["step", "source", escape_shown(judged_in(report).total), "z", "",
                      "spiking groups"], rows,
                     ["right", "left", "right", "right", "left", "left"]))
    if len(shown) < len(report.points):
        out.write(f"\n{len(report.points) - len(shown):,} unremarkable points not shown.\n")
    if report.points:
        ranked = sorted(report.groups, key=lambda g: -largest_norm(report, g))[:MAX_SPARK_GROUPS]
        series = [("total", [p.total_norm for p in report.points])]
        series += [(g, [p.groups.get(g) for p in report.points])
                   for g in report.groups if g in ranked]
        out.write("\n" + _table(
            ["series", "min", "max", "over time \\(log scale\\)"],
            [[escape(name), _num(min(_finite(v), default=None)),
              _num(max(_finite(v), default=None)), escape(sparkline(v))]
             for name, v in series], ["left", "right", "right", "left"]))


def _finite(values):
    return [v for v in values if v is not None and math.isfinite(v)]


def render_compare(report: CompareReport, out: TextIO) -> None:
    out.write(f"### gradclip compare: {escape(report.a)} → {escape(report.b)}\n\n")
    out.write(_verdict(compare_verdict(report), report.status != "ok"))
    if report.notes:  # what --verify could not check
        out.write("".join(f"- {escape_shown(note)}\n" for note in report.notes) + "\n")
    flagged = {id(g) for g in report.beyond}
    if report.fail_above is not None:
        flagged |= {id(g) for g in report.one_sided}

    def ratio(row, bold: bool) -> str:
        text = escape(ratio_cell(row))
        return f"**{text}**" if bold else text

    rows = [[escape(g.name), _num(g.a), _num(g.b), ratio(g, id(g) in flagged)]
            for g in report.groups[:MAX_GROUPS]]
    t = report.total
    rows.append(["**total**", _num(t.a), _num(t.b), ratio(t, report.total_beyond)])
    out.write(_table(["group", "A", "B", "B / A"], rows, ["left", "right", "right", "right"]))
    if len(report.groups) > MAX_GROUPS:
        out.write(f"\n{len(report.groups) - MAX_GROUPS:,} groups that changed less not shown.\n")


def render_error(failure: FailureReport, out: TextIO) -> None:
    """The heading a report would have, then a failure line: a step summary or PR
    comment says why there is no report."""
    source = f": {escape(failure.source)}" if failure.source else ""
    out.write(f"### gradclip {escape(failure.command)}{source}\n\n")
    out.write(_verdict(f"FAIL: {failure.kind}: {failure.message} (exit {failure.exit_code})", True))
    _notes(failure.notes, out)


def render_autopsy(report, out: TextIO) -> None:
    """The verdict, the header lines, then the ranked groups as a table."""
    from . import autopsy_rows as A

    out.write("### gradclip autopsy\n\n")
    out.write(_verdict(visible(report.verdict), report.status == "explained"))
    out.write("".join(f"- {escape_shown(line)}\n" for line in A.header(report)) + "\n")
    rows = A.shown(report)
    if not rows:
        return
    quantities = A.quantities(report)
    out.write(_table(
        ["#", "group", "onset", "lead", *(escape(A.heading(q)) for q in quantities), "outliers",
         "around the spike \\(log scale\\)"],
        [[str(g.rank), escape(g.name), escape(A.onset_text(g)), escape(A.lead_text(g)),
          *(escape(A.change_text(g, q)) for q in quantities), escape(A.outliers_text(g)),
          escape(sparkline(list(g.around[-A.SPARK_AROUND:]), 24))] for g in rows],
        ["right", "left", "left", "right", *(["right"] * len(quantities)), "right", "left"]))
    if len(report.groups) > len(rows):
        out.write(f"\n{len(report.groups) - len(rows):,} more groups \\(`--format json` "
                  "lists all\\).\n")
