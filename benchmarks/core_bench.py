"""Issue 3, targets 1-3: the core, in memory, against torch's own norm paths.

Every contender computes the total 2-norm of the same list of tensors.
gradclip's figure is ``tensor_power_sums`` (per-tensor norm, max |g| and
non-finite counts, then the total) and its drop-in ``get_total_norm``; torch's
are ``torch.nn.utils.get_total_norm`` (foreach, and its default) and the
explicit float32-accumulating ``_foreach_norm``.
"""

from __future__ import annotations

import gc

import torch

from gradclip_cli import get_total_norm as gradclip_total_norm
from gradclip_cli.core import tensor_power_sums

from . import inputs
from .report import Section, Target, ratio
from .timing import fmt_seconds, interleaved, markdown_table


def reference_norm(tensors) -> float:
    """The exact total 2-norm, accumulated in float64 tensor by tensor."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        total += t.double().square().sum()
    return float(total.sqrt())


def rel_error(value: torch.Tensor | float, reference: float) -> float:
    return abs(float(value) - reference) / reference


def _gradclip_full(tensors):
    """Per-tensor norms, max |g|, non-finite counts, and the total: what inspect needs."""
    return tensor_power_sums(tensors, 2.0).total().norm[0]


def _torch_foreach_fp32(tensors):
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _bench(title: str, tensors, contenders: dict, baseline: str, repeats: int):
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    reference = reference_norm(tensors)
    values = {name: fn() for name, fn in contenders.items()}
    results = interleaved(contenders, repeats)
    base = results[baseline].median
    rows = []
    for name, r in results.items():
        rows.append([
            name, fmt_seconds(r.median), f"{nbytes / r.median / 1e9:.2f}",
            ratio(base, r.median), f"{rel_error(values[name], reference):.1e}",
        ])  # fmt: skip
    table = markdown_table(
        ["contender", "median", "GB/s", f"speed vs {baseline}", "rel. error vs float64"], rows
    )
    return results, f"{title}: {len(tensors)} tensors, {nbytes / 1e6:.0f} MB.\n\n{table}\n"


def _float32_contenders(grads):
    """torch's foreach and default totals against gradclip's core and drop-in."""
    return {
        "torch get_total_norm(foreach=True)":
            lambda: torch.nn.utils.get_total_norm(grads, foreach=True),
        "torch get_total_norm (default)": lambda: torch.nn.utils.get_total_norm(grads),
        "gradclip tensor_power_sums (+max, non-finite)": lambda: _gradclip_full(grads),
        "gradclip get_total_norm": lambda: gradclip_total_norm(grads),
    }  # fmt: skip


def run(quick: bool, repeats: int) -> Section:
    torch.manual_seed(0)
    parts, targets = [], []

    # 1. GPT-2 fp32
    grads = inputs.gradients(inputs.gpt2_shapes(), torch.float32)
    contenders = _float32_contenders(grads)
    res, text = _bench("GPT-2 124M, float32", grads, contenders,
                       "torch get_total_norm(foreach=True)", repeats)
    parts.append(text)
    r = res["torch get_total_norm(foreach=True)"].median / res[
        "gradclip tensor_power_sums (+max, non-finite)"].median
    targets.append(Target("1. core GPT-2 fp32 vs torch foreach (throughput)", f"{r:.2f}x",
                          "report (memory speed)", None))
    del grads
    gc.collect()

    # 2. GPT-2 bf16
    grads = inputs.gradients(inputs.gpt2_shapes(), torch.bfloat16)
    contenders = {
        "torch _foreach_norm(dtype=float32)": lambda: _torch_foreach_fp32(grads),
        "torch get_total_norm(foreach=True) (bf16)":
            lambda: torch.nn.utils.get_total_norm(grads, foreach=True),
        "gradclip tensor_power_sums (+max, non-finite)": lambda: _gradclip_full(grads),
        "gradclip get_total_norm": lambda: gradclip_total_norm(grads),
    }  # fmt: skip
    res, text = _bench("GPT-2 124M, bfloat16", grads, contenders,
                       "torch _foreach_norm(dtype=float32)", repeats)
    parts.append(text)
    ours = res["gradclip tensor_power_sums (+max, non-finite)"].median
    acc = res["torch _foreach_norm(dtype=float32)"].median / ours
    nat = res["torch get_total_norm(foreach=True) (bf16)"].median / ours
    targets.append(Target("2a. core GPT-2 bf16 vs torch fp32-accumulating foreach",
                          f"{acc:.2f}x", ">= 5x", acc >= 5))
    targets.append(Target("2b. core GPT-2 bf16 vs torch native bf16", f"{nat:.2f}x",
                          ">= 0.5x (aim)", nat >= 0.5))
    del grads
    gc.collect()

    # 3. 20,000 small tensors
    grads = inputs.gradients(inputs.small_shapes(), torch.float32)
    contenders = _float32_contenders(grads)
    res, text = _bench("20,000 x 1,024, float32", grads, contenders,
                       "torch get_total_norm(foreach=True)", repeats)
    parts.append(text)
    r = res["torch get_total_norm(foreach=True)"].median / res[
        "gradclip tensor_power_sums (+max, non-finite)"].median
    targets.append(Target("3. core 20k small tensors vs torch foreach", f"{r:.2f}x", ">= 1.0x",
                          r >= 1.0))
    body = ("Speed column: torch's (baseline) median time / this contender's; above 1 "
            "is faster than the baseline.\n\n" + "\n".join(parts))
    return Section("Core, in memory (targets 1-3)", body, targets)
