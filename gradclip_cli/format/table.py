"""``--format table`` (default): a report a person reads at a glance.

Groups in checkpoint order with norm, share, max |g|, size, non-finite counts
and a bar against the largest group; then the top tensors by norm and every
tensor holding non-finite values; then a one-line verdict matching the exit
code. rich decides colour: only on a terminal, never with NO_COLOR set.

Fitting the width. Every line fits the width (``COLUMNS`` when set, else the
terminal's, else 120) from 60 columns up. Optional columns go first (the bar,
then share, elements, ...), then names are shortened in the middle with an
ellipsis (their ends are what tells layers apart); a number is never cut.
Prose lines (header, verdict) wrap between words.

Data is not markup. Names, keys, paths and metadata come from the file: each
is passed through ``visible`` (one inert line) and handed to rich as a
``Text`` on a console that parses no markup and no emoji codes.

The drawing lives in ``table_layout`` and is imported on first use: rich
costs tens of milliseconds to import, which a ``--format json`` run never pays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # the report package imports torch; help and usage errors must not
    from ..report import ClipReport, InspectReport
    from ..report.compare import CompareReport
    from ..report.trend import TrendReport

def render_inspect(report: InspectReport, out: TextIO, *, top: int = 5) -> None:
    from . import table_layout

    table_layout.render_inspect(report, out, top=top)


def render_clip(report: ClipReport, out: TextIO) -> None:
    from . import table_layout

    table_layout.render_clip(report, out)


def print_verdict(report: InspectReport, out: TextIO) -> None:
    """``--quiet``: the verdict line alone, fitted to the width."""
    from . import table_layout

    table_layout.print_verdict(report, out)


def print_findings(report: InspectReport, err: TextIO) -> None:
    """``--quiet``: each tensor behind a non-finite finding, one plain line on ``err``."""
    from . import table_layout

    table_layout.print_findings(report, err)


def print_clip_summary(report: ClipReport, out: TextIO) -> None:
    """``--quiet``: the one line that says what ``clip`` did."""
    from . import table_layout

    table_layout.print_clip_summary(report, out)


def print_trend_verdict(report: TrendReport, out: TextIO, err: TextIO | None) -> None:
    """``trend -q``: the verdict line alone; each finding a plain line on ``err``."""
    from . import table_layout

    table_layout.print_trend_verdict(report, out, err)


def print_compare_verdict(report: CompareReport, out: TextIO, err: TextIO | None) -> None:
    """``compare -q``: the verdict line alone; each finding a plain line on ``err``."""
    from . import table_layout

    table_layout.print_compare_verdict(report, out, err)


def render_trend(report: TrendReport, out: TextIO) -> None:
    from . import table_layout

    table_layout.render_trend(report, out)


def render_compare(report: CompareReport, out: TextIO) -> None:
    from . import table_layout

    table_layout.render_compare(report, out)
