"""How ``--format table`` draws with rich; imported only when a table is drawn.

See ``table.py`` for what the table shows and how it fits the width.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..report.model import EXCEEDED, INSUFFICIENT_HISTORY, NONFINITE, OVERFLOW, SPIKE
from . import findings as F
from .findings import z_text
from .text import visible

if TYPE_CHECKING:
    from ..report import ClipReport, InspectReport, NonFinite
    from ..report.compare import CompareReport, CompareRow
    from ..report.trend import TrendPoint, TrendReport

BAR_WIDTH = 20
# More groups than a person reads (and rich renders 20,000 rows slowly): show
# the largest, and any holding NaN/inf, in checkpoint order.
MAX_GROUPS = 60
# Pipes and CI logs get this width when COLUMNS is unset (rich would use 80).
PIPE_WIDTH = 120
ELLIPSIS = "…"
# A name column narrower than this shows too little to tell names apart.
MIN_NAME_WIDTH = 12


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


def plural(count: int, singular: str, many: str | None = None) -> str:
    """``1 tensor``, ``2 tensors``, ``1,000 entries``."""
    word = singular if count == 1 else (many or singular + "s")
    return f"{count:,} {word}"


def shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, its middle replaced by an ellipsis if needed."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    keep = width - 1
    head, tail = "", ""
    # Grow both ends alternately (the tail gets the odd cell: the end of a name
    # says which parameter it is) until the next character would not fit.
    left, right = 0, len(text)
    while left < right:
        take_tail = cell_len(tail) <= cell_len(head)
        ch = text[right - 1] if take_tail else text[left]
        if cell_len(head) + cell_len(tail) + cell_len(ch) > keep:
            break
        if take_tail:
            tail, right = ch + tail, right - 1
        else:
            head, left = head + ch, left + 1
    return head + ELLIPSIS + tail


def wrap(text: str, width: int, indent: str = "  ") -> list[str]:
    """Prose split between words into lines of at most ``width`` cells (a word never breaks)."""
    lines = textwrap.wrap(text, width=width, subsequent_indent=indent,
                          break_long_words=False, break_on_hyphens=False)
    return lines or [""]


def report_width(out: TextIO) -> int:
    """``COLUMNS`` when set (in pipes too); else the terminal's width; else ``PIPE_WIDTH``."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        try:
            return os.get_terminal_size(out.fileno()).columns
        except (AttributeError, OSError, ValueError):
            pass
    return PIPE_WIDTH


def _console(out: TextIO) -> Console:
    # markup=False and emoji=False: nothing in a str is ever interpreted; data
    # arrives as Text anyway. soft_wrap: lines are fitted here, rich never re-wraps them.
    return Console(file=out, width=report_width(out), highlight=False, markup=False,
                   emoji=False, soft_wrap=True)


def _print_prose(console: Console, text: str, style: str = "", indent: str = "  ") -> None:
    for line in wrap(text, console.width, indent):
        console.print(Text(line, style=style))


@dataclass
class Column:
    header: str
    cells: list[str | Text]
    justify: str = "right"
    drop: int = 0  # 0: always shown; else dropped in increasing order when space is short
    name: bool = False  # the one column whose cells may be shortened
    wrap_at: str | None = None  # cells may break into lines after this separator


def _parts(cell: str | Text, sep: str) -> list[str]:
    text = cell.plain if isinstance(cell, Text) else cell
    pieces = text.split(sep)
    return [piece + sep for piece in pieces[:-1]] + pieces[-1:]


def _narrowest(col: Column) -> int:
    """The least width a column takes without breaking inside a number or word."""
    if col.wrap_at is None:
        return max([cell_len(col.header), *(_cell_width(c) for c in col.cells)])
    parts = [cell_len(part.rstrip()) for c in col.cells for part in _parts(c, col.wrap_at)]
    return max([cell_len(col.header), *parts])


def _wrapped(cell: str | Text, sep: str, width: int) -> Text:
    lines: list[str] = []
    for part in _parts(cell, sep):
        if lines and cell_len(lines[-1] + part.rstrip()) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    style = cell.style if isinstance(cell, Text) else ""
    return Text("\n".join(line.rstrip() for line in lines), style=style)


