"""Output formats, one module each; ``FORMATS`` maps ``--format`` names to them."""

from . import github, json, junit, markdown, table

FORMATS = {"table": table, "json": json, "markdown": markdown, "github": github, "junit": junit}

__all__ = ["FORMATS"]
