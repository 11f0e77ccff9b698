"""Independent float64 references for the norm tests.

Pure float64 arithmetic over every element, scaled by the maximum so nothing
overflows; for float64 inputs the sum uses math.fsum (exactly rounded), since
float64 accumulation would not be a wider reference for float64 data.
"""

from __future__ import annotations

import math

import torch


def max_abs(tensors) -> float:
    vals = [float(t.double().abs().max()) for t in tensors if t.numel()]
    return max(vals, default=0.0)


def norm(tensors, p: float) -> float:
    """The p-norm of all elements of ``tensors`` as one vector."""
    m = max_abs(tensors)
    if math.isinf(p) or m == 0.0:
        return m
    if any(t.dtype == torch.float64 for t in tensors):
        # Python's ** works in double; scaled terms are <= 1, fsum is exact.
        terms = []
        for t in tensors:
            terms.extend((abs(x) / m) ** p for x in t.double().flatten().tolist())
        s = math.fsum(terms)
    else:
        s = sum(float(((t.double().abs() / m) ** p).sum()) for t in tensors)
    return m * s ** (1.0 / p)


def rel_err(got: float, want: float) -> float:
    if got == want:  # also both inf: a total beyond float64's range, reported as such
        return 0.0
    if want == 0.0:
        return abs(got)
    return abs(got - want) / want
