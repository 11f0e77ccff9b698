"""Output formats, one module each; ``FORMATS`` maps ``--format`` names to them."""

from . import json, table

FORMATS = {"table": table, "json": json}

__all__ = ["FORMATS"]
