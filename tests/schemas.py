"""Validating real output against the JSON Schema files the package ships."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema


def schema(name: str) -> dict:
    """``name`` as in ``gradclip_cli/schemas/<name>.json`` (``trend-1``)."""
    text = resources.files("gradclip_cli").joinpath("schemas", f"{name}.json").read_text()
    return json.loads(text)


def validate(document: object, name: str) -> None:
    spec = schema(name)
    jsonschema.Draft202012Validator.check_schema(spec)
    jsonschema.Draft202012Validator(spec).validate(document)
