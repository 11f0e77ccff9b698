"""What a run imports: help, --version and usage errors never load torch; JSON never loads rich.

Checked in a fresh process that runs the real entry point (as ``python -m
gradclip_cli``) and lists ``sys.modules`` as it ends. No timing is asserted:
BENCHMARKS.md has the measured costs.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .support import REPO, SAMPLES

# ``python -m gradclip_cli ARGS``, then the names in sys.modules as the process ends.
# (``-X importtime`` would miss modules loaded through importlib.import_module,
# as the format registry and the commands are.)
RUN_AND_LIST = """
import atexit, json, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv[0] = "gradclip"
runpy.run_module("gradclip_cli", run_name="__main__", alter_sys=True)
"""


def imported(*args: str) -> tuple[int, set[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp, "modules.json")
        proc = subprocess.run(
            [sys.executable, "-c", RUN_AND_LIST, str(listing), *args],
            capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
        )  # fmt: skip
        modules = set(json.loads(listing.read_text()))
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


def within(modules: set[str], *packages: str) -> set[str]:
    return {m for m in modules for p in packages if m == p or m.startswith(p + ".")}


# What only a table, a progress bar or another format draws with; typer 0.29's
# pydantic coercion, which a run whose values already have their types skips.
NOT_FOR_JSON = ("rich", "gradclip_cli.format.table", "gradclip_cli.format.table_layout",
                "gradclip_cli.format.markdown", "gradclip_cli.format.junit",
                "gradclip_cli.format.github", "gradclip_cli.format.plot", "markdown_it",
                "pydantic", "pydantic_core", "typer._adapters")


# String options (all but --top: typer parses its "3") need no coercion.
@pytest.mark.parametrize("extra", [[], ["--max-norm", "10", "--norm-type", "inf", "--group-by",
                                        "module", "--what", "grads", "--device", "cpu"]])
def test_a_json_run_imports_only_what_json_needs(extra):
    code, modules = imported("inspect", str(SAMPLES / "healthy.pt"), "--format", "json", *extra)
    assert code == 0
    assert torch_modules(modules)  # it did the work
    assert "gradclip_cli.format.json" in modules
    assert not within(modules, *NOT_FOR_JSON)


def test_a_table_run_imports_the_table_and_rich():
    # The other side of the test above: the names it looks for are the ones a table uses.
    code, modules = imported("inspect", str(SAMPLES / "healthy.pt"))
    assert code == 0
    assert {"gradclip_cli.format.table", "rich.table"} <= modules


@pytest.mark.parametrize("args, shown", [
    (["--top", "many"], "Invalid value for '--top'"),
    (["--top", "-1"], "Invalid value for '--top'"),
])
def test_typed_options_keep_typers_own_checks(args, shown):
    proc = subprocess.run(
        [sys.executable, "-m", "gradclip_cli", "inspect", str(SAMPLES / "healthy.pt"), *args],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.count("\n") == 1 and shown in proc.stderr


COLLECTOR_AFTER_A_RUN = """
import atexit, gc, sys
from gradclip_cli.cli import main
atexit.register(lambda: print(gc.isenabled(), gc.get_freeze_count() > 0))
sys.argv = ["gradclip", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("args, frozen", [
    (["inspect", str(SAMPLES / "healthy.pt"), "--format", "json"], True),
    (["--help"], False),  # nothing imported for a command, nothing frozen
    (["inspect", "no-such.pt", "--format", "json"], True),
])
def test_the_entry_point_turns_the_collector_back_on(args, frozen):
    proc = subprocess.run([sys.executable, "-c", COLLECTOR_AFTER_A_RUN, *args],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.stdout.splitlines()[-1] == f"True {frozen}"


def test_main_called_in_process_leaves_the_collector_alone(capsys):
    from gradclip_cli.cli import main

    freeze_count = gc.get_freeze_count()
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(SAMPLES / "healthy.pt"), "--format", "json"])
    assert exit_.value.code == 0
    assert gc.isenabled() and gc.get_freeze_count() == freeze_count


def test_version_prints_the_package_version():
    from gradclip_cli import __version__

    proc = subprocess.run([sys.executable, "-m", "gradclip_cli", "--version"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout == f"gradclip {__version__}\n"


def test_help_names_every_metavar():
    proc = subprocess.run([sys.executable, "-m", "gradclip_cli", "inspect", "--help"],
                          capture_output=True, text=True, timeout=600,
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
