"""Issue 9: ``gradclip inspect`` of a Hugging Face sharded checkpoint against the floor.

A set of ``--gb`` GB (float32, written by ``huggingface_hub.save_torch_state_dict``
in 250 MB shards) is inspected as a fresh process each time, page cache warm:

* floor: a process that imports torch and reads every byte of every shard
  once, the least any tool that looks at every element can cost;
* plain: what a user writes today, ``safe_open`` on each shard and
  ``torch.nn.utils.get_total_norm`` over all tensors;
* gradclip: ``gradclip inspect FOLDER --format json``.

    python -m benchmarks.layouts_bench --gb 2 --repeats 5
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .timing import fmt_bytes, fmt_seconds, interleaved, run_process

PYTHON = sys.executable
GRADCLIP = str(Path(sys.executable).with_name("gradclip"))

FLOOR = """
import sys, glob, torch
buf = bytearray(16 << 20)
for path in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
"""

PLAIN = """
import sys, glob, torch
from safetensors import safe_open
tensors = []
for path in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    with safe_open(path, framework="pt") as f:
        tensors += [f.get_tensor(k) for k in f.keys()]
print(float(torch.nn.utils.get_total_norm(tensors)))
"""


def make_set(folder: Path, gb: float) -> int:
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(0)
    per = 10 << 20  # 10 MB tensors
    count = int(gb * (1 << 30) // per)
    state = {f"model.layers.{i}.weight": torch.randn(per // 4, generator=g) for i in range(count)}
    save_torch_state_dict(state, folder, max_shard_size="250MB")
    return sum(t.numel() * 4 for t in state.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gradclip-layouts-bench-"))
    try:
        folder = root / "set"
        folder.mkdir()
        size = make_set(folder, args.gb)
        shards = len(list(folder.glob("*.safetensors")))
        contenders = {
            "floor (read every shard once)": lambda: run_process(
                [PYTHON, "-c", FLOOR, str(folder)]),
            "plain (safe_open + get_total_norm)": lambda: run_process(
                [PYTHON, "-c", PLAIN, str(folder)]),
            "gradclip inspect": lambda: run_process(
                [GRADCLIP, "inspect", str(folder), "--format", "json", "-q"]),
        }
        results = interleaved(contenders, args.repeats)
        floor = results["floor (read every shard once)"].median
        print(f"HF sharded set: {fmt_bytes(size)} float32 in {shards} safetensors shards; "
              f"median of {args.repeats}, page cache warm\n")
        print("| contender | median | ratio to floor | peak RSS |")
        print("| --- | --- | --- | --- |")
        for name, result in results.items():
            print(f"| {name} | {fmt_seconds(result.median)} | {result.median / floor:.2f}x | "
                  f"{fmt_bytes(result.max_rss)} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
