"""``--format table`` (default): a report a person reads at a glance.

Groups in checkpoint order with norm, share, max |g|, size, non-finite counts
and a bar against the largest group; then the top tensors by norm and every
tensor holding non-finite values; then a one-line verdict matching the exit
code. rich decides colour: only on a terminal, never with NO_COLOR set.
"""

from __future__ import annotations

import math
from typing import TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..report import EXCEEDED, NONFINITE, ClipReport, InspectReport, NonFinite
from ..report.compare import CompareReport
from ..report.trend import INSUFFICIENT_HISTORY, SPIKE, TrendPoint, TrendReport
from .findings import z_text
from .text import visible

BAR_WIDTH = 20
# More groups than a person reads (and rich renders 20,000 rows slowly): show
# the largest, and any holding NaN/inf, in checkpoint order.
MAX_GROUPS = 60


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.6g}"


def fmt_p(p: float) -> str:
    return "inf" if math.isinf(p) else f"{p:g}"


def bar(value: float, largest: float) -> Text:
    if not math.isfinite(value):
        return Text("!" * BAR_WIDTH, style="bold red")
    if not (largest > 0 and math.isfinite(largest)):
        return Text("")
    filled = round(BAR_WIDTH * value / largest)
    return Text("█" * filled + "·" * (BAR_WIDTH - filled), style="cyan")


def _nonfinite_cell(n: NonFinite) -> Text:
    if not n.total:
        return Text("-", style="dim")
    parts = [f"{c} {label}" for c, label in ((n.nan, "nan"), (n.posinf, "+inf"),
                                             (n.neginf, "-inf")) if c]
    return Text(", ".join(parts), style="bold red")


# Pipes and CI logs get this width (rich would use 80, which truncates names).
PIPE_WIDTH = 120


