"""Issue 10: ``gradclip inspect`` on 1 process, and under torchrun with 1 and 2 ranks.

    python -m benchmarks.distributed_bench [--repeats N] [--layout file|hf-sharded|dcp]

``file``: a 2 GB bfloat16 file (119 tensors of 16 MiB, benchmarks/inputs.py);
``hf-sharded``: a 2 GB float32 set in 250 MB shards, as layouts_bench.py
writes it (``huggingface_hub.save_torch_state_dict``); ``dcp``: a 2 GB float32
DCP folder written by two gloo ranks, each tensor sharded row-wise over both
(dcp_bench.py). Each
contender is a fresh process (or a torchrun with its ranks), so start-up
counts for all alike. Two page-cache states, each in its own interleaved run:

* warm: the warm-up repetition has read the file, and nothing evicts it;
* cold: before every run the file's pages are dropped with
  ``posix_fadvise(DONTNEED)`` (our own file: no root needed), so the run reads
  it from disk.

On a 2-core machine two ranks can at best halve the compute, and they share
one disk; the ratios say what is gained here, not on a cluster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from . import inputs
from .timing import fmt_seconds, interleaved, markdown_table

PYTHON = sys.executable
TENSOR = 8 << 20  # elements: 16 MiB of bfloat16


def drop_cache(path: Path) -> None:
    """Drop the pages of ``path`` (a file, or every file of a folder) from the page cache."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint(layout: str) -> tuple[Path, str]:
    """The checkpoint to read (built once, kept in the inputs folder) and a description."""
    if layout == "file":
        count = round(2.0e9 / (TENSOR * 2))
        path = inputs.checkpoint_file("uniform_2.0GB_bf16", inputs.uniform_shapes(count, TENSOR),
                                      torch.bfloat16)
        return path, f"{path.stat().st_size / 1e9:.2f} GB, {count} tensors"
    if layout == "dcp":
        from .dcp_bench import make_checkpoint

        folder = inputs.DATA / "dcp_2.0GB_f32"
        if not (folder / ".metadata").exists():
            if folder.exists():
                shutil.rmtree(folder)
            inputs.DATA.mkdir(exist_ok=True)
            make_checkpoint(folder, 2.0)
        files = sorted(folder.glob("*.distcp"))
        size = sum(f.stat().st_size for f in files)
        return folder, f"{size / 1e9:.2f} GB in {len(files)} .distcp files (2 chunks a tensor)"
    from .layouts_bench import make_set

    folder = inputs.DATA / "hf_sharded_2.0GB_f32"
    if not (folder / "model.safetensors.index.json").exists():
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        make_set(folder, 2.0)
    shards = sorted(folder.glob("*.safetensors"))
    size = sum(s.stat().st_size for s in shards)
    return folder, f"{size / 1e9:.2f} GB in {len(shards)} safetensors shards"


def _command(path: Path, ranks: int | None) -> list[str]:
    gradclip = ["-m", "gradclip_cli", "inspect", str(path), "--format", "json", "--quiet"]
    if ranks is None:
        return [PYTHON, *gradclip]
    return [PYTHON, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", *gradclip]


def _contender(path: Path, ranks: int | None, cold: bool):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}

    def run() -> None:
        if cold:
            drop_cache(path)
        subprocess.run(_command(path, ranks), check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env=env)

    return run


def gather_rank(pieces: int) -> None:
    """Under torchrun: median time of gathering ``pieces`` tensors' sums (the one collective)."""
    import statistics
    import time

    from gradclip_cli.core import tensor_power_sums
    from gradclip_cli.distributed import launcher
    from gradclip_cli.distributed.combine import gather_power_sums
    from gradclip_cli.distributed.pieces import assign, owned

    session = launcher.join(torch.device("cpu"))
    mine = owned(assign([4096] * pieces, session.world_size), session.rank)
    local = tensor_power_sums([torch.randn(4) for _ in mine], 2.0)
    times = []
    for _ in range(21):
        start = time.perf_counter()
        gather_power_sums(session, local, mine, pieces)
        times.append(time.perf_counter() - start)
    if session.primary:
        print(f"GATHER {pieces} {1e3 * statistics.median(times):.1f}")
    launcher.leave()


def gather_cost(ranks: int = 2) -> list[list[str]]:
    rows = []
    for pieces in (1_000, 20_000):
        done = subprocess.run(
            [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
             "-m", "benchmarks.distributed_bench", "--gather-rank", str(pieces)],
            check=True, capture_output=True, text=True)
        ms = [line.split()[2] for line in done.stdout.splitlines() if line.startswith("GATHER")]
        rows.append([f"{pieces:,}", str(ranks), f"{ms[0]} ms"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=("file", "hf-sharded", "dcp"), default="file")
    parser.add_argument("--gather-rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gather_rank:
        gather_rank(args.gather_rank)
        return
    path, description = checkpoint(args.layout)
    names = {"1 process (no launcher)": None, "torchrun, 1 rank": 1, "torchrun, 2 ranks": 2}
    rows = []
    for cache in ("warm", "cold"):
        contenders = {n: _contender(path, r, cache == "cold") for n, r in names.items()}
        results = interleaved(contenders, args.repeats)
        base = results["1 process (no launcher)"].median
        for name in names:
            median = results[name].median
            rows.append([cache, name, fmt_seconds(median), f"{base / median:.2f}x"])
    print(f"{path.name}: {description}, {os.cpu_count()} CPUs, {args.repeats} repeats "
          "(median)\n")
    print(markdown_table(["page cache", "run", "median", "speed-up vs 1 process"], rows))
    print("\nThe one gather (gloo, median of 21):\n")
    print(markdown_table(["tensors", "ranks", "gather"], gather_cost()))


if __name__ == "__main__":
    main()
