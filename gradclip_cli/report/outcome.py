"""The exit code a report ends its command with: 0 no finding, 1 a finding
(docs/reference/contract.md, "Exit codes"); the commands and the Python API ask here."""

from __future__ import annotations

from .model import NONFINITE, OK, SPIKE


def exit_code(report) -> int:
    """0 or 1 for an inspect, compare, trend or autopsy report.

    A trend is a finding where its judged point spikes or is non-finite, or a
    norm audit disagrees (docs/guides/dashboards.md); an autopsy where it
    explains a step; the others where their status is not ``ok``.
    """
    from .autopsy import EXPLAINED, AutopsyReport
    from .trend import TrendReport

    if isinstance(report, TrendReport):
        return 1 if report.status in (SPIKE, NONFINITE) or report.disagreeing else 0
    if isinstance(report, AutopsyReport):
        return 1 if report.status == EXPLAINED else 0
    return 0 if report.status == OK else 1
