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
    console.print(
        f"[bold]{report.source}[/bold]  {report.format}{key}, {report.num_tensors} tensors, "
        f"{report.num_elements:,} elements, p={p}, device {report.device}"
    )
    if report.skipped:
        console.print(f"skipped {len(report.skipped)} non-floating entr"
                      f"{'y' if len(report.skipped) == 1 else 'ies'}: "
                      + ", ".join(report.skipped[:5]) + (" ..." if len(report.skipped) > 5 else ""))

    table = Table(title=f"groups (by {report.group_by})", title_justify="left")
    # The bar is the first thing to go on a narrow terminal; names never are.
    show_bar = console.width >= 100
    columns = [("group", "left"), ("norm", "right"), ("share", "right"), ("max |g|", "right"),
               ("elements", "right"), ("non-finite", "left")] + ([("", "left")] if show_bar else [])
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=col != "group",
                         min_width=min(40, max(len(g.name) for g in report.groups))
                         if col == "group" else None)
    largest = max((g.norm for g in report.groups if math.isfinite(g.norm)), default=0.0)
    shown = _groups_to_show(report)
    for g in shown:
        share = "-" if math.isnan(g.share) else f"{100 * g.share:.1f}%"
        cells = [g.name, fmt(g.norm), share, fmt(g.max_abs), f"{g.num_elements:,}",
                 _nonfinite_cell(g.nonfinite)]
        table.add_row(*cells, *([bar(g.norm, largest)] if show_bar else []))
    table.add_section()
    if len(shown) < len(report.groups):
        hidden = len(report.groups) - len(shown)
        table.add_row(Text(f"... {hidden:,} smaller groups not shown (--format json lists all)",
                           style="dim"), *[""] * (len(columns) - 1))
    table.add_row(Text("total", style="bold"), Text(fmt(report.total_norm), style="bold"),
                  "100%" if report.total_norm else "-", fmt(report.max_abs),
                  f"{report.num_elements:,}", _nonfinite_cell(report.nonfinite),
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
