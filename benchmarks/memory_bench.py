"""Issue 3, target 6: peak memory of ``gradclip inspect`` on a big checkpoint.

The checkpoint is shaped like a 3B-parameter Llama in bfloat16 (6.4 GB; the
largest tensor, the embedding, is 788 MB). The target is peak RSS <= 300 MB
plus the largest tensor: a tool that streams tensor by tensor needs no more.
Peak RSS is the child's own ``ru_maxrss`` (``os.wait4``), which counts
file-backed pages of a memory map the process has touched as well as its
own allocations.
"""

from __future__ import annotations

import torch

from . import inputs
from .cli_bench import inspect_contenders
from .report import Section, Target
from .timing import fmt_bytes, fmt_seconds, interleaved, markdown_table

BUDGET = 300 << 20  # bytes, plus the largest tensor


def llama_file(quick: bool):
    shapes = inputs.llama_3b_shapes()
    if quick:
        # Embedding plus the first two layers: 1.2 GB, same largest tensor.
        shapes = shapes[:1 + 2 * 9] + shapes[-1:]
        return inputs.checkpoint_file("llama_3b_2layers_bf16", shapes, torch.bfloat16), shapes
    return inputs.checkpoint_file("llama_3b_bf16", shapes, torch.bfloat16), shapes


def run(quick: bool, repeats: int) -> tuple[Section, dict]:
    path, shapes = llama_file(quick)
    nbytes = path.stat().st_size
    largest = max(inputs.numel([s]) for s in shapes) * 2
    # The file was just written (or read by an earlier run): its pages are cached.
    results = interleaved(inspect_contenders(path), repeats, warmup=0)
    rows = [
        [name, fmt_seconds(r.median), f"{nbytes / r.median / 1e9:.2f}", fmt_bytes(r.max_rss)]
        for name, r in results.items()
    ]
    ours = results["gradclip inspect --format json"].max_rss
    limit = BUDGET + largest
    text = (
        f"`{path.name}`: {len(shapes)} tensors, {nbytes / 1e9:.2f} GB bfloat16, largest tensor "
        f"{fmt_bytes(largest)}; budget 300 MiB + largest = {fmt_bytes(limit)}.\n\n"
        + markdown_table(["contender", "median", "GB/s", "peak RSS"], rows)
        + "\n"
    )
    target = Target(f"6. inspect peak RSS on {nbytes / 1e9:.1f} GB bf16 Llama-3B",
                    fmt_bytes(ours), f"<= {fmt_bytes(limit)}", ours <= limit)
    return Section("Memory (target 6)", text, [target]), {
        "path": path, "results": results, "tensors": len(shapes)}
