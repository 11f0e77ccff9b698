"""What every output format provides: one function per report kind.

A format writes a whole report to a text stream. Adding a format is one new
module with these functions and one line in ``format/__init__.py``'s
registry; a format registered as carrying failures also renders a run that
could not report (``FailureFormat``).
"""

from __future__ import annotations

from typing import Protocol, TextIO

from ..report import ClipReport, FailureReport, InspectReport
from ..report.autopsy import AutopsyReport
from ..report.compare import CompareReport
from ..report.trend import TrendReport


class Format(Protocol):
    def render_inspect(self, report: InspectReport, out: TextIO, *, top: int) -> None: ...

    def render_clip(self, report: ClipReport, out: TextIO) -> None: ...

    def render_trend(self, report: TrendReport, out: TextIO) -> None: ...

    def render_compare(self, report: CompareReport, out: TextIO) -> None: ...

    def render_autopsy(self, report: AutopsyReport, out: TextIO) -> None: ...


class FailureFormat(Format, Protocol):
    """A format that carries a failure (exit 2 or 3) as a document of its own: the CLI
    renders it instead of a report (``cli.FAILURE_FORMATS``, from the registry)."""

    def render_error(self, failure: FailureReport, out: TextIO) -> None: ...
