"""What an output format provides: every function the commands and the CLI call on one.

A format writes a whole report to a text stream. Adding a format is one new
module with these functions and one line in ``format/__init__.py``'s
registry. Two are asked of a format only where its registry line says so:
``render_error`` where it ``carries_failures``, ``render_verdict`` where
``-q`` draws the ``verdict_alone``.
"""

from __future__ import annotations

from typing import Protocol, TextIO

from ..report import ClipReport, FailureReport, InspectReport
from ..report.autopsy import AutopsyReport
from ..report.compare import CompareReport
from ..report.trend import TrendReport

Report = InspectReport | ClipReport | TrendReport | CompareReport | AutopsyReport


class Format(Protocol):
    def render_inspect(self, report: InspectReport, out: TextIO, *, top: int) -> None: ...

    def render_clip(self, report: ClipReport, out: TextIO) -> None: ...

    def render_trend(self, report: TrendReport, out: TextIO) -> None: ...

    def render_compare(self, report: CompareReport, out: TextIO) -> None: ...

    def render_autopsy(self, report: AutopsyReport, out: TextIO) -> None: ...

    def render_error(self, failure: FailureReport, out: TextIO) -> None:
        """A run that could not report (exit 2 or 3) as a document of its own, which the
        CLI writes instead of a report (registry: ``carries_failures``)."""

    def render_verdict(self, report: Report, out: TextIO, err: TextIO | None) -> None:
        """``-q``: the report's verdict line alone on ``out``, each finding a line on
        ``err`` where the report has them (registry: ``verdict_alone``)."""
