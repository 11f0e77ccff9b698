"""JSON Schema (draft 2020-12) files for every ``--format json`` document gradclip prints.

Each file is ``<kind>-<version>.json`` for the document whose ``"schema"`` is
``gradclip.<kind>/<version>``; they install with the package, so a script can
validate what it reads::

    import jsonschema
    from gradclip_cli.schemas import schema

    jsonschema.validate(document, schema(document["schema"]))
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


def file_name(name: str) -> str:
    """``gradclip.inspect/1`` (or ``inspect-1``) -> ``inspect-1.json``."""
    stem = name.removeprefix("gradclip.").replace("/", "-")
    if not stem or any(not (ch.isalnum() or ch == "-") for ch in stem):
        raise ValueError(f"not a gradclip schema name: {name!r}")
    return f"{stem}.json"


@cache
def _load(file: str) -> dict[str, Any]:
    text = resources.files(__name__).joinpath(file).read_text(encoding="utf-8")
    return json.loads(text)


def schema(name: str) -> dict[str, Any]:
    """The JSON Schema of ``name`` (``gradclip.inspect/1`` or ``inspect-1``), as a new dict.

    Raises ``KeyError`` when gradclip ships no such schema.
    """
    file = file_name(name)
    try:
        return json.loads(json.dumps(_load(file)))
    except FileNotFoundError:
        raise KeyError(name) from None


def names() -> list[str]:
    """Every shipped schema, as ``gradclip.<kind>/<version>``."""
    found = []
    for entry in resources.files(__name__).iterdir():
        if entry.name.endswith(".json"):
            kind, _, version = entry.name.removesuffix(".json").rpartition("-")
            found.append(f"gradclip.{kind}/{version}")
    return sorted(found)
