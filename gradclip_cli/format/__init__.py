"""Output formats, one module each; ``REGISTRY`` names them, ``FORMATS`` maps names to modules.

A format module is imported when its name is looked up, not before: the table
formats pull in rich, which a ``--format json`` run never needs. So what the
command line needs before any import (the name, ``--help``'s words, whether
the format carries failures) is declared on the format's registry line, and
everything else follows from it: ``--format``'s choices and help
(``values.py``, ``cli.py``), the CLI's failure documents, ``-q``, and
``render``, the one way the commands and the Python API reach a format.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType
from typing import TextIO


@dataclass(frozen=True)
class FormatEntry:
    """One ``--format``: its name, its module in this package, how ``--help`` describes it,
    and which of the optional functions of ``interface.Format`` it has:

    ``carries_failures``: it renders a failed run (exit 2 or 3) as a document of its
    own (``render_error``; the table is for a person, who reads the line on stderr).
    ``carries_refusals``: a refused clip (exit 1, nothing written) is a finding in its
    document, so a report file is never missing or stale (the CI formats).
    ``verdict_alone``: ``-q`` draws the verdict line alone (``render_verdict``);
    elsewhere ``-q`` leaves the document whole (a program reads all of it).
    """

    name: str
    module: str
    described: str
    carries_failures: bool = False
    carries_refusals: bool = False
    verdict_alone: bool = False


# The registry: a new format is one module and one line here; the option's check,
# its help, -q and the CLI's failure documents follow from it.
REGISTRY = (
    FormatEntry("table", "table", "for people", verdict_alone=True),
    FormatEntry("json", "json", "for scripts", carries_failures=True),
    FormatEntry("markdown", "markdown", "a PR comment or $GITHUB_STEP_SUMMARY",
                carries_failures=True, carries_refusals=True),
    FormatEntry("github", "github", "GitHub Actions annotations", carries_failures=True,
                carries_refusals=True),
    FormatEntry("junit", "junit", "JUnit XML", carries_failures=True, carries_refusals=True),
)


def entry(name: str) -> FormatEntry:
    """The registry line of ``--format NAME`` (KeyError if there is none)."""
    for found in REGISTRY:
        if found.name == name:
            return found
    raise KeyError(name)


def names() -> tuple[str, ...]:
    """Every ``--format`` NAME, in the registry's order."""
    return tuple(e.name for e in REGISTRY)


def failure_formats() -> tuple[str, ...]:
    """The formats that carry a failed run as a document of their own."""
    return tuple(e.name for e in REGISTRY if e.carries_failures)


def described() -> str:
    """``--format``'s help: ``table (for people), json (for scripts), ... or junit (JUnit XML)``."""
    parts = [f"{e.name} ({e.described})" for e in REGISTRY]
    return ", ".join(parts[:-1]) + " or " + parts[-1] + "."


def render(name: str, report, out: TextIO, *, top: int = 5, quiet: bool = False,
           err: TextIO | None = None) -> None:
    """``report`` as ``--format NAME`` draws it on ``out``: the function of its kind
    (``render_inspect``, ``render_clip``, ...); with ``quiet`` (``-q``) the verdict line
    alone where the format draws one (``err``: each finding a line there, or None)."""
    fmt = FORMATS[name]
    if quiet and entry(name).verdict_alone:
        fmt.render_verdict(report, out, err)
        return
    from ..report.autopsy import AutopsyReport
    from ..report.compare import CompareReport
    from ..report.model import ClipReport, InspectReport
    from ..report.trend import TrendReport

    if isinstance(report, InspectReport):
        fmt.render_inspect(report, out, top=top)
    elif isinstance(report, ClipReport):
        fmt.render_clip(report, out)
    elif isinstance(report, TrendReport):
        fmt.render_trend(report, out)
    elif isinstance(report, CompareReport):
        fmt.render_compare(report, out)
    elif isinstance(report, AutopsyReport):
        fmt.render_autopsy(report, out)
    else:
        raise TypeError(f"no format draws a {type(report).__name__}")


class _Formats(Mapping):
    def __getitem__(self, name: str) -> ModuleType:
        return import_module(f"{__name__}.{entry(name).module}")

    def __iter__(self) -> Iterator[str]:
        return iter(names())

    def __len__(self) -> int:
        return len(REGISTRY)


FORMATS: Mapping[str, ModuleType] = _Formats()

__all__ = ["FORMATS", "REGISTRY", "FormatEntry", "described", "entry", "failure_formats",
           "names", "render"]
