"""The README's two commands: the first installs only what using gradclip needs (no
test, framework or docs package), the second adds the test extra and runs the suite,
and ``.ci/run`` installs exactly so, then the docs extra to build the site.

The packages are read from the installed distribution's own metadata
(``importlib.metadata.requires``), so a package moved between the base
dependencies and the ``test`` extra in pyproject.toml moves here too.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
SAMPLES = REPO / "sample_checkpoints"


def two_commands() -> tuple[str, str]:
    """The "Install" section's commands: (use the tool, run the tests)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Install") :]
    section = section[: section.index("\n## ", 1)]
    commands = re.findall(r"^    (python3 -m venv .*)$", section, re.MULTILINE)
    assert len(commands) == 2, commands
    return commands[0], commands[1]


def pip_installs(command: str) -> list[list[str]]:
    """The arguments of each ``pip install`` in a ``&&`` chain (or a script), flags
    such as ``-q`` left out."""
    installs = []
    for part in re.split(r"&&|\n", command):
        words = shlex.split(part, comments=True)
        if words[:2] == ["pip", "install"]:
            installs.append([w for w in words[2:] if w not in ("-q", "--quiet")])
    return installs


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def extra(name: str) -> set[str]:
    """The packages the extra ``name`` lists, as names."""
    found = set()
    for requirement in importlib.metadata.requires("gradclip") or []:
        spec, _, marker = requirement.partition(";")
        if re.search(rf"extra\s*==\s*['\"]{name}['\"]", marker):
            found.add(_name(spec))
    return found


def requirements() -> tuple[set[str], set[str]]:
    """(base dependencies, packages only the ``test`` and ``docs`` extras bring), as names."""
    base = set()
    for requirement in importlib.metadata.requires("gradclip") or []:
        spec, _, marker = requirement.partition(";")
        if not marker.strip():
            base.add(_name(spec))
    return base, (extra("test") | extra("docs")) - base


def test_the_first_command_installs_only_what_using_the_tool_needs():
    first, _ = two_commands()
    base, test_only = requirements()
    assert {"torch", "click", "rich", "safetensors"} <= base
    assert {"pytest", "transformers", "deepspeed", "lightning"} <= test_only
    # The docs site's packages are an extra of their own, never what using the tool brings.
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= extra("docs") <= test_only
    installs = pip_installs(first)
    assert installs == [["torch==2.13.0"], ["-e", "."]], installs
    for words in installs:
        for word in words:
            assert "[" not in word, f"{word}: an extra in the first command"
            assert _name(word) not in test_only, f"{word}: a test-only package"
    assert first.endswith("&& gradclip inspect sample_checkpoints/healthy.pt")


def test_the_test_command_installs_the_test_extra_and_runs_pytest():
    _, tests = two_commands()
    assert pip_installs(tests) == [["torch==2.13.0"], ["-e", ".[test]"]]
    assert tests.endswith("&& python -m pytest -q")


def test_ci_installs_exactly_as_the_readme_says():
    first, tests = two_commands()
    script = CI.read_text(encoding="utf-8")
    docs = [["-e", ".[docs]"]]  # after the test extra: the suite builds the site
    assert pip_installs(script) == pip_installs(first) + pip_installs(tests) + docs
    # The first command's check runs before the test extra is installed, the
    # test command after it; pytest's exit 5 (no tests collected) fails CI.
    lines = [line.strip() for line in script.splitlines()]
    inspect = lines.index("gradclip inspect sample_checkpoints/healthy.pt")
    test_extra = lines.index('pip install -q -e ".[test]"')
    pytest_line = lines.index("python -m pytest -q")
    assert lines.index("pip install -q -e .") < inspect < test_extra < pytest_line
    docs_line = lines.index('pip install -q -e ".[docs]"')
    build = lines.index('mkdocs build --strict --quiet --site-dir "$site"')
    assert test_extra < docs_line < pytest_line < build
    assert re.search(r'if \[ "\$status" -eq 5 \]; then\n[^\n]*\n\s*exit 1', script)
    assert lines[0] == "#!/usr/bin/env bash" and "set -euo pipefail" in lines


# Every module a test-only package installs is made unimportable, so the tool runs
# as it would after the first command alone.
_BLOCK = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = set(sys.argv.pop(1).split(","))
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (test-only)", name=name)
            return None
    sys.meta_path.insert(0, Block())
    from gradclip_cli.cli import main
    main(sys.argv[1:])
""")


def blocked_modules() -> set[str]:
    _, test_only = requirements()
    # Only packages the test extra alone brings: a base dependency's own
    # dependency (numpy, under torch) stays importable.
    needed_by_base = {
        _name(r)
        for d in ("torch", "click", "rich", "safetensors")
        for r in importlib.metadata.requires(d) or []
        if ";" not in r
    }
    modules = set()
    for module, dists in importlib.metadata.packages_distributions().items():
        if any(_name(d) in test_only - needed_by_base for d in dists):
            modules.add(module)
    return modules


@pytest.mark.parametrize("args, code", [
    (["inspect", "sample_checkpoints/healthy.pt"], 0),
    (["inspect", "sample_checkpoints/nonfinite.pt", "--format", "json"], 1),
    # (Every sample records step 100: two of them are not one run's series.)
    (["trend", "sample_checkpoints/healthy.pt", "sample_checkpoints/healthy.safetensors"], 0),
    (["compare", "sample_checkpoints/healthy.pt", "sample_checkpoints/exploding.pt"], 0),
    (["clip", "sample_checkpoints/exploding.pt", "--max-norm", "1", "-o", "OUT"], 0),
])  # fmt: skip
def test_the_tool_runs_without_any_test_only_package(tmp_path, args, code):
    blocked = blocked_modules()
    assert {"pytest", "transformers", "deepspeed", "yaml"} <= blocked
    if importlib.util.find_spec("mkdocs") is not None:  # the docs extra, where installed
        assert {"mkdocs", "material", "mkdocstrings"} <= blocked
    args = [str(tmp_path / "clipped.pt") if a == "OUT" else a for a in args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCK, ",".join(sorted(blocked)), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stdout and "test-only" not in proc.stderr
