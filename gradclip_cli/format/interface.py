"""What every output format provides: one function per report kind.

A format writes a whole report to a text stream. Adding a format (Markdown,
JUnit, ...) is one new module with these two functions and one line in
``format/__init__.py``.
"""

from __future__ import annotations

from typing import Protocol, TextIO

from ..report import ClipReport, InspectReport


class Format(Protocol):
    def render_inspect(self, report: InspectReport, out: TextIO, *, top: int) -> None: ...

    def render_clip(self, report: ClipReport, out: TextIO) -> None: ...
