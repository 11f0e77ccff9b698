"""The training-loop guide's (docs/guides/training-loop.md) output blocks are what the
plain loop prints.

The loop trains 60 float32 steps, whose last digits differ between CPU kinds,
so numbers compare within 1e-5 relative (the tables print 6 digits).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.cli.support import REPO
from tests.test_readme import TRAINED_TOLERANCE, WIDTH, same


def shell(command: str, cwd: Path) -> str:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "COLUMNS": str(WIDTH), "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8",
           "PATH": bin_dir + os.pathsep + os.environ["PATH"]}  # fmt: skip
    for var in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE"):
        env.pop(var, None)
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return "\n".join(line.rstrip() for line in done.stdout.rstrip("\n").splitlines())


def test_the_plain_loop_blocks_show_what_it_prints(tmp_path):
    section = (REPO / "docs" / "guides" / "training-loop.md").read_text(encoding="utf-8")
    code = section[section.index("```python\n") + len("```python\n") :]
    (tmp_path / "train.py").write_text(code[: code.index("```")])
    shown = section[section.index("```console\n") + len("```console\n") :]
    shown = shown[: shown.index("\n```")]
    # "$ command" lines, each followed by its output
    blocks = re.split(r"^\$ (.*)$", shown, flags=re.MULTILINE)[1:]
    commands, outputs = blocks[0::2], blocks[1::2]
    assert commands[0].startswith("python train.py") and commands[1].startswith("gradclip inspect")
    for command, output in zip(commands, outputs):
        actual = shell(command, tmp_path)
        assert same(output.strip("\n"), actual, TRAINED_TOLERANCE), (
            f"training-loop.md block for `{command}` is stale:\n{actual}"
        )
