"""Before/after: the same measurements on two source trees, alternating, medians.

    git archive BASE | tar -x -C /tmp/base
    .venv/bin/python -m benchmarks.compare_trees /tmp/base .

Per tree: the core on GPT-2-shaped float32 and bfloat16 gradients (what
``inspect`` runs per measurement: ``element_power_sums`` over the distinct
elements where the tree has it, else ``tensor_power_sums``; 1 torch thread,
2 workers, median of 5 after a warm-up, 3 processes), and ``inspect --format
json`` end to end on benchmarks/_data's GPT-2 and 20,000-tensor files (5 runs).
Runs alternate between the trees, so slow drifts in load hit both alike.
Prints Markdown rows: what, before, after, after/before.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "_data"
CORE = r'''
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from benchmarks import inputs
import gradclip_cli.core as core
torch.set_num_threads(1)
grads = inputs.gradients(inputs.gpt2_shapes(), getattr(torch, sys.argv[2]))
def once():
    if hasattr(core, "element_power_sums"):
        return core.element_power_sums(core.distinct_elements(grads), 2.0, workers=2)
    return core.tensor_power_sums(grads, 2.0, workers=2)
once()
times = []
for _ in range(5):
    start = time.perf_counter(); once(); times.append(time.perf_counter() - start)
print(sorted(times)[2])
'''


def _env(tree: str) -> dict:
    return {**os.environ, "PYTHONPATH": tree}


def core(tree: str, dtype: str) -> float:
    out = subprocess.run([sys.executable, "-c", CORE, tree, dtype], env=_env(tree), cwd=tree,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def inspect(tree: str, name: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gradclip_cli", "inspect", str(DATA / name),
                    "--format", "json", "-q"], env=_env(tree), cwd=tree,
                   stdout=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main() -> None:
    before, after = (str(Path(p).resolve()) for p in sys.argv[1:3])
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(3):
        for tree in (before, after):
            for dtype in ("float32", "bfloat16"):
                results.setdefault((tree, f"core, GPT-2 {dtype}"), []).append(core(tree, dtype))
    for _ in range(5):
        for tree in (before, after):
            for name in ("gpt2_fp32.pt", "small_20k_fp32.pt"):
                results.setdefault((tree, f"inspect {name}"), []).append(inspect(tree, name))
    print("| what | before | after | after / before |\n| --- | --- | --- | --- |")
    for what in sorted({w for _, w in results}):
        b = statistics.median(results[(before, what)])
        a = statistics.median(results[(after, what)])
        print(f"| {what} | {b:.3f} s | {a:.3f} s | {a / b:.2f}x |")
    print("load average at the end:", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
