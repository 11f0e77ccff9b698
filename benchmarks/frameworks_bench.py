"""Issue 17: ``gradclip inspect`` of >= 1 GB torchtitan and Megatron checkpoints against the floor.

    python -m benchmarks.frameworks_bench --gb 1.2 --repeats 5
    python -m benchmarks.frameworks_bench --gb 1.2 --repeats 5 --clock cpu   # a loaded machine

Each checkpoint is written on this CPU by the framework's own saving code
(``benchmarks/framework_checkpoints.py``, run in the frameworks venv that
``GRADCLIP_FRAMEWORKS_PYTHON`` or ``--frameworks-python`` names: the test
fixtures' run scripts at a larger model size, one AdamW step):

* torchtitan: ``checkpoint/step-1/``, its ``CheckpointManager``'s full save;
* Megatron: the save folder (``latest_checkpointed_iteration.txt`` naming
  ``iter_0000001/``, ``torch_dist`` written by ``dist_checkpointing.save``).

Contenders, each a fresh process, interleaved, medians:

* floor: a process that imports torch and reads every byte of every file of
  the checkpoint once (``readinto`` a 16 MiB buffer);
* ``gradclip inspect PATH --format json -q``: what a user runs (``auto``:
  the bias-corrected first moment, with the weights for ``ratio``);
* ``gradclip inspect PATH --what update --format json -q``: every tensor of
  the checkpoint read (weights, both moments).

Two page-cache states, each its own interleaved run, as distributed_bench.py:
warm (the warm-up repetition read the files) and cold (every file's pages
dropped with ``posix_fadvise(DONTNEED)`` before each run). The checkpoints
are deleted at the end unless ``--keep-data`` (then they stay in
``benchmarks/_data/`` and are reused).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from . import inputs
from .timing import fmt_bytes, fmt_seconds, interleaved, markdown_table, run_process

PYTHON = sys.executable
FRAMEWORKS = ("torchtitan", "megatron")

FLOOR = """
import os, sys, torch
buf = bytearray(16 << 20)
for root, _, names in sorted(os.walk(sys.argv[1])):
    for name in sorted(names):
        with open(os.path.join(root, name), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
"""


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def drop_cache(folder: Path) -> None:
    """Drop the pages of every file under ``folder`` from the page cache (our own files)."""
    for file in files_of(folder):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint(python: str, framework: str, gb: float) -> tuple[Path, Path]:
    """``(what inspect is given, the folder the floor reads)``, generated once into _data/."""
    from .framework_checkpoints import generate

    out = inputs.DATA / f"{framework}_{gb:g}GB"
    folder = out / "run" / ("checkpoint/step-1" if framework == "torchtitan" else "")
    if not (out / "done").exists():
        if out.exists():
            shutil.rmtree(out)
        generate(python, framework, out, gb)
        (out / "done").touch()
    given = folder if framework == "torchtitan" else out / "run"
    return given.resolve(), folder.resolve()


def _contender(argv: list[str], folder: Path, cold: bool):
    def run() -> int:
        if cold:
            drop_cache(folder)
        return run_process(argv)

    return run


def children_cpu_time() -> float:
    """CPU time (user + system) of every finished child process and its own children:
    what a contender costs, which the load of other processes on a shared machine
    adds little to (wall time does not hold still there)."""
    times = os.times()
    return times.children_user + times.children_system


def bench(framework: str, given: Path, folder: Path, repeats: int, clock=None) -> str:
    files = files_of(folder)
    size = sum(f.stat().st_size for f in files)
    gradclip = [PYTHON, "-m", "gradclip_cli", "inspect", str(given), "--format", "json", "-q"]
    argvs = {
        "floor (import torch, read every file once)": [PYTHON, "-c", FLOOR, str(folder)],
        "gradclip inspect --format json": gradclip,
        "gradclip inspect --what update --format json": [
            *gradclip[:5],
            "--what",
            "update",
            *gradclip[5:],
        ],
    }
    rows = []
    for cache in ("warm", "cold"):
        results = interleaved(
            {n: _contender(a, folder, cache == "cold") for n, a in argvs.items()}, repeats,
            **({"clock": clock} if clock else {}),
        )
        floor = results[next(iter(argvs))].median
        for name, result in results.items():
            rows.append(
                [
                    cache,
                    name,
                    fmt_seconds(result.median),
                    f"{size / result.median / 1e9:.2f}",
                    f"{result.median / floor:.2f}x",
                    fmt_bytes(result.max_rss),
                ]
            )
    distcp = [f for f in files if f.suffix == ".distcp"]
    return (
        f"{framework}: `{given.relative_to(inputs.DATA)}`, {size / 1e9:.2f} GB "
        f"({fmt_bytes(size)}) in {len(files)} files ({len(distcp)} .distcp); "
        f"median of {repeats}{', CPU time' if clock else ''}\n\n"
        + markdown_table(
            ["page cache", "contender", "median", "GB/s", "time / floor", "peak RSS"], rows
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.2, help="GiB of each checkpoint")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=FRAMEWORKS, action="append")
    parser.add_argument("--frameworks-python", default=os.environ.get("GRADCLIP_FRAMEWORKS_PYTHON"))
    parser.add_argument("--keep-data", action="store_true")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall time (default), or the contenders' CPU time (user + "
                             "system, every thread), for a loaded machine")
    args = parser.parse_args()
    if not args.frameworks_python:
        parser.error(
            "name the frameworks venv's python: --frameworks-python or "
            "GRADCLIP_FRAMEWORKS_PYTHON (tests/frameworks/conftest.py)"
        )
    frameworks = args.only or FRAMEWORKS
    inputs.DATA.mkdir(exist_ok=True)
    need = 1.2 * args.gb * (1 << 30) * len(frameworks)
    free = shutil.disk_usage(inputs.DATA).free
    if free < 2 * need:
        sys.exit(f"{inputs.DATA}: {fmt_bytes(free)} free, want {fmt_bytes(2 * need)}")
    from .run import machine

    print(f"Machine: {machine()}")
    print(f"Command: `python -m benchmarks.frameworks_bench {' '.join(sys.argv[1:])}`\n")
    made = []
    try:
        for framework in frameworks:
            made.append(inputs.DATA / f"{framework}_{args.gb:g}GB")
            given, folder = checkpoint(args.frameworks_python, framework, args.gb)
            clock = children_cpu_time if args.clock == "cpu" else None
            print(bench(framework, given, folder, args.repeats, clock), "\n", flush=True)
    finally:
        if not args.keep_data:
            for out in made:
                shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