def _cell_width(cell: str | Text) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(cell)


def _overhead(cols: list[Column]) -> int:
    # Box-drawing overhead: a border left of every column and one at the end,
    # and one space of padding on each side of every cell.
    return 3 * len(cols) + 1


def _natural(col: Column) -> int:
    return max([cell_len(col.header), *(_cell_width(c) for c in col.cells)])


def _least(col: Column) -> int:
    """The least width a name column is shortened to (a shorter name tells too little)."""
    return min(_natural(col), MIN_NAME_WIDTH)


def shown_columns(columns: list[Column], width: int, shorten_first: bool = False
                  ) -> list[Column]:
    """The columns that fit ``width``: optional ones go, in increasing ``drop`` order,
    while the table is too wide with names at their full width (``shorten_first``:
    at their least width, so names are shortened before a column goes)."""
    shown = list(columns)

    def needed(cols: list[Column]) -> int:
        return sum(_least(c) if c.name and shorten_first else _natural(c)
                   for c in cols) + _overhead(cols)

    for rank in sorted({c.drop for c in columns if c.drop}):
        if needed(shown) <= width:
            break
        shown = [c for c in shown if c.drop != rank]
    return shown


def _fit_table(title: str, columns: list[Column], width: int, footer: Sequence[int] = (),
               shorten_first: bool = False) -> Table:
    """A rich Table of ``columns`` that is at most ``width`` cells wide (from 60 up).

    Optional columns go first (``shown_columns``); what still does not fit
    comes out of the name columns (``name=True``), the widest first, each
    shortened in the middle. ``footer``: row indices after which a section line goes.
    """
    shown = shown_columns(columns, width, shorten_first)
    names = [c for c in shown if c.name]
    widths = {id(c): _natural(c) for c in shown}
    room = width - _overhead(shown) - sum(widths[id(c)] for c in shown if not c.name)
    least_names = sum(_least(c) for c in names)
    for col in shown:  # still short: break cells that may break (after a separator)
        if room >= least_names:
            break
        if col.wrap_at is not None:
            give = min(widths[id(col)] - _narrowest(col), least_names - room)
            widths[id(col)] -= give
            room += give
    # Take what does not fit from the widest name column, one cell at a time.
    while sum(widths[id(c)] for c in names) > room:
        widest = max(names, key=lambda c: widths[id(c)] - _least(c))
        if widths[id(widest)] <= _least(widest):
            break
        widths[id(widest)] -= 1
    table = Table(title=Text(shorten(title, width)), title_justify="left", box=box.HEAVY_HEAD)
    for col in shown:
        w = widths[id(col)]
        table.add_column(Text(col.header), justify=col.justify, no_wrap=True, width=w,
                         overflow="crop")
    rows = len(shown[0].cells) if shown else 0
    for i in range(rows):
        cells = []
        for col in shown:
            cell = col.cells[i]
            if col.name and isinstance(cell, str):
                cell = shorten(cell, widths[id(col)])
            elif col.wrap_at is not None and _cell_width(cell) > widths[id(col)]:
                cell = _wrapped(cell, col.wrap_at, widths[id(col)])
            cells.append(cell if isinstance(cell, Text) else Text(cell))
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


def _nonfinite_text(n: NonFinite) -> str:
    parts = [f"{c} {label}" for c, label in ((n.nan, "nan"), (n.posinf, "+inf"),
                                             (n.neginf, "-inf")) if c]
    return ", ".join(parts)


def _nonfinite_cell(n: NonFinite) -> Text:
    if not n.total:
        return Text("-", style="dim")
    return Text(_nonfinite_text(n), style="bold red")


# How a total beyond float64's range is shown (its float64 rounding is inf).
BEYOND_FLOAT64 = "> 1.8e308"


def fmt_total(report: InspectReport) -> str:
    return BEYOND_FLOAT64 if report.overflow else fmt(report.total_norm)