def _console(out: TextIO) -> Console:
    console = Console(file=out, highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(file=out, highlight=False, soft_wrap=False, width=PIPE_WIDTH)
    return console


def verdict_line(report: InspectReport) -> Text:
    p = fmt_p(report.norm_type)
    if report.status == NONFINITE:
        n = report.nonfinite
        tensors = sum(1 for t in report.tensors if t.nonfinite.total)
        return Text(
            f"FAIL: non-finite gradients: {n.nan} NaN, {n.posinf} +inf, {n.neginf} -inf "
            f"in {tensors} tensor(s); total norm {fmt(report.total_norm)} (exit 1)",
            style="bold red",
        )
    if report.status == EXCEEDED:
        return Text(
            f"FAIL: total norm {fmt(report.total_norm)} (p={p}) exceeds --max-norm "
            f"{fmt(report.max_norm)} (exit 1)",
            style="bold red",
        )
    note = ""
    if report.nonfinite.total:
        note = f"; {report.nonfinite.total} non-finite value(s) allowed by --allow-nonfinite"
    limit = f" <= --max-norm {fmt(report.max_norm)}" if report.max_norm is not None else ""
    return Text(f"OK: total norm {fmt(report.total_norm)} (p={p}){limit}{note} (exit 0)",
                style="bold green")


def _groups_to_show(report: InspectReport):
    groups = report.groups
    if len(groups) <= MAX_GROUPS:
        return groups
    def size(g):
        return math.inf if not math.isfinite(g.norm) else g.norm
    keep = {id(g) for g in sorted(groups, key=size, reverse=True)[:MAX_GROUPS]}
    return [g for g in groups if id(g) in keep]


def render_inspect(report: InspectReport, out: TextIO, *, top: int = 5) -> None:
    console = _console(out)
    p = fmt_p(report.norm_type)
    key = f", key '{report.key}'" if report.key else ""
    step = f", step {report.step}" if report.step is not None else ""
    header = Text(report.source, style="bold")
    header.append(f"  {report.format}{key}{step}, {report.num_tensors} tensors, "
                  f"{report.num_elements:,} elements, p={p}, device {report.device}")
    console.print(header)
    console.print(Text(f"what: {report.what}"))
    for line in report.description:
        console.print(Text(line, style="dim"))
    if report.skipped:
        console.print(f"skipped {len(report.skipped)} non-floating entr"
                      f"{'y' if len(report.skipped) == 1 else 'ies'}: "
                      + ", ".join(report.skipped[:5]) + (" ..." if len(report.skipped) > 5 else ""))

    table = Table(title=f"groups (by {report.group_by})", title_justify="left")
    # The bar is the first thing to go on a narrow terminal; names never are.
    show_bar = console.width >= 100
    with_ratio = any(g.ratio is not None for g in report.groups)
    columns = [("group", "left"), ("norm", "right"), ("share", "right"), ("max |g|", "right"),
               *([("ratio", "right")] if with_ratio else []),
               ("elements", "right"), ("non-finite", "left")] + ([("", "left")] if show_bar else [])
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=col != "group",
                         min_width=min(40, max(len(g.name) for g in report.groups))
                         if col == "group" else None)
    largest = max((g.norm for g in report.groups if math.isfinite(g.norm)), default=0.0)
    shown = _groups_to_show(report)
    for g in shown:
        share = "-" if math.isnan(g.share) else f"{100 * g.share:.1f}%"
        cells = [g.name, fmt(g.norm), share, fmt(g.max_abs),
                 *([fmt(g.ratio)] if with_ratio else []), f"{g.num_elements:,}",
                 _nonfinite_cell(g.nonfinite)]
        table.add_row(*cells, *([bar(g.norm, largest)] if show_bar else []))
    table.add_section()
    if len(shown) < len(report.groups):
        hidden = len(report.groups) - len(shown)
        table.add_row(Text(f"... {hidden:,} smaller groups not shown (--format json lists all)",
                           style="dim"), *[""] * (len(columns) - 1))
    table.add_row(Text("total", style="bold"), Text(fmt(report.total_norm), style="bold"),
                  "100%" if report.total_norm else "-", fmt(report.max_abs),
                  *([""] if with_ratio else []), f"{report.num_elements:,}",
                  _nonfinite_cell(report.nonfinite),
                  *([""] if show_bar else []))
    console.print(table)

    if top > 0 and report.tensors:
        ranked = sorted(report.tensors,
                        key=lambda t: -t.norm if math.isfinite(t.norm) else -math.inf)
        head = Table(title=f"top {min(top, len(ranked))} tensors by norm", title_justify="left")
        for col, just in (("tensor", "left"), ("norm", "right"), ("max |g|", "right"),
                          ("shape", "left"), ("dtype", "left")):
            head.add_column(col, justify=just, min_width=min(50, max(
                len(t.name) for t in report.tensors)) if col == "tensor" else None)
        for t in ranked[:top]:
            head.add_row(t.name, fmt(t.norm), fmt(t.max_abs),
                         "x".join(map(str, t.shape)) or "scalar", t.dtype)
        console.print(head)

    bad = [t for t in report.tensors if t.nonfinite.total]
    if bad:
        console.print(Text(f"non-finite values in {len(bad)} tensor(s):", style="bold red"))
        for t in bad:
            line = Text(f"  {t.name}: ")
            line.append_text(_nonfinite_cell(t.nonfinite))
            console.print(line)
    ties = [t for t in report.tensors if t.tied]
    for t in ties:
        console.print(f"tied (counted once): {t.name} = " + ", ".join(t.tied), style="dim")
    console.print(verdict_line(report))


def render_clip(report: ClipReport, out: TextIO) -> None:
    console = _console(out)
    if report.clip_value is not None:
        what = f"clamped every element to [-{fmt(report.clip_value)}, {fmt(report.clip_value)}]"
    elif report.clipped:
        what = f"scaled by {fmt(report.clip_coef)}"
    else:
        what = f"unchanged (coefficient {fmt(report.clip_coef)} is 1)"
    p = fmt_p(report.norm_type)
    console.print(f"[bold]{report.source}[/bold] -> [bold]{report.output}[/bold]")
    console.print(f"total norm (p={p}): {fmt(report.total_norm_before)} -> "
                  f"{fmt(report.total_norm_after)}; {report.num_tensors} tensors {what}")
    if report.nonfinite.total:
        console.print(Text(f"warning: {report.nonfinite.total} non-finite value(s) were "
                           "clipped under --allow-nonfinite", style="yellow"))
    if report.other_links_unchanged:
        console.print(Text(f"note: {visible(report.output)} had {report.other_links_unchanged} "
                           "other hard link(s), which still hold the old bytes (the atomic "
                           "replace gives this name a new file)", style="yellow"))


