"""What a gradclip run imports before any work: modules in all, and those of torch, rich, pydantic.

    .venv/bin/python -m benchmarks.startup_imports [TREE ...]   # default: this checkout

Counts come from ``python -X importtime`` in a fresh process and do not depend
on load, unlike import times on a shared machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

COMMANDS = {
    "--help": ["--help"],
    "--version": ["--version"],
    "inspect --format json": ["inspect", "sample_checkpoints/healthy.pt", "--format", "json"],
    "inspect (table)": ["inspect", "sample_checkpoints/healthy.pt"],
}


def imported(tree: Path, args: list[str]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gradclip_cli", *args], cwd=tree,
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    return [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
            if line.startswith("import time:") and "|" in line and "package" not in line]


def count(names: list[str], package: str) -> int:
    return sum(1 for n in names if n == package or n.startswith(package + "."))


def main() -> None:
    trees = [Path(t) for t in sys.argv[1:]] or [Path(__file__).resolve().parent.parent]
    print("| command | tree | modules | torch | rich | pydantic |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for label, args in COMMANDS.items():
        for tree in trees:
            names = imported(tree, args)
            pyd = count(names, "pydantic") + count(names, "pydantic_core")
            print(f"| `{label}` | {tree} | {len(names)} | {count(names, 'torch')} | "
                  f"{count(names, 'rich')} | {pyd} |")


if __name__ == "__main__":
    main()