def verdict_line(report: InspectReport) -> Text:
    p = fmt_p(report.norm_type)
    if report.status == NONFINITE and report.allow_nonfinite:
        return Text(
            f"FAIL: total norm {fmt(report.total_norm)} (p={p}): --max-norm "
            f"{fmt(report.max_norm)} could not be checked; non-finite values allowed by "
            "--allow-nonfinite (exit 1)",
            style="bold red",
        )
    if report.status == OVERFLOW:
        about = report.total_norm_log10
        about = f"about 10^{about:.6g}, " if about is not None and math.isfinite(about) else ""
        return Text(
            f"FAIL: total norm {BEYOND_FLOAT64} ({about}p={p}) is beyond float64's range "
            "(exit 1)",
            style="bold red",
        )
    if report.status == NONFINITE:
        n = report.nonfinite
        tensors = sum(1 for t in report.tensors if t.nonfinite.total)
        return Text(
            f"FAIL: non-finite gradients: {n.nan} NaN, {n.posinf} +inf, {n.neginf} -inf "
            f"in {plural(tensors, 'tensor')}; total norm {fmt(report.total_norm)} (exit 1)",
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
        note = (f"; {plural(report.nonfinite.total, 'non-finite value')} allowed by "
                "--allow-nonfinite")
    limit = f" <= --max-norm {fmt(report.max_norm)}" if report.max_norm is not None else ""
    return Text(f"OK: total norm {fmt(report.total_norm)} (p={p}){limit}{note} (exit 0)",
                style="bold green")


def print_verdict(report: InspectReport, out: TextIO) -> None:
    """The verdict alone (``--quiet``), fitted to the width like every line."""
    console = _console(out)
    line = verdict_line(report)
    _print_prose(console, line.plain, style=str(line.style))


def print_findings(report: InspectReport, err: TextIO) -> None:
    """Under ``--quiet``: each tensor behind a non-finite finding, one plain line on stderr."""
    if report.status != NONFINITE:
        return
    for t in report.tensors:
        if t.nonfinite.total:
            err.write(f"gradclip: {visible(t.name)}: {_nonfinite_text(t.nonfinite)}\n")


def _groups_to_show(report: InspectReport):
    groups = report.groups
    if len(groups) <= MAX_GROUPS:
        return groups

    def size(g):
        return math.inf if not math.isfinite(g.norm) else g.norm

    keep = {id(g) for g in sorted(groups, key=size, reverse=True)[:MAX_GROUPS]}
    return [g for g in groups if id(g) in keep]


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
    shown = _groups_to_show(report)
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
    columns = [
        Column("group", names, justify="left", name=True),
        Column("norm", norms),
        Column("share", shares, drop=2),
        Column("max |g|", maxes),
        *([Column("ratio", ratios)] if with_ratio else []),
        Column("elements", sizes, drop=3),
        Column("non-finite", flags, justify="left", drop=0 if any_nonfinite else 3,
               wrap_at=", "),
        Column("", bars, justify="left", drop=1),
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
        Column("max |g|", [fmt(t.max_abs) for t in rows], drop=3),
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
    hidden = len(report.groups) - len(_groups_to_show(report))
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
            counts = _nonfinite_text(t.nonfinite)
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
    line = verdict_line(report)
    _print_prose(console, line.plain, style=str(line.style))


def _clip_summary(report: ClipReport) -> str:
    if report.clip_value is not None:
        what = f"clamped every element to [-{fmt(report.clip_value)}, {fmt(report.clip_value)}]"
    elif report.clip_coef is not None and math.isnan(report.clip_coef):
        what = "scaled by nan: every gradient element is now NaN, as torch's clip_grad_norm_ does"
    elif report.clipped:
        what = f"scaled by {_fmt_coef(report)}"
    else:
        what = "unchanged: the total norm is within --max-norm"
    before = BEYOND_FLOAT64 if report.overflow else fmt(report.total_norm_before)
    return (f"total norm (p={fmt_p(report.norm_type)}): {before} -> "
            f"{fmt(report.total_norm_after)}; {plural(report.num_tensors, 'tensor')} {what}")


def _fmt_coef(report: ClipReport) -> str:
    # A coefficient below float64's range still scaled exactly (as factors).
    if report.clip_coef == 0.0 and report.clip_coef_log2 is not None \
            and math.isfinite(report.clip_coef_log2):
        return f"2^{report.clip_coef_log2:.6g}"
    return fmt(report.clip_coef)


def print_clip_summary(report: ClipReport, out: TextIO) -> None:
    """Under ``--quiet``: the one line that says what was done."""
    _print_prose(_console(out), _clip_summary(report))


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
    _print_prose(console, _clip_summary(report))
    if report.coef_lowered:
        torch_coef, coef = fmt(report.clip_coef_torch), fmt(report.clip_coef)
        if torch_coef == coef:  # six digits hide a change of a few units in the last place
            torch_coef, coef = f"{report.clip_coef_torch:.17g}", f"{report.clip_coef:.17g}"
        _print_prose(console, f"coefficient lowered from {torch_coef} (torch's) to {coef}: "
                              "rounded to the stored dtype, the clipped total would exceed "
                              "--max-norm")
    if report.unshared:
        entries = plural(len(report.unshared), "non-gradient entry", "non-gradient entries")
        _print_prose(console, f"kept the values of {entries}"
                              " that shared storage with a gradient (now stored separately): "
                              + ", ".join(visible(n) for n in report.unshared))
    if report.nonfinite.total:
        _print_prose(console, f"warning: {plural(report.nonfinite.total, 'non-finite value')} "
                              "were clipped under --allow-nonfinite", style="yellow")
    if report.other_links_unchanged:
        _print_prose(console, f"note: {visible(report.output)} had "
                              f"{plural(report.other_links_unchanged, 'other hard link')}, which "
                              "still hold the old bytes (the atomic replace gives this name a "
                              "new file)", style="yellow")


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


def _point_groups(p: TrendPoint) -> str:
    return ", ".join(visible(g) for g in p.spike_groups + p.nonfinite_groups)


def trend_verdict(report: TrendReport) -> str:
    """The last line of the table and Markdown reports, matching the exit code."""
    failing = report.failing
    if failing:
        measured = "gradients" if report.what == "grads" else report.what
        kind = (f"non-finite {measured}" if report.status == NONFINITE
                else "gradient spike" if report.what == "grads" else f"{report.what} spike")
        last = failing[-1]
        where = f"step {last.step}" if last.step is not None else visible(last.source)
        groups = ", ".join(visible(g) for g in (last.nonfinite_groups + last.spike_groups))
        detail = (f"{where}: total norm {fmt(last.total_norm)}, z {z_text(last.z)}"
                  + (f"; groups {groups}" if groups else ""))
        if report.fail_on == "newest":
            return f"FAIL: {kind} at the newest point ({detail}){_earlier(report)} (exit 1)"
        return (f"FAIL: {kind} at {len(failing)} point(s); the last at {detail} (exit 1)")
    if report.status == INSUFFICIENT_HISTORY:
        return ("OK: too little history to judge (a point needs 5 earlier points)"
                f"{_earlier(report)} (exit 0)")
    scope = "the newest point" if report.fail_on == "newest" else f"{len(report.points)} points"
    return f"OK: no spike or non-finite norm at {scope}{_earlier(report)} (exit 0)"


def _steps(points: list[TrendPoint]) -> str:
    where = [str(p.step) if p.step is not None else visible(p.source) for p in points[:5]]
    more = f" and {len(points) - 5} more" if len(points) > 5 else ""
    return ("step " if len(points) == 1 else "steps ") + ", ".join(where) + more


def _earlier(report: TrendReport) -> str:
    """Under ``--fail-on newest``: the earlier spikes and non-finite points, which do not
    fail the run but must not go unsaid (a NaN step a run recovered from, say)."""
    if report.fail_on != "newest":
        return ""
    earlier = report.points[:-1]
    nonfinite = [p for p in earlier if p.is_nonfinite]
    spikes = [p for p in earlier if p.spike and not p.is_nonfinite]
    parts = [f"{len(nonfinite)} non-finite ({_steps(nonfinite)})" if nonfinite else "",
             f"{len(spikes)} spike(s) ({_steps(spikes)})" if spikes else ""]
    said = [part for part in parts if part]
    return f"; earlier: {', '.join(said)}" if said else ""


def render_trend(report: TrendReport, out: TextIO) -> None:
    console = _console(out)
    width = console.width
    _print_prose(console,
                 f"{len(report.points)} points, {report.what}, p={fmt_p(report.norm_type)}, "
                 f"groups by {visible(report.group_by)}; spike: z > {report.z_threshold:g} "
                 f"(alpha {report.alpha:g}, warmup {report.warmup})")
    for note in report.notes:  # where each series of a run folder came from
        _print_prose(console, visible(note))
    shown = points_to_show(report)
    columns = [
        Column("step", ["-" if p.step is None else str(p.step) for p in shown]),
        Column("source", [visible(p.source) for p in shown], justify="left", name=True),
        Column("total norm", [fmt(p.total_norm) for p in shown]),
        Column("z", [z_text(p.z) for p in shown]),
        Column("", [_point_verdict(p) for p in shown], justify="left"),
        Column("spiking groups", [_point_groups(p) for p in shown], justify="left", name=True,
               drop=1),
    ]
    _print_table(console, _fit_table("points (oldest first)", columns, width,
                                     shorten_first=True))
    if columns[-1] not in shown_columns(columns, width, shorten_first=True):
        # Too narrow for the column: each point's groups on a line of their own.
        for p in shown:
            if _point_groups(p):
                where = f"step {p.step}" if p.step is not None else visible(p.source)
                _print_prose(console, f"{where}: {_point_groups(p)}")
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
            Column("", [sparkline(values, spark_width) for _, values in series],
                   justify="left"),
        ]
        _print_table(console, _fit_table("norms over time (log scale; ! non-finite)", columns,
                                         width, shorten_first=True))
        if len(groups) > len(ranked):
            _print_prose(console, f"... {len(groups) - len(ranked)} smaller groups", style="dim")
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


def ratio_cell(row: CompareRow) -> str:
    """The B / A cell: the ratio, or which side alone holds the group."""
    if row.only is not None:
        return f"only in {row.only.upper()}"
    return fmt_ratio(row.ratio)


def _names(rows: list[CompareRow], label=lambda g: visible(g.name)) -> str:
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    return ", ".join(label(g) for g in rows[:5]) + more


def compare_verdict(report: CompareReport) -> str:
    if report.status == NONFINITE:
        return "FAIL: a norm in A or B is NaN or inf (exit 1)"
    if report.status == EXCEEDED:
        limit = f"{report.fail_above:g}x"
        parts = []
        if report.total_beyond:
            parts.append(f"the total changed {fmt_ratio(report.total.ratio)}, beyond {limit}")
        if report.beyond:
            parts.append(f"{len(report.beyond)} group(s) changed by more than {limit}: "
                         f"{_names(report.beyond)}")
        if report.one_sided:
            parts.append(f"{len(report.one_sided)} group(s) on one side only: "
                         + _names(report.one_sided,
                                  lambda g: f"{visible(g.name)} ({g.only.upper()} only)"))
        return f"FAIL: {'; '.join(parts)} (exit 1)"
    limit = f" within {report.fail_above:g}x" if report.fail_above is not None else ""
    alone = (f"; {len(report.one_sided)} group(s) on one side only"
             if report.one_sided else "")
    return f"OK: total ratio {fmt_ratio(report.total.ratio)}{limit}{alone} (exit 0)"


def render_compare(report: CompareReport, out: TextIO) -> None:
    console = _console(out)
    width = console.width
    for side, path in (("A", report.a), ("B", report.b)):
        console.print(Text(f"{side}: {shorten(visible(path), max(width - 3, MIN_NAME_WIDTH))}"))
    _print_prose(console, f"{report.what}, p={fmt_p(report.norm_type)}, groups by "
                          f"{visible(report.group_by)}; largest change first")
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
    _print_quiet(trend_verdict(report), report.status in (NONFINITE, SPIKE),
                 F.trend_findings(report), out, err)


def print_compare_verdict(report: CompareReport, out: TextIO, err: TextIO | None) -> None:
    _print_quiet(compare_verdict(report), report.status != "ok", F.compare_findings(report),
                 out, err)
