"""Reports: plain data built from core results, rendered by a format."""

from .build import build_inspect_report, verdict
from .grouping import parse_group_by
from .model import (
    EXCEEDED,
    NONFINITE,
    OK,
    OVERFLOW,
    ClipReport,
    GroupRow,
    InspectReport,
    NonFinite,
    TensorRow,
)

__all__ = [
    "EXCEEDED", "NONFINITE", "OK", "OVERFLOW", "ClipReport", "GroupRow", "InspectReport",
    "NonFinite", "TensorRow", "build_inspect_report", "parse_group_by", "verdict",
]
