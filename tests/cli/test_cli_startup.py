"""What a run imports: help, --version and usage errors never load torch; JSON never loads rich.

Checked with ``python -X importtime`` (the real entry point, a fresh
process), which lists every module a run imported. No timing is asserted:
BENCHMARKS.md has the measured costs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .support import REPO, SAMPLES


def imported(*args: str) -> tuple[int, set[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gradclip_cli", *args],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "gradclip_cli.cli" in modules
    return proc.returncode, modules


def torch_modules(modules: set[str]) -> set[str]:
    return {m for m in modules if m == "torch" or m.startswith("torch.")}


@pytest.mark.parametrize(
    "args, code",
    [
        (["--help"], 0),
        (["--version"], 0),
        (["inspect", "--help"], 0),
        (["clip", "--help"], 0),
        (["--show-completion", "bash"], 0),
        (["inspect"], 2),  # missing PATH
        (["inspect", "x.pt", "--no-such-flag"], 2),
        (["inspect", "x.pt", "--top", "many"], 2),
        (["nonsense"], 2),
    ],
)
def test_help_version_and_usage_errors_do_not_import_torch(args, code):
    returncode, modules = imported(*args)
    if args[0] != "--show-completion":  # typer decides that exit code; torch is the point
        assert returncode == code
    assert not torch_modules(modules)


def test_a_json_run_imports_no_rich():
    code, modules = imported("inspect", str(SAMPLES / "healthy.pt"), "--format", "json")
    assert code == 0
    assert torch_modules(modules)  # it did the work
    assert not {m for m in modules if m == "rich" or m.startswith("rich.")}


def test_version_prints_the_package_version():
    from gradclip_cli import __version__

    proc = subprocess.run([sys.executable, "-m", "gradclip_cli", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"gradclip {__version__}\n"


def test_help_names_every_metavar():
    proc = subprocess.run([sys.executable, "-m", "gradclip_cli", "inspect", "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "120"})
    text = proc.stdout
    for shown in ("--key K", "--norm-type P", "--device DEVICE", "--format FORMAT",
                  "--output-file FILE", "--max-norm FLOAT", "--group-by RULE", "--top N",
                  "-q, --quiet", "--no-progress"):
        assert shown in text, shown
    # typer prints the positional argument's type after its name; every option is named.
    options = text.split("Options:", 1)[1]
    for raw in ("<str>", "<int range>", "<path>", "{path}"):
        assert raw not in options, raw
