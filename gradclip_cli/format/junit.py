"""``--format junit``: JUnit XML, one testcase per group, a finding is a ``<failure>``.

The layout GitLab, Jenkins and Buildkite read: ``<testsuites>`` holding one
``<testsuite>`` (tests, failures, errors, skipped counted) of ``<testcase
classname=... name=...>`` elements. Every group is a testcase, plus ``total``
for the whole-checkpoint checks (``--max-norm``, the total's spikes); a
group with findings gets one ``<failure>`` per finding. Warnings (findings
that do not fail the run) go in ``<system-out>``, which no consumer counts
as a failure.

Names are data: ``visible()`` makes them one printable line (control
characters, which XML 1.0 cannot hold even as references, become escapes);
ElementTree then escapes ``& < > "``; ``xml_text`` drops anything XML 1.0
still forbids, as a second guard.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from typing import TYPE_CHECKING, TextIO

from . import findings as F
from .text import kept_visible, visible
from .words import (
    audit_lines,
    coef_lowered_line,
    compare_verdict,
    fmt,
    fmt_p,
    fmt_ratio,
    measured_line,
    trend_verdict,
    verdict_line,
)

if TYPE_CHECKING:
    from ..report import ClipReport, FailureReport, InspectReport
    from ..report.compare import CompareReport
    from ..report.trend import TrendReport

# Char ::= #x9 | #xA | #xD | [#x20-#xD7FF] | [#xE000-#xFFFD] | [#x10000-#x10FFFF]
# (XML 1.0, section 2.2).
_NOT_XML_CHAR = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text: object) -> str:
    """``text`` as one printable line that XML 1.0 can hold."""
    return _NOT_XML_CHAR.sub("", visible(text))


def _xml_shown(text: str) -> str:
    """A line made of ``visible()`` pieces already (``kept_visible``: a verdict, a note), as
    XML text: a renderer makes a raw one (autopsy's verdict, a refusal) ``visible`` before
    handing it here."""
    return _NOT_XML_CHAR.sub("", kept_visible(text))


def _suite(name: str, cases: Iterable[str], found: list[F.Finding], summary: str,
           details: dict[str, str] | None = None, notes: Iterable[str] = ()) -> ET.Element:
    """The document; ``details`` gives some testcases a ``<system-out>`` line (their norm);
    ``notes``: lines made of ``visible()`` pieces already, as every format shows them."""
    names = list(dict.fromkeys([*cases, *(f.series for f in found)]))
    errors = {n: [f for f in found if f.series == n and f.severity == F.ERROR] for n in names}
    warnings = [f for f in found if f.severity == F.WARNING]
    failures = sum(1 for n in names if errors[n])
    root = ET.Element("testsuites", name="gradclip", tests=str(len(names)),
                      failures=str(failures), errors="0")
    suite = ET.SubElement(root, "testsuite", name=xml_text(name), tests=str(len(names)),
                          failures=str(failures), errors="0", skipped="0")
    for n in names:
        case = ET.SubElement(suite, "testcase", classname=xml_text(name), name=xml_text(n))
        for f in errors[n]:
            failure = ET.SubElement(case, "failure", message=xml_text(f.title),
                                    type="gradclip")
            failure.text = xml_text(f.message)
        if details and n in details:
            ET.SubElement(case, "system-out").text = xml_text(details[n])
    out = ET.SubElement(suite, "system-out")
    out.text = "\n".join([_xml_shown(summary), *(_xml_shown(note) for note in notes),
                           *(xml_text(f"warning: {w.title}: {w.message}") for w in warnings)])
    return root


def _write(root: ET.Element, out: TextIO) -> None:
    ET.indent(root)
    out.write('<?xml version="1.0" encoding="UTF-8"?>\n')
    out.write(ET.tostring(root, encoding="unicode"))
    out.write("\n")


def render_inspect(report: InspectReport, out: TextIO, *, top: int = 0) -> None:
    cases = [F.TOTAL, *(g.name for g in report.groups)]
    p = fmt_p(report.norm_type)
    details = {g.name: f"{report.what}: norm {fmt(g.norm)} (p={p})"
               + ("" if g.ratio is None else f", ratio {fmt_ratio(g.ratio)} to the weights")
               for g in report.groups}
    details[F.TOTAL] = f"{report.what}: total norm {fmt(report.total_norm)} (p={p})"
    measured = measured_line(report)
    notes = [*([] if measured is None else [measured]), *(f"note: {n}" for n in report.notes)]
    _write(_suite(f"gradclip inspect {report.source}", cases, F.inspect_findings(report),
                  verdict_line(report), details, notes), out)


def render_clip(report: ClipReport, out: TextIO) -> None:
    summary = visible(report.refused or f"{report.source} -> {report.output}: gradient total "
                      f"norm {report.total_norm_before} -> {report.total_norm_after}")
    lowered = coef_lowered_line(report)
    _write(_suite(f"gradclip clip {report.source}", [F.TOTAL], F.clip_findings(report),
                  summary, notes=[*([] if lowered is None else [lowered]),
                                  *(f"note: {n}" for n in report.notes)]), out)


def render_trend(report: TrendReport, out: TextIO) -> None:
    # The notes (where each series came from, what --verify could not check...) follow
    # the verdict.
    _write(_suite("gradclip trend", [F.TOTAL, *report.groups], F.trend_findings(report),
                  trend_verdict(report), notes=[*report.notes, *audit_lines(report)]), out)


def render_compare(report: CompareReport, out: TextIO) -> None:
    cases = [F.TOTAL, *(g.name for g in report.groups)]
    _write(_suite(f"gradclip compare {report.a} {report.b}", cases, F.compare_findings(report),
                  compare_verdict(report), notes=[f"note: {n}" for n in report.notes]), out)


def render_error(failure: FailureReport, out: TextIO) -> None:
    """A run that could not report: one testcase holding an ``<error>`` (JUnit's word for
    a test that could not run, as opposed to a ``<failure>``), so a CI test report
    shows why it is empty."""
    name = " ".join(["gradclip", failure.command, *([failure.source] if failure.source else [])])
    root = ET.Element("testsuites", name="gradclip", tests="1", failures="0", errors="1")
    suite = ET.SubElement(root, "testsuite", name=xml_text(name), tests="1", failures="0",
                          errors="1", skipped="0")
    case = ET.SubElement(suite, "testcase", classname=xml_text(name), name=F.RUN)
    error = ET.SubElement(case, "error", message=xml_text(failure.title), type="gradclip")
    error.text = _xml_shown(failure.message)  # made visible once, as stderr shows it
    if failure.notes:  # what --verify could not check
        ET.SubElement(suite, "system-out").text = "\n".join(
            _xml_shown(f"note: {note}") for note in failure.notes)
    _write(root, out)


def render_autopsy(report, out: TextIO) -> None:
    """One testcase per group (its onset and changes as its output); an explained spike
    is a failure of the group it began in."""
    from . import autopsy_rows as A

    details = {g.name: f"onset {A.onset_text(g)}, lead {A.lead_text(g)}, " + ", ".join(
        f"{q} {A.change_text(g, q)}" for q in g.changes) + f", outliers {A.outliers_text(g)}"
        for g in report.groups}
    _write(_suite("gradclip autopsy", [F.TOTAL, *(g.name for g in report.groups)],
                  F.autopsy_findings(report), visible(report.verdict), details, report.notes), out)
