"""Issue 11: ``gradclip trend`` over 50 checkpoints in one process, against the floor.

50 checkpoints of a small GPT-2-shaped model (d=128, 12 layers, 3.5M float32
elements, 14 MB each; ``--quick``: d=64), read by one ``gradclip trend``
process, against the floor: one process that imports torch and reads every
byte of all 50 files once. Both are fresh processes, page cache warm.
Target: trend <= 1.2x the floor.

    .venv/bin/python -m benchmarks.trend_bench          # or: -m benchmarks.run --only trend
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import inputs
from .cli_bench import GRADCLIP, PYTHON
from .report import Section, Target, ratio
from .timing import fmt_bytes, fmt_seconds, interleaved, markdown_table, run_process

COUNT = 50
TARGET = 1.2

FLOOR_ALL = """
import sys, torch
buf = bytearray(16 << 20)
for path in sys.argv[1:]:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
"""


def small_gpt2_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    vocab, ctx, layers = 8192, 512, 12
    shapes = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (ctx, d))]
    for i in range(layers):
        h = f"transformer.h.{i}."
        shapes += [
            (h + "ln_1.weight", (d,)), (h + "attn.c_attn.weight", (d, 3 * d)),
            (h + "attn.c_proj.weight", (d, d)), (h + "ln_2.weight", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_proj.weight", (4 * d, d)),
        ]  # fmt: skip
    return shapes + [("transformer.ln_f.weight", (d,))]


def run(quick: bool, repeats: int) -> Section:
    d = 64 if quick else 128
    shapes = small_gpt2_shapes(d)
    (inputs.DATA / f"trend-d{d}").mkdir(parents=True, exist_ok=True)
    files = [str(inputs.checkpoint_file(f"trend-d{d}/step-{i:02d}", shapes,
                                        torch.float32, seed=i))
             for i in range(COUNT)]
    nbytes = sum(os.path.getsize(f) for f in files)
    contenders = {
        "floor (import torch, read all files)": lambda: run_process([PYTHON, "-c", FLOOR_ALL,
                                                                     *files]),
        f"gradclip trend ({COUNT} files) --format json":
            lambda: run_process([GRADCLIP, "trend", *files, "--format", "json", "-q"],
                                expect=(0, 1)),  # 1: a spike; seeds differ per file
    }  # fmt: skip
    results = interleaved(contenders, repeats)
    floor = results["floor (import torch, read all files)"].median
    rows = [[name, fmt_seconds(r.median), f"{nbytes / r.median / 1e9:.2f}",
             ratio(r.median, floor), fmt_bytes(r.max_rss)] for name, r in results.items()]
    trend = results[f"gradclip trend ({COUNT} files) --format json"].median
    body = (f"{COUNT} checkpoints of a GPT-2-shaped model (d={d}, {len(shapes)} tensors, "
            f"{inputs.numel(shapes):,} float32 elements each), {fmt_bytes(nbytes)} in all; "
            f"medians of {repeats}.\n\n"
            + markdown_table(["contender", "median", "GB/s", "time / floor", "peak RSS"], rows))
    target = Target(f"trend, {COUNT} checkpoints in one process, vs floor",
                    ratio(trend, floor), f"<= {TARGET}x", trend / floor <= TARGET)
    return Section("trend over 50 checkpoints (issue 11)", body, [target])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trend_bench")
    parser.add_argument("--quick", action="store_true", help="smaller files, 3 repetitions")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args(argv)
    section = run(args.quick, args.repeats or (3 if args.quick else 5))
    print(section.markdown())
    for t in section.targets:
        print(f"{t.name}: {t.measured} (goal {t.goal})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
