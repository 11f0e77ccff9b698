"""Issue 3, target 8: inspect time against checkpoint size, and against tensor count.

By size: bfloat16 files of equal 16 MiB tensors, so only the byte count
changes; the largest point is the Llama-3B file of the memory benchmark. By
count: 256 MiB of float32 split into ever more, ever smaller tensors. The
floor (import torch, read every byte) runs beside gradclip, so what is
gradclip's own cost per byte or per tensor can be read off the difference.
"""

from __future__ import annotations

import torch

from . import inputs
from .cli_bench import inspect_contenders
from .report import Section
from .timing import fmt_seconds, interleaved, markdown_table

FLOOR = "floor (import torch, read file)"
OURS = "gradclip inspect --format json"
TENSOR = 8 << 20  # elements: 16 MiB of bfloat16


def _two(path):
    both = inspect_contenders(path)
    return {FLOOR: both[FLOOR], OURS: both[OURS]}


def _row(label, path, ntensors, results):
    nbytes = path.stat().st_size
    ours, floor = results[OURS].median, results[FLOOR].median
    return [label, f"{nbytes / 1e9:.2f}", ntensors, fmt_seconds(floor), fmt_seconds(ours),
            fmt_seconds(ours - floor), f"{(ours - floor) / (nbytes / 1e9):.2f}"]


def run(quick: bool, repeats: int, big: dict | None = None) -> Section:
    header = ["file", "GB", "tensors", "floor", "gradclip inspect", "gradclip - floor",
              "(gradclip - floor) s/GB"]
    size_rows = []
    gigabytes = (0.1, 0.5) if quick else (0.1, 0.5, 2.0)
    for gb in gigabytes:
        count = max(1, round(gb * 1e9 / (TENSOR * 2)))
        path = inputs.checkpoint_file(f"uniform_{gb}GB_bf16",
                                      inputs.uniform_shapes(count, TENSOR), torch.bfloat16)
        size_rows.append(_row(f"{count} x 16 MiB", path, count,
                              interleaved(_two(path), repeats)))
    if big is not None:
        r = big["results"]
        size_rows.append(_row("Llama-3B shapes (memory bench)", big["path"], big["tensors"],
                              {FLOOR: r[FLOOR], OURS: r[OURS]}))

    count_rows = []
    total = 64 << 20  # float32 elements: 256 MiB
    counts = (16, 4096) if quick else (16, 256, 4096, 16384)
    for count in counts:
        path = inputs.checkpoint_file(f"count_{count}_fp32",
                                      inputs.uniform_shapes(count, total // count), torch.float32)
        count_rows.append(_row(f"{count} x {total // count} fp32", path, count,
                               interleaved(_two(path), repeats)))
        if count >= 4096:
            path.unlink()  # cheap to rebuild; keep _data small
            path.with_suffix(".json").unlink()
    text = (
        "By size (bfloat16):\n\n" + markdown_table(header, size_rows)
        + "\n\nBy tensor count at a fixed 256 MiB (float32):\n\n"
        + markdown_table(header, count_rows) + "\n"
    )
    return Section("Scaling (target 8)", text)
