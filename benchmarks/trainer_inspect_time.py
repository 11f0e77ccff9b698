"""Where ``gradclip inspect checkpoint-N/`` spends its time on a Hugging Face Trainer checkpoint.

A Trainer checkpoint's ``model.safetensors`` sorts its names, so mapping
``optimizer.pt`` to parameter names rebuilds the model's parameter order from
``config.json`` with transformers (on the meta device). Each row is a fresh
process, run side by side in one loop, median of ``--repeats``:

- ``import torch``: the floor every command pays;
- ``import torch + the model class``: transformers and its modeling module
  (what rebuilding the order imports);
- ``gradclip inspect``: the whole command.

    python -m benchmarks.trainer_inspect_time CHECKPOINT_DIR --repeats 5

Make a checkpoint with ``tests/trainer_runs.py``'s ``train_checkpointed_with_spike``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _seconds(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(args, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = json.loads((args.checkpoint / "config.json").read_text())
    model_class = config["architectures"][0]
    rows = {
        "import torch": [sys.executable, "-c", "import torch"],
        "import torch + the model class": [
            sys.executable, "-c", f"import torch, transformers; transformers.{model_class}"],
        "gradclip inspect": [sys.executable, "-m", "gradclip_cli", "inspect",
                             str(args.checkpoint), "--no-progress"],
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, command in rows.items():
            times[name].append(_seconds(command))
    whole = statistics.median(times["gradclip inspect"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:34s} median {median:6.2f} s  ({median / whole:.0%} of inspect)")


if __name__ == "__main__":
    main()
