"""Issue 9: ``gradclip inspect`` of a ``torch.distributed.checkpoint`` folder against the floor.

A DCP checkpoint of ``--gb`` GB (float32 gradients, 10 MB tensors, written
by ``dcp.save`` as two ranks would: every tensor split row-wise into two
chunks, ``__0_0.distcp`` and ``__1_0.distcp``) is inspected as a fresh
process each time, page cache warm:

* floor: a process that imports torch and reads every byte of every
  ``.distcp`` file once, the least any tool that looks at every element costs;
* today: what a user does without gradclip, ``python -m
  torch.distributed.checkpoint.format_utils dcp_to_torch`` to a ``torch.save``
  file, then ``torch.load`` and ``torch.nn.utils.get_total_norm``;
* gradclip: ``gradclip inspect FOLDER --format json``.

    python -m benchmarks.dcp_bench --gb 2 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from .timing import fmt_bytes, fmt_seconds, interleaved, run_process

PYTHON = sys.executable
GRADCLIP = str(Path(sys.executable).with_name("gradclip"))

FLOOR = """
import sys, glob, torch
buf = bytearray(16 << 20)
for path in sorted(glob.glob(sys.argv[1] + "/*.distcp")):
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
"""

TODAY = """
import subprocess, sys, torch
folder, out = sys.argv[1], sys.argv[2]
subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils",
                "dcp_to_torch", folder, out], check=True, stdout=subprocess.DEVNULL)
state = torch.load(out, weights_only=True)
print(float(torch.nn.utils.get_total_norm(list(state["grads"].values()))))
"""


def make_checkpoint(folder: Path, gb: float) -> int:
    """Two spawned gloo ranks ``dcp.save`` ``{"grads": {...}}``, each tensor a DTensor
    sharded row-wise over both (as FSDP2 shards a parameter); returns the bytes of data."""
    import torch.multiprocessing as mp

    mp.spawn(_save_rank, args=(2, str(folder), gb), nprocs=2, join=True)
    return int(gb * (1 << 30)) // (10 << 20) * (10 << 20)


def _save_rank(rank: int, world: int, folder: str, gb: float) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{folder}.store", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    per = 10 << 20
    count = int(gb * (1 << 30) // per)
    g = torch.Generator().manual_seed(0)
    grads = {}
    for i in range(count):
        full = torch.randn(per // 4 // 1024, 1024, generator=g)
        grads[f"layers.{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"grads": grads}, checkpoint_id=folder)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gradclip-dcp-bench-"))
    try:
        folder = root / "checkpoint"
        size = make_checkpoint(folder, args.gb)
        files = len(list(folder.glob("*.distcp")))
        converted = root / "converted.pt"
        contenders = {
            "floor (read every .distcp once)": lambda: run_process(
                [PYTHON, "-c", FLOOR, str(folder)]),
            "today (dcp_to_torch + torch.load + get_total_norm)": lambda: run_process(
                [PYTHON, "-c", TODAY, str(folder), str(converted)]),
            "gradclip inspect": lambda: run_process(
                [GRADCLIP, "inspect", str(folder), "--format", "json", "-q"]),
        }
        results = interleaved(contenders, args.repeats)
        floor = results["floor (read every .distcp once)"].median
        print(f"DCP checkpoint: {fmt_bytes(size)} float32 gradients in {files} .distcp files "
              f"(2 chunks per tensor); median of {args.repeats}, page cache warm\n")
        print("| contender | median | ratio to floor | peak RSS |")
        print("| --- | --- | --- | --- |")
        for name, result in results.items():
            print(f"| {name} | {fmt_seconds(result.median)} | {result.median / floor:.2f}x | "
                  f"{fmt_bytes(result.max_rss)} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
