"""Validating gradclip's JSON output against the schema files it ships."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from gradclip_cli.schemas import schema


def assert_valid(document: Any) -> Any:
    """``document`` (an object, or one line of JSON) conforms to the schema it names."""
    if isinstance(document, str):
        lines = document.splitlines()
        assert len(lines) == 1, f"expected one line of JSON, got {len(lines)}"
        document = json.loads(lines[0])
    jsonschema.Draft202012Validator(schema(document["schema"])).validate(document)
    return document