# -- trend ---------------------------------------------------------------------

# One row per point, but a run logged every step has thousands: beyond this
# many, the table keeps every spike or non-finite point and the newest ones.
MAX_POINTS = 60
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60
MAX_SPARK_GROUPS = 20


def points_to_show(report: TrendReport) -> list[TrendPoint]:
    points = report.points
    if len(points) <= MAX_POINTS:
        return points
    flagged = [i for i, p in enumerate(points) if p.spike or p.is_nonfinite][-MAX_POINTS // 2:]
    room = MAX_POINTS - len(flagged)
    keep = set(flagged) | set(range(len(points) - room, len(points)))
    return [p for i, p in enumerate(points) if i in keep]


def sparkline(values: list[float | None], width: int = SPARK_WIDTH) -> Text:
    """One character per point on a log scale between the series' smallest and largest
    positive value; ``!`` marks NaN/inf, a space a point where the group is absent.
    Longer series are folded into ``width`` buckets, each showing its largest value,
    so a one-point spike stays visible."""
    if len(values) > width:
        size = len(values) / width
        buckets = [values[int(i * size):int((i + 1) * size)] for i in range(width)]
        values = [_bucket_max(b) for b in buckets]
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    low, high = (min(logs), max(logs)) if logs else (0.0, 0.0)
    line = Text()
    for v in values:
        if v is None:
            line.append(" ")
        elif not math.isfinite(v):
            line.append("!", style="bold red")
        elif v <= 0 or high == low:
            line.append(SPARK[0] if v <= 0 else SPARK[len(SPARK) // 2], style="cyan")
        else:
            level = round((math.log(v) - low) / (high - low) * (len(SPARK) - 1))
            line.append(SPARK[level], style="cyan")
    return line


def _bucket_max(bucket: list[float | None]) -> float | None:
    present = [v for v in bucket if v is not None]
    if not present:
        return None
    bad = [v for v in present if not math.isfinite(v)]
    return bad[0] if bad else max(present)


def _point_verdict(p: TrendPoint) -> Text:
    if p.is_nonfinite:
        return Text("non-finite", style="bold red")
    if p.spike:
        return Text("SPIKE", style="bold red")
    if p.z is None and not any(v is not None for v in p.group_z.values()):
        return Text("(history)", style="dim")
    return Text("ok", style="green")


def trend_verdict(report: TrendReport) -> str:
    """The last line of the table and Markdown reports, matching the exit code."""
    failing = report.failing
    if failing:
        kind = "non-finite gradients" if report.status == NONFINITE else "gradient spike"
        last = failing[-1]
        where = f"step {last.step}" if last.step is not None else visible(last.source)
        groups = ", ".join(visible(g) for g in (last.nonfinite_groups + last.spike_groups))
        detail = (f"{where}: total norm {fmt(last.total_norm)}, z {z_text(last.z)}"
                  + (f"; groups {groups}" if groups else ""))
        if report.fail_on == "newest":
            return f"FAIL: {kind} at the newest point ({detail}) (exit 1)"
        return (f"FAIL: {kind} at {len(failing)} point(s); the last at {detail} (exit 1)")
    if report.status == INSUFFICIENT_HISTORY:
        return ("OK: too little history to judge (a point needs 5 earlier points) (exit 0)")
    scope = "the newest point" if report.fail_on == "newest" else f"{len(report.points)} points"
    spikes = sum(p.spike for p in report.points)
    earlier = f"; {spikes} earlier spike(s)" if spikes and report.fail_on == "newest" else ""
    return f"OK: no spike or non-finite norm at {scope}{earlier} (exit 0)"


def render_trend(report: TrendReport, out: TextIO) -> None:
    console = _console(out)
    console.print(Text(
        f"{len(report.points)} points, {report.what}, p={fmt_p(report.norm_type)}, groups by "
        f"{visible(report.group_by)}; spike: z > {report.z_threshold:g} (alpha "
        f"{report.alpha:g}, warmup {report.warmup})"
    ))  # fmt: skip
    shown = points_to_show(report)
    table = Table(title="points (oldest first)", title_justify="left")
    for col, just in (("step", "right"), ("source", "left"), ("total norm", "right"),
                      ("z", "right"), ("", "left"), ("spiking groups", "left")):
        table.add_column(col, justify=just, overflow="fold")
    for p in shown:
        table.add_row("-" if p.step is None else str(p.step), Text(visible(p.source)),
                      fmt(p.total_norm), z_text(p.z), _point_verdict(p),
                      Text(", ".join(visible(g) for g in p.spike_groups + p.nonfinite_groups)))
    if len(shown) < len(report.points):
        table.add_section()
        table.add_row("", Text(f"... {len(report.points) - len(shown):,} unremarkable points "
                               "not shown (--format json lists all)", style="dim"),
                      "", "", "", "")
    console.print(table)

    series = [("total", [p.total_norm for p in report.points])]
    groups = report.groups
    ranked = sorted(groups, key=lambda g: -largest_norm(report, g))[:MAX_SPARK_GROUPS]
    series += [(g, [p.groups.get(g) for p in report.points]) for g in groups if g in ranked]
    if report.points:
        lines = Table(title="norms over time (log scale; ! non-finite)", title_justify="left")
        for col, just in (("series", "left"), ("min", "right"), ("max", "right"),
                          ("", "left")):
            lines.add_column(col, justify=just, no_wrap=col == "")
        for name, values in series:
            finite = [v for v in values if v is not None and math.isfinite(v)]
            lines.add_row(Text(visible(name)), fmt(min(finite, default=None)),
                          fmt(max(finite, default=None)), sparkline(values))
        if len(groups) > len(ranked):
            lines.add_row(Text(f"... {len(groups) - len(ranked)} smaller groups", style="dim"),
                          "", "", "")
        console.print(lines)
    failed = report.status in (NONFINITE, SPIKE)
    # One line whatever its length: scripts and people grep for it.
    console.print(Text(trend_verdict(report), style="bold red" if failed else "bold green"),
                  soft_wrap=True)


def largest_norm(report: TrendReport, group: str) -> float:
    norms = [p.groups[group] for p in report.points if group in p.groups]
    return max((math.inf if not math.isfinite(v) else v for v in norms), default=0.0)


# -- compare -------------------------------------------------------------------


def fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    return fmt(ratio) + "x" if math.isfinite(ratio) else fmt(ratio)


def compare_verdict(report: CompareReport) -> str:
    if report.status == NONFINITE:
        return "FAIL: a norm in A or B is NaN or inf (exit 1)"
    if report.status == EXCEEDED:
        names = ", ".join(visible(g.name) for g in report.beyond[:5])
        more = f" and {len(report.beyond) - 5} more" if len(report.beyond) > 5 else ""
        return (f"FAIL: {len(report.beyond)} group(s) changed by more than "
                f"{report.fail_above:g}x: {names}{more} (exit 1)")
    limit = f" within {report.fail_above:g}x" if report.fail_above is not None else ""
    return f"OK: total ratio {fmt_ratio(report.total.ratio)}{limit} (exit 0)"


def render_compare(report: CompareReport, out: TextIO) -> None:
    console = _console(out)
    console.print(Text(f"A: {visible(report.a)}\nB: {visible(report.b)}\n{report.what}, "
                       f"p={fmt_p(report.norm_type)}, groups by {visible(report.group_by)}; "
                       "largest change first"))
    table = Table(title="B / A per group", title_justify="left")
    for col, just in (("group", "left"), ("A", "right"), ("B", "right"), ("B / A", "right")):
        table.add_column(col, justify=just, overflow="fold")
    rows = report.groups[:MAX_GROUPS]
    for g in rows:
        flagged = report.fail_above is not None and g in report.beyond
        table.add_row(Text(visible(g.name)), fmt(g.a), fmt(g.b),
                      Text(fmt_ratio(g.ratio), style="bold red" if flagged else ""))
    if len(rows) < len(report.groups):
        table.add_row(Text(f"... {len(report.groups) - len(rows):,} groups that changed "
                           "less (--format json lists all)", style="dim"), "", "", "")
    table.add_section()
    t = report.total
    table.add_row(Text("total", style="bold"), fmt(t.a), fmt(t.b), fmt_ratio(t.ratio))
    console.print(table)
    failed = report.status != "ok"
    console.print(Text(compare_verdict(report), style="bold red" if failed else "bold green"),
                  soft_wrap=True)
