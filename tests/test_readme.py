"""The README's command examples are what the commands print.

Each fenced block whose first line is ``$ gradclip ...`` (a shell pipeline
is allowed) runs from the repository root at ``COLUMNS=100``; its output must
match the block's remaining lines. Numbers compare within 1e-9 relative, and
runs of spaces as one, so a last-bit difference between CPUs never fails
the check. ``/tmp/`` in a command is a fresh temporary folder, so examples
leave nothing behind.

To rewrite the blocks from real output after a change:

    python -m tests.test_readme
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
WIDTH = 100
BLOCK = re.compile(r"^```\n(\$ gradclip .*?)\n```$", re.MULTILINE | re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")


def examples(text: str) -> list[tuple[str, str]]:
    """(command, expected output) for every runnable block, in README order."""
    found = []
    for match in BLOCK.finditer(text):
        command, _, output = match.group(1).partition("\n")
        found.append((command.removeprefix("$ "), output))
    return found


def run(command: str) -> str:
    """The block's text for ``command``: stdout and stderr interleaved as a terminal shows them."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "COLUMNS": str(WIDTH), "PATH": bin_dir + os.pathsep + os.environ["PATH"],
           "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1"}
    for var in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE"):
        env.pop(var, None)
    with tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.run(
            ["bash", "-c", command.replace("/tmp/", scratch + "/")], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
        )  # fmt: skip
        output = proc.stdout.replace(scratch + "/", "/tmp/")
    return "\n".join(line.rstrip() for line in output.rstrip("\n").splitlines())


def same(expected: str, actual: str) -> bool:
    """Equal text, with numbers within 1e-9 relative and any run of spaces as one."""
    def parts(text: str):
        text = re.sub(r"[ \t]+", " ", text.strip())
        return NUMBER.split(text), [float(x) for x in NUMBER.findall(text)]

    (words_a, numbers_a), (words_b, numbers_b) = parts(expected), parts(actual)
    return words_a == words_b and len(numbers_a) == len(numbers_b) and all(
        math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) for a, b in zip(numbers_a, numbers_b))


@pytest.mark.parametrize("command, expected", examples(README.read_text(encoding="utf-8")))
def test_readme_example(command, expected):
    actual = run(command)
    assert same(expected, actual), f"README block for `{command}` is stale:\n{actual}"


def test_the_readme_has_examples_and_the_clone_stays_clean():
    commands = [command for command, _ in examples(README.read_text(encoding="utf-8"))]
    assert any(c.startswith("gradclip inspect") for c in commands)
    assert any(c.startswith("gradclip clip") for c in commands)
    # Every example that writes a file writes it under /tmp/ (8.7: nothing left in the clone).
    for command in commands:
        for flag in ("-o", "--output", "--output-file"):
            if f" {flag} " in command:
                assert command.split(f" {flag} ", 1)[1].startswith("/tmp/"), command


def update() -> None:
    text = README.read_text(encoding="utf-8")

    def replace(match: re.Match) -> str:
        command = match.group(1).partition("\n")[0]
        return f"```\n{command}\n{run(command.removeprefix('$ '))}\n```"

    README.write_text(BLOCK.sub(replace, text), encoding="utf-8")


if __name__ == "__main__":
    update()
