"""Output formats, one module each; ``FORMATS`` maps ``--format`` names to them.

A format module is imported when its name is looked up, not before: the table
formats pull in rich, which a ``--format json`` run never needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import import_module
from types import ModuleType

_MODULES = {"table": "table", "json": "json", "markdown": "markdown", "github": "github",
            "junit": "junit"}


class _Formats(Mapping):
    def __getitem__(self, name: str) -> ModuleType:
        return import_module(f"{__name__}.{_MODULES[name]}")

    def __iter__(self) -> Iterator[str]:
        return iter(_MODULES)

    def __len__(self) -> int:
        return len(_MODULES)


FORMATS: Mapping[str, ModuleType] = _Formats()

__all__ = ["FORMATS"]
