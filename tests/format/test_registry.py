"""One registry of formats (format/__init__.py): the option, its help and the CLI follow it."""

from __future__ import annotations

import pytest

from gradclip_cli import cli
from gradclip_cli.format import FORMATS, REGISTRY, failure_formats, names
from gradclip_cli.format.interface import Format
from tests.cli.support import run_process

RENDERS = [name for name in vars(Format) if name.startswith("render_")]
# Asked of a format only where its registry line says so.
OPTIONAL = {"render_error": "carries_failures", "render_verdict": "verdict_alone"}


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_every_registered_format_renders_what_the_cli_asks_of_it(entry):
    module = FORMATS[entry.name]
    assert RENDERS == ["render_inspect", "render_clip", "render_trend", "render_compare",
                       "render_autopsy", "render_error", "render_verdict"]
    for name in RENDERS:
        if name in OPTIONAL:
            # Exactly where the registry says the format has it.
            assert hasattr(module, name) == getattr(entry, OPTIONAL[name]), (entry.name, name)
        else:
            assert callable(getattr(module, name)), (entry.name, name)


def test_the_option_the_cli_and_the_help_follow_the_registry():
    assert names() == ("table", "json", "markdown", "github", "junit")
    assert failure_formats() == ("json", "markdown", "github", "junit")
    help_text = " ".join(run_process("inspect", "--help").out.split())
    assert ("table (for people), json (for scripts), markdown (a PR comment or "
            "$GITHUB_STEP_SUMMARY), github (GitHub Actions annotations) or junit (JUnit XML).") \
        in help_text
    bad = run_process("inspect", "x.pt", "--format", "yaml")
    assert bad.code == 2 and all(name in bad.err for name in names())


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_a_new_format_is_one_module_and_one_registry_line(monkeypatch, capsys, tmp_path):
    """A format registered in the registry alone is a --format choice, in --help, drawn by
    the commands and, where it carries failures, the failure document."""
    import sys
    import types

    import torch

    import gradclip_cli.format as formats

    module = types.ModuleType("gradclip_cli.format.rows")
    module.render_inspect = lambda report, out, *, top: out.write(
        f"total,{report.total_norm!r}\n")
    for kind in ("clip", "trend", "compare", "autopsy"):
        setattr(module, f"render_{kind}",
                lambda report, out, kind=kind: out.write(f"{kind}\n"))
    module.render_error = lambda failure, out: out.write(f"error,{failure.exit_code}\n")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(formats, "REGISTRY", (*formats.REGISTRY, formats.FormatEntry(
        "rows", "rows", "comma-separated rows", carries_failures=True)))

    code, out, _ = _run(["inspect", "--help"], capsys)
    assert code == 0
    assert "junit (JUnit XML) or rows (comma-separated rows)." in " ".join(out.split())

    code, _, err = _run(["inspect", "x.pt", "--format", "yaml"], capsys)
    assert code == 2 and "table, json, markdown, github, junit, rows" in err

    path = tmp_path / "g.pt"
    torch.save({"grads": {"a.w": torch.tensor([3.0, 4.0])}}, path)
    code, out, _ = _run(["inspect", str(path), "--format", "rows", "--no-progress"], capsys)
    assert (code, out) == (0, "total,5.0\n")
    # -q leaves the document whole: the registry line draws no verdict alone.
    code, out, _ = _run(["inspect", str(path), "--format", "rows", "-q"], capsys)
    assert (code, out) == (0, "total,5.0\n")

    code, out, err = _run(["inspect", str(tmp_path / "missing.pt"), "--format", "rows"],
                          capsys)
    assert code == 3 and out == "error,3\n" and "missing.pt" in err
