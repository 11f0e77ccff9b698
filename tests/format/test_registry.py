"""One registry of formats (format/__init__.py): the option, its help and the CLI follow it."""

from __future__ import annotations

import pytest

from gradclip_cli import cli, values
from gradclip_cli.format import FAILURE_FORMATS, FORMATS, NAMES, REGISTRY
from gradclip_cli.format.interface import FailureFormat, Format
from tests.cli.support import run_process

RENDERS = [name for name in vars(Format) if name.startswith("render_")]


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_every_registered_format_renders_what_the_cli_asks_of_it(entry):
    module = FORMATS[entry.name]
    assert RENDERS == ["render_inspect", "render_clip", "render_trend", "render_compare",
                       "render_autopsy"]
    for name in RENDERS:
        assert callable(getattr(module, name)), (entry.name, name)
    # The failure document exactly where the registry says the format carries one.
    assert hasattr(module, "render_error") == entry.carries_failures
    assert "render_error" in vars(FailureFormat)


def test_the_option_the_cli_and_the_help_follow_the_registry():
    assert values.FORMATS == NAMES == ("table", "json", "markdown", "github", "junit")
    assert cli.FAILURE_FORMATS == FAILURE_FORMATS == ("json", "markdown", "github", "junit")
    help_text = " ".join(run_process("inspect", "--help").out.split())
    assert ("table (for people), json (for scripts), markdown (a PR comment or "
            "$GITHUB_STEP_SUMMARY), github (GitHub Actions annotations) or junit (JUnit XML).") \
        in help_text
    bad = run_process("inspect", "x.pt", "--format", "yaml")
    assert bad.code == 2 and all(name in bad.err for name in NAMES)
