"""The site's pictures, made from real runs (never drawn): run from the repository root
after changing what they show, and commit the files it writes.

- ``docs/images/trend-spike.png``: ``gradclip trend --plot`` of the test suite's real
  Hugging Face Trainer run whose ``transformer.h.1`` gradients are multiplied by 1000
  at step 12, watched by ``GradMonitor`` (``tests/trainer_runs.py``'s
  ``train_run_folder``; needs the ``test`` extra).
- ``docs/images/inspect-table.svg``: the coloured table ``gradclip inspect`` prints on a
  terminal for ``sample_checkpoints/exploding.pt``, recorded by rich (the library that
  prints it) as SVG.

    python docs/make_images.py
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "docs" / "images"
COMMAND = ["inspect", "sample_checkpoints/exploding.pt", "--max-norm", "100", "--top", "3"]


def gradclip(*args: str, env: dict | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gradclip_cli", *args], cwd=REPO, capture_output=True,
        text=True, env={**os.environ, **(env or {})}, timeout=600,
    )  # fmt: skip
    if done.returncode not in (0, 1):
        raise SystemExit(f"gradclip {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done.stdout


def trend_plot() -> None:
    sys.path.insert(0, str(REPO))
    from tests.trainer_runs import train_run_folder

    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "output"
        train_run_folder(output)
        gradclip("trend", str(output), "--plot", str(IMAGES / "trend-spike.png"))


def table_svg() -> None:
    from rich.console import Console
    from rich.text import Text

    ansi = gradclip(*COMMAND, env={"FORCE_COLOR": "1", "COLUMNS": "120", "NO_COLOR": ""})
    console = Console(
        record=True, width=120, force_terminal=True, color_system="truecolor", file=io.StringIO()
    )
    console.print(Text.from_ansi(ansi), soft_wrap=True)
    svg = console.export_svg(title="gradclip " + " ".join(COMMAND))
    # No web font: the picture needs nothing from the network (the page's own monospace).
    svg = re.sub(r"@font-face\s*\{.*?\}\s*", "", svg, flags=re.DOTALL)
    (IMAGES / "inspect-table.svg").write_text(svg, encoding="utf-8")


if __name__ == "__main__":
    IMAGES.mkdir(parents=True, exist_ok=True)
    table_svg()
    trend_plot()
    for path in sorted(IMAGES.iterdir()):
        print(f"{path.relative_to(REPO)}: {path.stat().st_size:,} bytes")
