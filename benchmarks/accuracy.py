"""Accuracy: relative error of the total 2-norm against a float64 reference.

One tensor of N normal values times a magnitude, per dtype. A single tensor is
the hard case for a one-pass reduction: torch accumulates all N squares in one
float32 (or narrower) reduction, while gradclip sums 4,096-element rows and
combines them in float64. Near 1e20 every square overflows float32; near 1e-25
every square underflows it. float16 cannot hold 1e20 or 1e-25, so its extremes
are its own: 1e4 (squares overflow float16) and 1e-6 (subnormal values).
"""

from __future__ import annotations

import math

import torch

from gradclip_cli import get_total_norm as gradclip_total_norm

from .report import Section
from .timing import markdown_table

MAGNITUDES = {
    torch.float32: (("1", 1.0), ("1e20", 1e20), ("1e-25", 1e-25)),
    torch.bfloat16: (("1", 1.0), ("1e20", 1e20), ("1e-25", 1e-25)),
    torch.float16: (("1", 1.0), ("1e4", 1e4), ("1e-6", 1e-6)),
}


def _reference(t: torch.Tensor) -> float:
    total = 0.0
    for chunk in t.reshape(-1).split(1 << 22):
        total += float(chunk.double().square().sum())
    return math.sqrt(total)


def _error(value: torch.Tensor, reference: float) -> str:
    v = float(value)
    if not math.isfinite(v):
        return str(v)
    if v == 0.0:
        return "0 (underflow)"
    return f"{abs(v - reference) / reference:.1e}"


def run(quick: bool) -> Section:
    sizes = (1 << 20, 1 << 24) if quick else (1 << 20, 1 << 24, 1 << 26)
    rows = []
    g = torch.Generator().manual_seed(3)
    for n in sizes:
        base = torch.randn(n, generator=g)
        for dtype, mags in MAGNITUDES.items():
            for label, mag in mags:
                t = (base * mag).to(dtype)
                ref = _reference(t)
                ours = gradclip_total_norm([t])
                theirs = torch.nn.utils.get_total_norm([t])
                rows.append([f"{n >> 20}M", str(dtype).removeprefix("torch."), label,
                             f"{ref:.6g}", _error(theirs, ref), _error(ours, ref)])
                del t
        del base
    text = (
        "Relative error |x - ref| / ref of the total 2-norm of one tensor of N normal "
        "values times the magnitude, against a float64 reference computed from the "
        "stored values. torch: `torch.nn.utils.get_total_norm` (result in the input "
        "dtype); gradclip: `gradclip_cli.get_total_norm` (result float32).\n\n"
        + markdown_table(["N", "dtype", "magnitude", "float64 norm", "torch", "gradclip"], rows)
        + "\n"
    )
    return Section("Accuracy", text)
