"""What a run imports: help, --version, completion and usage errors never load torch; JSON
never loads rich. Every value is checked while the command line is parsed, in one message style.

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
        (["trend", "--help"], 0),
        (["compare", "--help"], 0),
        (["--show-completion", "bash"], 0),
        (["inspect"], 2),  # missing PATH
        (["inspect", "x.pt", "--no-such-flag"], 2),
        (["nonsense"], 2),
        *[([command, *paths, *typo], 2) for command, paths, typo in [
            ("inspect", ["x.pt"], ["--format", "xml"]),
            ("inspect", ["x.pt"], ["--norm-type", "abc"]),
            ("inspect", ["x.pt"], ["--what", "foo"]),
            ("inspect", ["x.pt"], ["--top", "-1"]),
            ("inspect", ["x.pt"], ["--top", "many"]),
            ("inspect", ["x.pt"], ["--device", "tpu"]),
            ("inspect", ["x.pt"], ["--group-by", "depth:0"]),
            ("inspect", ["x.pt"], ["--max-norm", "nan"]),
            ("clip", ["x.pt"], ["--what", "weights"]),
            ("clip", ["x.pt"], ["--clip-value", "-1"]),
            ("trend", ["x.pt"], ["--z", "abc"]),
            ("trend", ["x.pt"], ["--z", "nan"]),
            ("trend", ["x.pt"], ["--alpha", "1"]),
            ("trend", ["x.pt"], ["--warmup", "0"]),
            ("trend", ["x.pt"], ["--fail-on", "all"]),
            ("trend", ["x.pt"], ["--plot", "a.pdf"]),
            ("compare", ["a.pt", "b.pt"], ["--fail-above", "0.5"]),
            ("compare", ["a.pt", "b.pt"], ["--format", "junit", "--norm-type", "0"]),
        ]],
    ],
)  # fmt: skip
def test_help_version_and_usage_errors_do_not_import_torch(args, code):
    returncode, modules = imported(*args)
    assert returncode == code
    assert not torch_modules(modules)


def within(modules: set[str], *packages: str) -> set[str]:
    return {m for m in modules for p in packages if m == p or m.startswith(p + ".")}


# What only a table, a progress bar or another format draws with; typer and the
# pydantic it coerces with (gradclip's command line is click's).
NOT_FOR_JSON = ("rich", "gradclip_cli.format.table", "gradclip_cli.format.fitting",
                "gradclip_cli.format.markdown", "gradclip_cli.format.junit",
                "gradclip_cli.format.github", "gradclip_cli.format.plot", "markdown_it",
                "pydantic", "pydantic_core", "typer")


@pytest.mark.parametrize("extra", [[], ["--max-norm", "10", "--norm-type", "inf", "--group-by",
                                        "module", "--what", "grads", "--device", "cpu",
                                        "--top", "3"]])
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


# Every value refused in one style: "FLAG must be ..., got 'VALUE'", one line, nothing on stdout.
@pytest.mark.parametrize("command, args, shown", [
    ("inspect", ["--top", "many"], "--top must be a whole number >= 0, got 'many'"),
    ("inspect", ["--top", "-1"], "--top must be a whole number >= 0, got '-1'"),
    ("inspect", ["--norm-type", "abc"], "--norm-type must be a number, got 'abc'"),
    ("inspect", ["--norm-type", "-2"], "--norm-type must be a number > 0 or 'inf', got '-2'"),
    ("inspect", ["--format", "xml"],
     "--format must be one of table, json, markdown, github, junit, got 'xml'"),
    ("inspect", ["--what", "foo"],
     "--what must be one of auto, grads, exp_avg, grad_rms, update, weights, got 'foo'"),
    ("inspect", ["--device", "tpu"], "--device must be cpu, cuda, cuda:N, mps or auto, "
                                     "got 'tpu'"),
    ("trend", ["--z", "abc"], "--z must be a number, got 'abc'"),
    ("trend", ["--z", "nan"], "--z must be a finite number > 0, got 'nan'"),
    ("trend", ["--warmup", "2.5"], "--warmup must be a whole number >= 1, got '2.5'"),
    ("trend", ["--alpha", "0"], "--alpha must be a number between 0 and 1 (exclusive), got '0'"),
    ("trend", ["--fail-on", "all"], "--fail-on must be one of newest, any, got 'all'"),
    ("clip", ["--what", "weights"], "clip changes gradients only: --what grads, got 'weights'"),
])  # fmt: skip
def test_every_value_is_refused_in_one_style(command, args, shown):
    paths = ["a.pt", "b.pt"] if command == "compare" else [str(SAMPLES / "healthy.pt")]
    proc = subprocess.run(
        [sys.executable, "-m", "gradclip_cli", command, *paths, *args],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"gradclip: {shown} (see 'gradclip {command} --help')\n"


def complete(words: str) -> list[str]:
    """What bash completion offers for the last word of ``words``, through click's
    completion protocol (the script --show-completion prints sets these variables)."""
    parts = words.split(" ")
    env = {**os.environ, "_GRADCLIP_COMPLETE": "bash_complete", "COMP_WORDS": words,
           "COMP_CWORD": str(len(parts) - 1)}
    proc = subprocess.run([sys.executable, "-m", "gradclip_cli"], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return [line.split(",", 1)[1] for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("words, offered", [
    ("gradclip inspect x.pt --format ", ["table", "json", "markdown", "github", "junit"]),
    ("gradclip trend x --format j", ["json", "junit"]),
    ("gradclip inspect x.pt --what ", ["auto", "grads", "exp_avg", "grad_rms", "update",
                                       "weights"]),
    ("gradclip clip x.pt --what ", ["grads", "auto"]),
    ("gradclip compare a b --group-by ", ["layer", "module", "tensor", "depth:", "regex:"]),
    ("gradclip trend x --fail-on ", ["newest", "any"]),
    ("gradclip tr", ["trend"]),
])  # fmt: skip
def test_shell_completion_completes_values(words, offered):
    assert complete(words) == offered


def test_completion_imports_no_torch():
    env = {"_GRADCLIP_COMPLETE": "bash_complete", "COMP_WORDS": "gradclip inspect x --what ",
           "COMP_CWORD": "4"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        _, modules = imported()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    assert not torch_modules(modules)


def test_the_value_lists_are_the_commands_own():
    from gradclip_cli import values
    from gradclip_cli.format import FORMATS, names
    from gradclip_cli.source.what import WHATS

    assert values.WHATS == WHATS
    assert names() == tuple(FORMATS)


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


@pytest.mark.parametrize("command", ["trend", "compare"])
def test_trend_and_compare_help_show_no_python_types(command):
    proc = subprocess.run([sys.executable, "-m", "gradclip_cli", command, "--help"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0
    for raw in ("<list[Path]>", "<str>", "<path>", "<float>", "<int>", "{path}", "FLOAT RANGE"):
        assert raw not in proc.stdout, raw
    for shown in ("--what WHAT", "--group-by RULE", "--format FORMAT", "--no-progress",
                  "--norm-type P"):
        assert shown in proc.stdout, shown


def test_help_names_every_metavar():
    proc = subprocess.run([sys.executable, "-m", "gradclip_cli", "inspect", "--help"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "120"})
    text = proc.stdout
    for shown in ("--key K", "--norm-type P", "--device DEVICE", "--format FORMAT",
                  "--output-file FILE", "--max-norm FLOAT", "--group-by RULE", "--top N",
                  "-q, --quiet", "--no-progress"):
        assert shown in text, shown
    # No Python type shows after a name; every option is named by its metavar.
    options = text.split("Options:", 1)[1]
    for raw in ("<str>", "<int range>", "<path>", "{path}"):
        assert raw not in options, raw


RICH_FREE = """
import json, sys
import gradclip_cli.format.{name} as module
print(json.dumps(sorted(m for m in sys.modules if m == "rich" or m.startswith(("rich.", "torch")))))
"""


@pytest.mark.parametrize("name", ["json", "markdown", "github", "junit", "words", "shown",
                                  "findings"])
def test_formats_but_the_table_import_no_rich_and_no_torch(name):
    proc = subprocess.run([sys.executable, "-c", RICH_FREE.replace("{name}", name)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_the_table_is_where_rich_is():
    proc = subprocess.run([sys.executable, "-c", RICH_FREE.replace("{name}", "table")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "rich.table" in json.loads(proc.stdout)


@pytest.mark.parametrize("fmt", ["markdown", "github", "junit"])
def test_a_ci_format_run_imports_no_rich(fmt):
    code, modules = imported("inspect", str(SAMPLES / "healthy.pt"), "--format", fmt)
    assert code == 0
    assert not within(modules, "rich", "gradclip_cli.format.table", "gradclip_cli.format.fitting")
