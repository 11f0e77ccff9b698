"""``--format github``: GitHub Actions workflow commands, one per finding.

Each finding becomes ``::error file=SOURCE,title=TITLE::MESSAGE`` (or
``::warning``), which the runner shows as an annotation on the run and, for
a file in the repository, on that file. A run without findings prints one
``::notice`` with the verdict, so the log says what was checked.

The runner parses these lines itself, so data must not be able to end a
property, start a new command, or forge a line: following the escaping of
``@actions/core`` (``toolkit/packages/core/src/command.ts``), ``%``, CR and
LF become ``%25``, ``%0D``, ``%0A`` everywhere, and in property values
``:`` and ``,`` also become ``%3A`` and ``%2C``. Names pass through
``visible()`` first, so they are one printable line before this escaping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

from . import findings as F
from .text import kept_visible, visible
from .words import (
    audit_lines,
    coef_lowered_line,
    compare_verdict,
    fmt,
    fmt_p,
    trend_verdict,
    verdict_line,
)

if TYPE_CHECKING:
    from ..report import ClipReport, FailureReport, InspectReport
    from ..report.compare import CompareReport
    from ..report.trend import TrendReport


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(kind: str, message: str, *, shown: bool = False, **properties: str) -> str:
    """One workflow command line: ``::kind key=value,...::message``. A ``shown`` message
    (a verdict, a note, an error line) is made of ``visible()`` pieces already
    (``kept_visible``: its names show as in every other line)."""
    props = ",".join(f"{k}={escape_property(visible(v))}" for k, v in properties.items())
    text = kept_visible(message) if shown else visible(message)
    return f"::{kind}{' ' + props if props else ''}::{escape_data(text)}\n"


def _write(out: TextIO, source: str, found: list[F.Finding], verdict: str) -> None:
    for f in found:
        out.write(command(f.severity, f.message, file=f.source or source,
                          title=f"gradclip: {f.title}"))
    if not any(f.severity == F.ERROR for f in found):
        out.write(command("notice", verdict, shown=True, file=source, title="gradclip"))


def render_inspect(report: InspectReport, out: TextIO, *, top: int = 0) -> None:
    for note in report.notes:  # what the file's name or layout would mislead about
        out.write(command("notice", note, shown=True, file=report.source,
                          title="gradclip inspect: note"))
    _write(out, report.source, F.inspect_findings(report), verdict_line(report))


def render_clip(report: ClipReport, out: TextIO) -> None:
    verdict = (f"{visible(report.source)} -> {visible(report.output)}: gradient total norm "
               f"(p={fmt_p(report.norm_type)}) "
               f"{fmt(report.total_norm_before)} -> {fmt(report.total_norm_after)}")
    lowered = coef_lowered_line(report)
    if lowered is not None:
        verdict += f"; {lowered}"
    for note in report.notes:  # what --verify could not check
        out.write(command("notice", note, shown=True, file=report.source,
                          title="gradclip clip: note"))
    _write(out, report.source, F.clip_findings(report), verdict)


def render_trend(report: TrendReport, out: TextIO) -> None:
    # Each finding names its point's own file; the notice, the newest point's.
    newest = report.points[-1].source if report.points else ""
    # The notes: where each series of a run folder came from, what the monitor clipped,
    # what --verify could not check... about a run folder or not: "note", as compare's.
    for note in report.notes:
        out.write(command("notice", note, shown=True, title="gradclip trend: note"))
    for line in audit_lines(report):  # a disagreement is also an error finding below
        out.write(command("notice", line, shown=True, title="gradclip trend: norm audit"))
    _write(out, newest, F.trend_findings(report), trend_verdict(report))


def render_compare(report: CompareReport, out: TextIO) -> None:
    for note in report.notes:  # what --verify could not check
        out.write(command("notice", note, shown=True, title="gradclip compare: note"))
    _write(out, report.b, F.compare_findings(report), compare_verdict(report))


def render_error(failure: FailureReport, out: TextIO) -> None:
    """One ``::error`` naming the input (when known), so the job's annotations say why
    it has no report."""
    file = {"file": failure.file} if failure.file else {}
    for note in failure.notes:  # what --verify could not check
        out.write(command("notice", note, shown=True, **file,
                          title=f"gradclip {failure.command}: note"))
    # The message is made visible once already, as stderr shows it.
    out.write(command("error", failure.message, shown=True, **file,
                      title=f"gradclip: {failure.title}"))


def render_autopsy(report, out: TextIO) -> None:
    source = report.finest
    for note in report.notes:
        out.write(command("notice", note, shown=True, title="gradclip autopsy"))
    _write(out, source, F.autopsy_findings(report), visible(report.verdict))
