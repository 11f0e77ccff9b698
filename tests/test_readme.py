"""The command examples of the README and of every page of the docs site are what the
commands print.

In README.md and every Markdown file under docs/ (the layout pages' examples in
docs/layouts/_examples/ included), every fenced block whose first line starts
with ``$ `` is an output block, and each one is checked or says why not. An
HTML comment on the line before the fence (invisible on GitHub) says how it is
made:

- none (a plain fence, ``$ gradclip ...``): run from the repository root;
- ``<!-- readme: run after the python block above, saved as train.py -->``:
  the nearest ``python`` block above is written to ``train.py`` in a fresh
  folder, and the block's commands run there;
- ``<!-- readme: run in tests/trainer_runs.py's FUNCTION, as output/ -->``:
  that real Trainer run is made into ``output/`` of a fresh folder (once a
  session), and the block's commands run there;
- ``<!-- readme: shown, not run: REASON -->``: not run, for the reason given
  (which must name where the test suite checks the same thing).

A block with several ``$`` lines runs them in order in one folder, each
line's output below it. Output is stdout and stderr interleaved as a
terminal shows them, at ``COLUMNS=120`` (the width gradclip takes in a pipe).
Numbers compare within 1e-9 relative in blocks run on the repository's samples,
and within 1e-5 in blocks made by a training run (float32 training over tens of steps differs in the
last digits between CPU kinds: 1053.37082 against 1053.37088 seen here); runs
of spaces compare as one. ``/tmp/`` in a command is a fresh temporary folder,
so examples leave nothing behind.

To rewrite the blocks from real output after a change (every page, or the ones named):

    python -m tests.test_readme [README.md docs/guides/diverged.md ...]
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
WIDTH = 120
FENCE = re.compile(
    r"^(?:<!-- readme: (?P<how>[^\n]*?) -->\n)?```(?P<info>[a-z]*)\n(?P<body>.*?)\n```$",
    re.MULTILINE | re.DOTALL,
)
PYTHON = re.compile(r"^```python\n(.*?)\n```$", re.MULTILINE | re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?")
TRAIN_PY = "run after the python block above, saved as train.py"
TRAINER_RUN = re.compile(r"run in tests/trainer_runs\.py's (\w+), as output/")
NOT_RUN = "shown, not run: "
SAMPLE_TOLERANCE, TRAINED_TOLERANCE = 1e-9, 1e-5


@dataclass(frozen=True)
class Example:
    line: int  # of the fence, for messages
    how: str | None
    commands: list[str]
    output: str  # the block's text after its first "$ " line
    span: tuple[int, int]  # of the whole match, for rewriting
    setup: str | None  # train.py's text, for TRAIN_PY blocks

    @property
    def tolerance(self) -> float:
        return SAMPLE_TOLERANCE if self.how is None else TRAINED_TOLERANCE

    @property
    def first(self) -> str:
        return self.commands[0]


def output_blocks(text: str) -> list[Example]:
    """Every fenced block whose first line starts with ``$ ``, in README order."""
    found = []
    for match in FENCE.finditer(text):
        body = match.group("body")
        if not body.startswith("$ "):
            continue
        first, _, output = body.partition("\n")
        commands = [first] + [line for line in output.splitlines() if line.startswith("$ ")]
        before = text[: match.start()]
        pythons = PYTHON.findall(before)
        found.append(Example(
            line=before.count("\n") + 1, how=match.group("how"),
            commands=[c.removeprefix("$ ") for c in commands], output=output,
            span=match.span(), setup=pythons[-1] if pythons else None,
        ))  # fmt: skip
    return found


def examples(text: str) -> list[Example]:
    """The blocks that are run (all but the ones marked shown, not run)."""
    return [e for e in output_blocks(text) if not (e.how or "").startswith(NOT_RUN)]


_TRAINER_RUNS: dict[str, Path] = {}


def _trainer_run(function: str) -> Path:
    """A folder holding ``output/``, the real Trainer run ``function`` makes (once)."""
    if function not in _TRAINER_RUNS:
        from tests import trainer_runs

        folder = Path(tempfile.mkdtemp(prefix="readme-run-"))
        getattr(trainer_runs, function)(folder / "output")
        _TRAINER_RUNS[function] = folder
    return _TRAINER_RUNS[function]


def _shell(command: str, cwd: Path, scratch: str) -> str:
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "COLUMNS": str(WIDTH),
        "PATH": bin_dir + os.pathsep + os.environ["PATH"],
        "NO_COLOR": "1",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONUNBUFFERED": "1",
    }
    for var in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE"):
        env.pop(var, None)
    proc = subprocess.run(
        ["bash", "-c", command.replace("/tmp/", scratch + "/")], cwd=cwd, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
    )  # fmt: skip
    output = proc.stdout.replace(scratch + "/", "/tmp/")
    return "\n".join(line.rstrip() for line in output.rstrip("\n").splitlines())


def run(example: Example) -> str:
    """The block's text after its first line: each command's output, and each later
    ``$`` line before its own output, as a terminal shows them."""
    with tempfile.TemporaryDirectory() as scratch:
        if example.how is None:
            cwd = REPO
        elif example.how == TRAIN_PY:
            assert example.setup is not None, f"README line {example.line}: no python block"
            cwd = Path(scratch) / "run"
            cwd.mkdir()
            (cwd / "train.py").write_text(example.setup + "\n", encoding="utf-8")
        elif (named := TRAINER_RUN.fullmatch(example.how)) is not None:
            cwd = _trainer_run(named.group(1))
        else:
            raise AssertionError(f"README line {example.line}: unknown marker {example.how!r}")
        parts = []
        for i, command in enumerate(example.commands):
            if i:
                parts.append(f"$ {command}")
            text = _shell(command, cwd, scratch)
            if text:
                parts.append(text)
        return "\n".join(parts)


def same(expected: str, actual: str, tolerance: float = SAMPLE_TOLERANCE) -> bool:
    """Equal text, with numbers within ``tolerance`` relative and any run of spaces as one."""

    def parts(text: str):
        text = re.sub(r"[ \t]+", " ", text.strip())
        return NUMBER.split(text), [float(x) for x in NUMBER.findall(text)]

    (words_a, numbers_a), (words_b, numbers_b) = parts(expected), parts(actual)
    return (
        words_a == words_b
        and len(numbers_a) == len(numbers_b)
        and all(
            math.isclose(a, b, rel_tol=tolerance, abs_tol=0.0) for a, b in zip(numbers_a, numbers_b)
        )
    )


def pages() -> list[Path]:
    """README.md, then every Markdown file of the docs site, in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


