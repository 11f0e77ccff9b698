"""What a gradclip run imports before any work: modules in all, and those of torch, rich, pydantic.

    .venv/bin/python -m benchmarks.startup_imports [TREE ...]   # default: this checkout

Counts are of ``sys.modules`` as a fresh process ends (built-in modules
included); they do not depend on load, unlike import times on a shared machine.
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


# ``python -m gradclip_cli ARGS``, then sys.modules as the process ends. (``-X importtime``
# misses modules loaded through importlib.import_module: the formats and the commands.)
RUN_AND_LIST = """
import atexit, runpy, sys
atexit.register(lambda: sys.__stderr__.write("\\nMODULES " + " ".join(sorted(sys.modules)) + "\\n"))
sys.argv[0] = "gradclip"
runpy.run_module("gradclip_cli", run_name="__main__", alter_sys=True)
"""


def imported(tree: Path, args: list[str]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST, *args], cwd=tree,
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    listed = [line for line in proc.stderr.splitlines() if line.startswith("MODULES ")]
    return listed[-1].split()[1:]


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
