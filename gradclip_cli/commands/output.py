"""Where a command's report goes: ``--format``, ``--output-file`` and ``-q``, checked once.

A command makes one ``Output`` before any work (``Output.of``: the format
is a registered one, the report file can be written and is none of the
inputs), checks it again as a layout names more files it reads
(``Output.check``), and hands it the report: ``emit``, or ``prepare`` and
``deliver`` where the command writes something else (clip's checkpoint,
a plot) and the report must be drawn first. The format is reached through
the registry's ``render`` alone (``format/__init__.py``).
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .. import options, values
from ..format import render
from ..format import words as W
from ..sink.atomic import Staged, stage
from .common import speaks


@dataclass(frozen=True)
class Output:
    """``--format``, ``--output-file``, ``-q`` and ``--top`` of one run."""

    format: str = "table"
    file: Path | None = None
    quiet: bool = False
    top: int = 5

    @classmethod
    def of(cls, format: str, file: Path | None, *, quiet: bool = False, top: int = 5,
           reads: Iterable = (), writes: Iterable = (), writes_known: bool = True) -> Output:
        """Checked before any work; the report file first, so that an error document
        (``--format json``) goes to ``--output-file`` too (``options.report_file``)."""
        options.report_file(file, reads=reads, writes=writes, writes_known=writes_known)
        return cls(values.format_name(format), None if file is None else Path(file), quiet,
                   top)

    def check(self, *, reads: Iterable = (), writes: Iterable = (),
              writes_known: bool = True) -> None:
        """The report file again, against more of what the command reads and writes, as
        it becomes known (the files a layout read; a clipped set's folder)."""
        options.report_file(self.file, reads=reads, writes=writes, writes_known=writes_known)

    def prepare(self, report, *, verdict: bool = True) -> Pending | None:
        """``report`` drawn for stdout, or staged for ``--output-file`` (rank 0 alone: None
        elsewhere); ``Pending.deliver`` sends it. ``verdict``: a report sent to a file
        also prints its verdict line on stderr."""
        return _prepare(lambda out: render(self.format, report, out, top=self.top,
                                          quiet=self.quiet, err=sys.stderr),
                       self.file, verdict_of(report) if verdict else None)

    def emit(self, report, *, verdict: bool = True,
             then: Callable[[], None] | None = None) -> None:
        """``prepare`` and deliver. ``then``: what else the command writes (a plot; rank 0
        alone), written between: the report is drawn (a report file staged) before it, so
        nothing can fail over the report once the other output exists, and a failure
        writing it leaves no report."""
        pending = self.prepare(report, verdict=verdict)
        if then is not None and speaks():
            try:
                then()
            except BaseException:
                if pending is not None:
                    pending.discard()
                raise
        if pending is not None:
            pending.deliver()


def verdict_of(report) -> str | None:
    """The one-line verdict of a report (``format/words.py``, names made visible there);
    None for the autopsy, whose verdict is a paragraph."""
    from ..report import ClipReport, InspectReport
    from ..report.compare import CompareReport
    from ..report.trend import TrendReport

    if isinstance(report, InspectReport):
        return W.verdict_line(report)
    if isinstance(report, ClipReport):
        return W.clip_summary(report)
    if isinstance(report, TrendReport):
        return W.trend_verdict(report)
    if isinstance(report, CompareReport):
        return W.compare_verdict(report)
    return None


class _Drawn(io.StringIO):
    """A report drawn in memory as it would be on ``stream``: it answers ``isatty``,
    ``fileno`` and ``encoding`` as the stream does, so a table gets the terminal's width
    and colours, and a JSON document its indentation, exactly as if drawn there."""

    def __init__(self, stream: TextIO):
        super().__init__()
        self._stream = stream

    def isatty(self) -> bool:
        try:
            return self._stream.isatty()
        except (AttributeError, OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"


@dataclass
class Pending:
    """A report drawn in full and not yet delivered: for stdout its text, for
    ``--output-file`` a staged file (``sink.atomic.Staged``).

    Commands draw the report first, then write what else they write (clip's
    checkpoint, trend's plot), then ``deliver``: drawing cannot fail once
    something is written, so no command writes an output and then exits
    non-zero over its report."""

    text: str
    staged: Staged | None = None
    verdict: str | None = None

    def deliver(self) -> None:
        """Stdout gets the report; with ``--output-file`` the file does, and stderr the
        verdict line, so a CI job's log says why it failed (or that it passed)."""
        if self.staged is None:
            sys.stdout.write(self.text)
            sys.stdout.flush()
            return
        self.staged.commit()
        if self.verdict is not None:
            print(f"gradclip: {self.verdict}", file=sys.stderr)

    def discard(self) -> None:
        if self.staged is not None:
            self.staged.discard()


def _prepare(write: Callable[[TextIO], None], output_file: Path | None,
            verdict: str | None = None) -> Pending | None:
    """Draw a report for stdout, or stage it for ``--output-file`` (rank 0 alone: None
    elsewhere); ``Pending.deliver`` sends it. ``verdict``: the report's one-line
    verdict (``format/words.py``, names made visible there), which a report sent to a
    file also prints on stderr."""
    if not speaks():
        return None
    if output_file is None:
        drawn = _Drawn(sys.stdout)
        write(drawn)
        return Pending(drawn.getvalue())
    buffer = io.StringIO()
    write(buffer)
    data = buffer.getvalue().encode("utf-8")
    return Pending("", stage(Path(output_file), lambda file: file.write(data)), verdict)
