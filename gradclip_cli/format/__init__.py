"""Output formats, one module each; ``REGISTRY`` names them, ``FORMATS`` maps names to modules.

A format module is imported when its name is looked up, not before: the table
formats pull in rich, which a ``--format json`` run never needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType


@dataclass(frozen=True)
class FormatEntry:
    """One ``--format``: its name, its module in this package, how ``--help`` describes it,
    and whether it renders a failed run (exit 2 or 3) as a document of its own
    (``render_error``; the table is for a person, who reads the line on stderr)."""

    name: str
    module: str
    described: str
    carries_failures: bool


# The registry: a new format is one module and one line here; the option's check,
# its help and the CLI's failure documents follow from it.
REGISTRY = (
    FormatEntry("table", "table", "for people", carries_failures=False),
    FormatEntry("json", "json", "for scripts", carries_failures=True),
    FormatEntry("markdown", "markdown", "a PR comment or $GITHUB_STEP_SUMMARY",
                carries_failures=True),
    FormatEntry("github", "github", "GitHub Actions annotations", carries_failures=True),
    FormatEntry("junit", "junit", "JUnit XML", carries_failures=True),
)
NAMES = tuple(entry.name for entry in REGISTRY)
FAILURE_FORMATS = tuple(entry.name for entry in REGISTRY if entry.carries_failures)
_MODULES = {entry.name: entry.module for entry in REGISTRY}


def described() -> str:
    """``--format``'s help: ``table (for people), json (for scripts), ... or junit (JUnit XML)``."""
    parts = [f"{entry.name} ({entry.described})" for entry in REGISTRY]
    return ", ".join(parts[:-1]) + " or " + parts[-1] + "."


class _Formats(Mapping):
    def __getitem__(self, name: str) -> ModuleType:
        return import_module(f"{__name__}.{_MODULES[name]}")

    def __iter__(self) -> Iterator[str]:
        return iter(_MODULES)

    def __len__(self) -> int:
        return len(_MODULES)


FORMATS: Mapping[str, ModuleType] = _Formats()

__all__ = ["FAILURE_FORMATS", "FORMATS", "NAMES", "REGISTRY", "FormatEntry", "described"]