_TEXTS = {_name(page): page.read_text(encoding="utf-8") for page in pages()}
_README = _TEXTS["README.md"]
_EXAMPLES = [(name, e) for name, text in _TEXTS.items() for e in examples(text)]


@pytest.mark.parametrize(
    "page, example", _EXAMPLES, ids=[f"{name}:{e.line}" for name, e in _EXAMPLES]
)
def test_readme_example(page, example):
    actual = run(example)
    assert same(example.output, actual, example.tolerance), (
        f"{page} block at line {example.line} (`{example.first}`) is stale:\n{actual}"
    )


@pytest.mark.parametrize("page", list(_TEXTS))
def test_every_output_block_is_checked_or_says_why_not(page):
    for block in output_blocks(_TEXTS[page]):
        where = f"{page} line {block.line} (`{block.first}`)"
        if block.how is None:
            # Run from the repository root: only the samples it ships.
            assert block.first.startswith("gradclip "), f"{where}: not a gradclip command"
            continue
        if block.how.startswith(NOT_RUN):
            reason = block.how.removeprefix(NOT_RUN)
            assert "tests/" in reason, f"{where}: the reason must name the test that checks it"
            continue
        assert block.how == TRAIN_PY or TRAINER_RUN.fullmatch(block.how), (
            f"{where}: unknown marker {block.how!r}"
        )


def test_every_command_people_copy_is_run_not_shown():
    # The README's recipes run: inspect, clip, trend, and a training loop.
    readme = [c for e in examples(_README) for c in e.commands]
    for command in ("gradclip inspect", "gradclip clip", "gradclip trend"):
        assert any(command in c for c in readme), command
    assert any("python train.py" in e.first for e in examples(_README))
    # The site runs every command, and blocks on most of its pages.
    site = [c for name, e in _EXAMPLES if name != "README.md" for c in e.commands]
    for command in ("gradclip inspect", "gradclip clip", "gradclip trend", "gradclip compare"):
        assert any(c.startswith(command) for c in site), command
    assert len(output_blocks("\n".join(_TEXTS.values()))) > 40


def test_the_examples_leave_the_clone_clean():
    for _, example in _EXAMPLES:
        if example.how is not None:
            continue  # runs in a folder of its own
        for command in example.commands:
            # Every example that writes a file writes it under /tmp/ (nothing left in the clone).
            for flag in ("-o", "--output", "--output-file"):
                if f" {flag} " in command:
                    assert command.split(f" {flag} ", 1)[1].startswith("/tmp/"), command


def update(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for example in reversed(examples(text)):
        start, end = example.span
        block = text[start:end]
        head = (
            block[: block.index("\n$ ") + 1]
            if block.startswith("<!--")
            else block[: block.index("\n") + 1]
        )
        new = f"{head}$ {example.first}\n{run(example)}\n```"
        text = text[:start] + new + text[end:]
    page.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    for page in [REPO / arg for arg in sys.argv[1:]] or pages():
        update(page)
