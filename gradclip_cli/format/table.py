"""``--format table`` (default): a report a person reads at a glance, drawn with rich.

Groups in checkpoint order with norm, share, max |g| (|w| for weights), size, non-finite counts
and a bar against the largest group; then the top tensors by norm and every
tensor holding non-finite values; then a one-line verdict matching the exit
code. rich decides colour: only on a terminal, never with NO_COLOR set.

The words (numbers, verdicts) come from ``words.py``, the rows shown from
``shown.py`` and the widths from ``fitting.py``; this module alone draws,
and alone imports rich (a ``--format json`` run never imports it).

Data is not markup. Names, keys, paths and metadata come from the file: each
is passed through ``visible`` (one inert line) and handed to rich as a
``Text`` on a console that parses no markup and no emoji codes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..report.model import NONFINITE, OK, SPIKE
from . import findings as F
from .fitting import (
    MIN_NAME_WIDTH,
    Column,
    fit,
    report_width,
    shorten,
    shown_columns,
    wrap,
    wrap_from_end,
)
from .shown import (
    MAX_GROUPS,
    MAX_SPARK_GROUPS,
    SPARK_WIDTH,
    groups_to_show,
    largest_norm,
    points_to_show,
    sparkline,
)
from .text import kept_visible, visible
from .words import (
    audit_lines,
    clip_summary,
    coef_lowered_line,
    compare_verdict,
    fmt,
    fmt_p,
    fmt_total,
    group_rule,
    judged_in,
    nonfinite_text,
    plural,
    point_groups,
    point_state,
    ratio_cell,
    trend_quantity,
    trend_verdict,
    verdict_line,
    z_text,
)

if TYPE_CHECKING:
    from ..report import ClipReport, InspectReport, NonFinite
    from ..report.compare import CompareReport, CompareRow
    from ..report.trend import TrendPoint, TrendReport

__all__ = ["MAX_GROUPS", "print_clip_summary", "print_compare_verdict", "print_findings",
           "print_trend_verdict", "print_verdict", "render_clip", "render_compare",
           "render_inspect", "render_trend", "render_verdict"]

BAR_WIDTH = 20


def _verdict_style(failed: bool) -> str:
    return "bold red" if failed else "bold green"


def _console(out: TextIO) -> Console:
    # markup=False and emoji=False: nothing in a str is ever interpreted; data
    # arrives as Text anyway. soft_wrap: lines are fitted here, rich never re-wraps them.
    return Console(file=out, width=report_width(out), highlight=False, markup=False,
                   emoji=False, soft_wrap=True)


def _print_prose(console: Console, text: str, style: str = "", indent: str = "  ") -> None:
    for line in wrap(text, console.width, indent):
        console.print(Text(line, style=style))


def _fit_table(title: str, columns: list[Column], width: int, footer: Sequence[int] = (),
               shorten_first: bool = False) -> Table:
    """A rich Table of ``columns`` as ``fitting.fit`` fits them to ``width``.

    ``footer``: row indices after which a section line goes.
    """
    fitted = fit(columns, width, shorten_first)
    table = Table(title=Text(shorten(title, width)), title_justify="left", box=box.HEAVY_HEAD)
    for col in fitted.shown:
        table.add_column(Text(col.header), justify=col.justify, no_wrap=True,
                         width=fitted.width(col), overflow="crop")
    rows = len(fitted.shown[0].cells) if fitted.shown else 0
    for i in range(rows):
        cells = []
        for col in fitted.shown:
            cell = col.cells[i]
            drawn = fitted.cell(col, cell)
            if isinstance(drawn, str):
                drawn = Text(drawn, style=cell.style if isinstance(cell, Text) else "")
            cells.append(drawn)
        table.add_row(*cells)
        if i in footer:
            table.add_section()
    return table


def _print_table(console: Console, table: Table) -> None:
    # Fitted above; below 60 columns a table may still be wider than the
    # console, and then it runs over rather than have rich crop a number.
    measured = console.measure(table, options=console.options.update_width(10_000)).maximum
    width = console.width
    console.width = max(width, measured)
    try:
        console.print(table)
    finally:
        console.width = width


def bar(value: float, largest: float) -> Text:
    if not math.isfinite(value):
        return Text("!" * BAR_WIDTH, style="bold red")
    if not (largest > 0 and math.isfinite(largest)):
        return Text("")
    filled = round(BAR_WIDTH * (value / largest))  # value * 20 could overflow
    return Text("█" * filled + "·" * (BAR_WIDTH - filled), style="cyan")


def _nonfinite_cell(n: NonFinite) -> Text:
    if not n.total:
        return Text("-", style="dim")
    return Text(nonfinite_text(n), style="bold red")


def print_verdict(report: InspectReport, out: TextIO) -> None:
    """The verdict alone (``--quiet``), fitted to the width like every line."""
    _print_verdict(_console(out), report)


def _print_verdict(console: Console, report: InspectReport) -> None:
    # Filled from the end: the last line, which scripts read, names what was judged.
    style = _verdict_style(report.status != OK)
    for line in wrap_from_end(verdict_line(report), console.width):
        console.print(Text(line, style=style))


def print_findings(report: InspectReport, err: TextIO) -> None:
    """Under ``--quiet``: each tensor behind a non-finite finding, one plain line on stderr."""
    if report.status != NONFINITE:
        return
    for t in report.tensors:
        if t.nonfinite.total:
            err.write(f"gradclip: {visible(t.name)}: {nonfinite_text(t.nonfinite)}\n")


def _header(report: InspectReport, width: int) -> list[str]:
    source = visible(report.source)
    details = [report.format]
    if report.key:
        details.append(f"key '{visible(report.key)}'")
    if report.step is not None:
        details.append(f"step {report.step}")
    details += [plural(report.num_tensors, "tensor"), plural(report.num_elements, "element"),
                f"p={fmt_p(report.norm_type)}", f"device {visible(report.device)}"]
    line = f"{source}  {', '.join(details)}"
    # The layout's own lines (files read, coverage) arrive escaped already.
    described = [part for text in (f"what: {visible(report.what)}", *report.description)
                 for part in wrap(text, width)]
    if cell_len(line) <= width:
        return [line, *described]
    return [shorten(source, width), *wrap(", ".join(details), width), *described]


def _groups_table(report: InspectReport, width: int) -> Table:
    shown = groups_to_show(report)
    largest = max((g.norm for g in report.groups if math.isfinite(g.norm)), default=0.0)
    names: list[str | Text] = [visible(g.name) for g in shown]
    norms: list[str | Text] = [fmt(g.norm) for g in shown]
    shares: list[str | Text] = ["-" if math.isnan(g.share) else f"{100 * g.share:.1f}%"
                                for g in shown]
    maxes: list[str | Text] = [fmt(g.max_abs) for g in shown]
    with_ratio = any(g.ratio is not None for g in report.groups)
    ratios: list[str | Text] = [fmt(g.ratio) for g in shown] + [""]
    sizes: list[str | Text] = [f"{g.num_elements:,}" for g in shown]
    flags: list[str | Text] = [_nonfinite_cell(g.nonfinite) for g in shown]
    bars: list[str | Text] = [bar(g.norm, largest) for g in shown]
    names.append(Text("total", style="bold"))
    norms.append(Text(fmt_total(report), style="bold"))
    shares.append("100%" if report.total_norm else "-")
    maxes.append(fmt(report.max_abs))
    sizes.append(f"{report.num_elements:,}")
    flags.append(_nonfinite_cell(report.nonfinite))
    bars.append("")
    any_nonfinite = report.nonfinite.total > 0
    # Narrow terminals lose the least telling columns first: the sizes, then the
    # largest magnitude, then the ratio; share and the bar answer "which layer" and go
    # last (before them, only the names are shortened further).
    columns = [
        Column("group", names, justify="left", name=True),
        Column("norm", norms),
        Column("share", shares, drop=5),
        Column(judged_in(report).max_header, maxes, drop=2),
        *([Column("ratio", ratios, drop=3)] if with_ratio else []),
        Column("elements", sizes, drop=1),
        Column("non-finite", flags, justify="left", drop=0 if any_nonfinite else 1,
               wrap_at=", "),
        Column("", bars, justify="left", drop=4),
    ]
    last_group = len(shown) - 1
    title = f"groups (by {visible(report.group_by)})"
    return _fit_table(title, columns, width, footer=(last_group,))


def _top_table(report: InspectReport, top: int, width: int) -> Table:
    ranked = sorted(report.tensors, key=lambda t: -t.norm if math.isfinite(t.norm) else -math.inf)
    rows = ranked[:top]
    columns = [
        Column("tensor", [visible(t.name) for t in rows], justify="left", name=True),
        Column("norm", [fmt(t.norm) for t in rows]),
        Column(judged_in(report).max_header, [fmt(t.max_abs) for t in rows], drop=3),
        Column("shape", ["x".join(map(str, t.shape)) or "scalar" for t in rows],
               justify="left", drop=1),
        Column("dtype", [visible(t.dtype) for t in rows], justify="left", drop=2),
    ]
    return _fit_table(f"top {plural(len(rows), 'tensor')} by norm", columns, width)


def render_inspect(report: InspectReport, out: TextIO, *, top: int = 5) -> None:
    console = _console(out)
    width = console.width
    header = _header(report, width)
    console.print(Text(header[0], style="bold"))
    for line in header[1:]:
        console.print(Text(line))
    if report.skipped:
        names = ", ".join(shorten(visible(s), 40) for s in report.skipped[:5])
        more = " ..." if len(report.skipped) > 5 else ""
        count = plural(len(report.skipped), "non-floating entry", "non-floating entries")
        _print_prose(console, f"skipped {count}: {names}{more}")
    _print_table(console, _groups_table(report, width))
    hidden = len(report.groups) - len(groups_to_show(report))
    if hidden:
        _print_prose(console, f"... {hidden:,} smaller groups not shown (--format json lists "
                              "all)", style="dim")
    if top > 0 and report.tensors:
        _print_table(console, _top_table(report, top, width))

    bad = [t for t in report.tensors if t.nonfinite.total]
    if bad:
        console.print(Text(f"non-finite values in {plural(len(bad), 'tensor')}:",
                           style="bold red"))
        for t in bad:
            counts = nonfinite_text(t.nonfinite)
            name = shorten(visible(t.name), max(width - 4 - cell_len(counts), MIN_NAME_WIDTH))
            line = Text(f"  {name}: ")
            line.append_text(_nonfinite_cell(t.nonfinite))
            console.print(line)
    for t in report.tensors:
        if t.tied:
            names = [shorten(visible(n), max(width // 2, MIN_NAME_WIDTH)) for n in t.tied]
            text = (f"tied (counted once): {shorten(visible(t.name), max(width // 2, 12))} = "
                    + ", ".join(names))
            _print_prose(console, text, style="dim")
    for t in report.tensors:
        if t.shares:
            names = [shorten(visible(n), max(width // 2, MIN_NAME_WIDTH)) for n in t.shares]
            text = (f"shares elements (each counted once): "
                    f"{shorten(visible(t.name), max(width // 2, 12))} with " + ", ".join(names))
            _print_prose(console, text, style="dim")
    _print_verdict(console, report)


def print_clip_summary(report: ClipReport, out: TextIO) -> None:
    """Under ``--quiet``: the one line that says what was done."""
    _print_prose(_console(out), clip_summary(report))


def render_clip(report: ClipReport, out: TextIO) -> None:
    console = _console(out)
    width = console.width
    source, output = visible(report.source), visible(report.output)
    line = f"{source} -> {output}"
    if cell_len(line) <= width:
        console.print(Text(line, style="bold"))
    else:
        console.print(Text(shorten(source, width), style="bold"))
        console.print(Text(shorten(f"-> {output}", width), style="bold"))
    _print_prose(console, clip_summary(report))
    for note in report.notes:  # escaped where made
        _print_prose(console, note)
    lowered = coef_lowered_line(report)
    if lowered is not None:
        _print_prose(console, lowered)
    if report.unshared:
        entries = plural(len(report.unshared), "non-gradient entry", "non-gradient entries")
        _print_prose(console, f"kept the values of {entries}"
                              " that shared storage with a gradient (now stored separately): "
                              + ", ".join(visible(n) for n in report.unshared))
    if report.nonfinite.total:
        _print_prose(console, "warning: gradients holding "
                              f"{plural(report.nonfinite.total, 'non-finite value')} "
                              "were clipped under --allow-nonfinite", style="yellow")
    if report.other_links_unchanged:
        _print_prose(console, f"note: {visible(report.output)} had "
                              f"{plural(report.other_links_unchanged, 'other hard link')}, which "
                              "still hold the old bytes (the atomic replace gives this name a "
                              "new file)", style="yellow")


def _point_verdict(p: TrendPoint) -> Text:
    state = point_state(p)
    style = {"non-finite": "bold red", "SPIKE": "bold red", "(history)": "dim"}.get(state, "green")
    return Text(state, style=style)


def _spark(values: list[float | None], width: int = SPARK_WIDTH) -> Text:
    """``shown.sparkline`` drawn: ``!`` (non-finite) in red, the rest in cyan."""
    line = Text()
    for ch in sparkline(values, width):
        line.append(ch, style="bold red" if ch == "!" else "" if ch == " " else "cyan")
    return line


def render_trend(report: TrendReport, out: TextIO) -> None:
    console = _console(out)
    width = console.width
    _print_prose(console,
                 f"{len(report.points)} points, {trend_quantity(report)}, "
                 f"groups by {visible(report.group_by)}; spike: z > {report.z_threshold:g} "
                 f"({group_rule(report.group_thresholds())}"
                 f"alpha {report.alpha:g}, warmup {report.warmup})")
    for note in report.notes:  # where each series came from, ...: escaped where made
        _print_prose(console, kept_visible(note))
    for line in audit_lines(report):  # already made visible
        _print_prose(console, line)
    shown = points_to_show(report)
    columns = [
        Column("step", ["-" if p.step is None else str(p.step) for p in shown]),
        Column("source", [visible(p.source) for p in shown], justify="left", name=True),
        Column(judged_in(report).total, [fmt(p.total_norm) for p in shown]),
        Column("z", [z_text(p.z) for p in shown]),
        Column("", [_point_verdict(p) for p in shown], justify="left"),
        Column("spiking groups", [point_groups(p) for p in shown], justify="left", name=True,
               wrap_at=", ", drop=1),
    ]
    _print_table(console, _fit_table("points (oldest first)", columns, width,
                                     shorten_first=True))
    if columns[-1] not in shown_columns(columns, width, shorten_first=True):
        # Too narrow for the column: each point's groups on a line of their own.
        for p in shown:
            if point_groups(p):
                where = f"step {p.step}" if p.step is not None else visible(p.source)
                _print_prose(console, f"{where}: {point_groups(p)}")
    if len(shown) < len(report.points):
        _print_prose(console, f"... {len(report.points) - len(shown):,} unremarkable points "
                              "not shown (--format json lists all)", style="dim")

    groups = report.groups
    ranked = sorted(groups, key=lambda g: -largest_norm(report, g))[:MAX_SPARK_GROUPS]
    series = [("total", [p.total_norm for p in report.points])]
    series += [(g, [p.groups.get(g) for p in report.points]) for g in groups if g in ranked]
    if report.points:
        finite = [[v for v in values if v is not None and math.isfinite(v)]
                  for _, values in series]
        names = [visible(name) for name, _ in series]
        lows = [fmt(min(f, default=None)) for f in finite]
        highs = [fmt(max(f, default=None)) for f in finite]
        # The sparkline takes the room the other columns leave (4 columns: 13 cells
        # of borders and padding), so a narrow terminal folds the series further.
        room = (width - 13 - max(map(cell_len, ["series", *names]))
                - max(map(cell_len, ["min", *lows])) - max(map(cell_len, ["max", *highs])))
        spark_width = max(8, min(SPARK_WIDTH, room))
        columns = [
            Column("series", names, justify="left", name=True),
            Column("min", lows),
            Column("max", highs),
            Column("", [_spark(values, spark_width) for _, values in series],
                   justify="left"),
        ]
        over_time = "norms" if report.tag is None else "values"  # a tag --tag named
        _print_table(console, _fit_table(f"{over_time} over time (log scale; ! non-finite)",
                                         columns, width, shorten_first=True))
        if len(groups) > len(ranked):
            _print_prose(console, f"... {len(groups) - len(ranked)} smaller groups", style="dim")
    failed = report.status in (NONFINITE, SPIKE) or bool(report.disagreeing)
    # One line whatever its length: scripts and people grep for it.
    console.print(Text(trend_verdict(report), style="bold red" if failed else "bold green"),
                  soft_wrap=True)


def render_compare(report: CompareReport, out: TextIO) -> None:
    console = _console(out)
    width = console.width
    for side, path in (("A", report.a), ("B", report.b)):
        console.print(Text(f"{side}: {shorten(visible(path), max(width - 3, MIN_NAME_WIDTH))}"))
    _print_prose(console, f"{report.what}, p={fmt_p(report.norm_type)}, groups by "
                          f"{visible(report.group_by)}; largest change first")
    for note in report.notes:  # escaped where made
        _print_prose(console, note)
    rows = [*report.groups[:MAX_GROUPS], report.total]

    def flagged(g: CompareRow) -> bool:
        if g is report.total:
            return report.total_beyond
        return report.fail_above is not None and (g in report.beyond or g.only is not None)

    names: list[str | Text] = [visible(g.name) for g in rows[:-1]]
    names.append(Text("total", style="bold"))
    columns = [
        Column("group", names, justify="left", name=True),
        Column("A", [fmt(g.a) for g in rows]),
        Column("B", [fmt(g.b) for g in rows]),
        Column("B / A", [Text(ratio_cell(g), style="bold red" if flagged(g) else "")
                         for g in rows]),
    ]
    _print_table(console, _fit_table("B / A per group", columns, width,
                                     footer=(len(rows) - 2,), shorten_first=True))
    if len(report.groups) > MAX_GROUPS:
        _print_prose(console, f"... {len(report.groups) - MAX_GROUPS:,} groups that changed "
                              "less (--format json lists all)", style="dim")
    failed = report.status != "ok"
    console.print(Text(compare_verdict(report), style="bold red" if failed else "bold green"),
                  soft_wrap=True)


def _print_quiet(verdict: str, failed: bool, found: list, out: TextIO, err: TextIO | None
                 ) -> None:
    if err is not None:
        for f in found:
            if f.severity == F.ERROR:
                err.write(f"gradclip: {visible(f.message)}\n")
    console = _console(out)
    console.print(Text(verdict, style="bold red" if failed else "bold green"), soft_wrap=True)


def print_trend_verdict(report: TrendReport, out: TextIO, err: TextIO | None) -> None:
    _print_quiet(trend_verdict(report),
                 report.status in (NONFINITE, SPIKE) or bool(report.disagreeing),
                 F.trend_findings(report), out, err)


def print_compare_verdict(report: CompareReport, out: TextIO, err: TextIO | None) -> None:
    _print_quiet(compare_verdict(report), report.status != "ok", F.compare_findings(report),
                 out, err)


def render_autopsy(report, out: TextIO) -> None:
    """Ranked groups (onset, lead, each quantity's change, outliers, the series around the
    spike as a sparkline), then the verdict paragraph."""
    from . import autopsy_rows as A

    console = _console(out)
    width = console.width
    for line in A.header(report):
        _print_prose(console, line)
    rows = A.shown(report)
    if rows:
        quantities = A.quantities(report)
        columns = [
            Column("#", [str(g.rank) for g in rows]),
            Column("group", [visible(g.name) for g in rows], justify="left", name=True),
            Column("onset", [A.onset_text(g) for g in rows], justify="left"),
            Column("lead", [A.lead_text(g) for g in rows]),
            # The weights barely move in a step: the first column a narrow terminal drops.
            *(Column(A.heading(q), [A.change_text(g, q) for g in rows],
                     drop=1 if q == "weights" else 0) for q in quantities),
            Column("outliers", [A.outliers_text(g) for g in rows]),
            Column("around the spike", [_spark(list(g.around[-A.SPARK_AROUND:]), 24)
                                        for g in rows], justify="left", drop=2),
        ]
        title = (f"groups, earliest onset first (changes across step {report.step}; "
                 "series: log scale, ! non-finite)")
        _print_table(console, _fit_table(title, columns, width, shorten_first=True))
        if len(report.groups) > len(rows):
            _print_prose(console, f"... {len(report.groups) - len(rows):,} more groups "
                                  "(--format json lists all)", style="dim")
    failed = report.status == "explained"
    _print_prose(console, visible(report.verdict), style="bold red" if failed else "bold green",
                 indent="")


def print_autopsy_verdict(report, out: TextIO) -> None:
    console = _console(out)
    console.print(Text(visible(report.verdict), style="bold red" if report.status == "explained"
                       else "bold green"), soft_wrap=True)


def render_verdict(report, out: TextIO, err: TextIO | None) -> None:
    """``-q``: the verdict line alone on ``out``; where the report has findings, each a
    plain line on ``err`` (None: nowhere)."""
    from ..report import ClipReport, InspectReport
    from ..report.autopsy import AutopsyReport
    from ..report.compare import CompareReport
    from ..report.trend import TrendReport

    if isinstance(report, InspectReport):
        if err is not None:
            print_findings(report, err)
        print_verdict(report, out)
    elif isinstance(report, ClipReport):
        print_clip_summary(report, out)
    elif isinstance(report, TrendReport):
        print_trend_verdict(report, out, err)
    elif isinstance(report, CompareReport):
        print_compare_verdict(report, out, err)
    elif isinstance(report, AutopsyReport):
        print_autopsy_verdict(report, out)
    else:
        raise TypeError(f"no verdict line for a {type(report).__name__}")
