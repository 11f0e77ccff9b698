"""The spike rule written out plainly, for tests to judge gradclip's against.

Written from docs/reference/spike-rule.md's statement of the rule, not from
``gradclip_cli.core.spikes``: only the minimum history is shared.
"""

from __future__ import annotations

import math

MIN_HISTORY = 5  # spike-rule.md: "a point with fewer than 5 earlier points is not judged"


def reference(series, z=2.5, alpha=0.97, warmup=25):
    """The rule written out directly: (z or None, spike, limit or None) per point.

    mean and var: plain over the first ``warmup`` finite points, exponential
    after; std floored at half of |mean|; a spike enters the history as
    mean + z * std. Earlier points that are all exactly 0 are no history: the
    first nonzero point is not judged and the history (and the count of
    earlier points) starts from it.
    """
    history: list[float] = []
    mean = var = 0.0
    start = 0  # where the history starts
    out = []
    for i, x in enumerate(series):
        if not math.isfinite(x):
            out.append((None, False, None))
            continue
        if history and x != 0 and not any(history):  # zeros only: start afresh at x
            history, mean, var, start = [], 0.0, 0.0, i
        if i - start < MIN_HISTORY or not any(history):
            out.append((None, False, None))
            kept = x
        else:
            std = max(math.sqrt(var), 0.5 * abs(mean))
            score = (x - mean) / std
            limit = mean + z * std
            out.append((score, score > z, limit))
            kept = limit if score > z else x
        history.append(kept)
        if len(history) <= warmup:
            mean = sum(history) / len(history)
            var = sum((v - mean) ** 2 for v in history) / len(history)
        else:
            mean = alpha * mean + (1 - alpha) * kept
            var = alpha * var + (1 - alpha) * (kept - mean) ** 2
    return out


def group_z(z, groups):
    """The z each of ``groups`` groups judged at one point must exceed (spike-rule.md):
    the t with ``1 - (1 - Q(t)) ** groups == Q(z)``, ``Q`` the normal tail
    ``erfc(t / sqrt(2)) / 2``, found by bisection (not by an inverse of the
    normal distribution)."""
    if groups <= 1:
        return z
    target = 0.5 * math.erfc(z / math.sqrt(2))

    def family(t):  # the chance that any of the groups crosses t
        return -math.expm1(groups * math.log1p(-0.5 * math.erfc(t / math.sqrt(2))))

    low, high = z, z + 10.0
    for _ in range(200):
        middle = (low + high) / 2
        if family(middle) > target:
            low = middle
        else:
            high = middle
    return (low + high) / 2
