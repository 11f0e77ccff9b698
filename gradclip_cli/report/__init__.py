"""Reports: plain data built from core results, rendered by a format.

Names are looked up lazily (PEP 562): the data objects and status words
(``report.model``, ``report.compare``) import nothing heavy, so a format can
name them without importing torch, which only building a report needs
(``report.build``). A usage error rendered as JUnit or Markdown never loads it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_WHERE = {
    "build_inspect_report": "build", "verdict": "build", "parse_group_by": "grouping",
    **{name: "model" for name in (
        "EXCEEDED", "NONFINITE", "OK", "OVERFLOW", "ClipReport", "FailureReport", "GroupRow",
        "InspectReport", "NonFinite", "TensorRow")},
}  # fmt: skip

__all__ = [
    "EXCEEDED", "NONFINITE", "OK", "OVERFLOW", "ClipReport", "FailureReport", "GroupRow",
    "InspectReport", "NonFinite", "TensorRow", "build_inspect_report", "parse_group_by",
    "verdict",
]  # fmt: skip

if TYPE_CHECKING:
    from .build import build_inspect_report, verdict
    from .grouping import parse_group_by
    from .model import (
        EXCEEDED,
        NONFINITE,
        OK,
        OVERFLOW,
        ClipReport,
        FailureReport,
        GroupRow,
        InspectReport,
        NonFinite,
        TensorRow,
    )


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
