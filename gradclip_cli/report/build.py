"""Turn per-tensor norm summaries into a report: groups, totals, verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..core import PowerSums
from .grouping import GroupRule
from .groups import group_sums, nonfinite_counts
from .model import (
    EXCEEDED,
    NONFINITE,
    OK,
    OVERFLOW,
    GroupRow,
    InspectReport,
    NonFinite,
    TensorRow,
)


def _share(norm: float, total: float, p: float) -> float:
    if not (math.isfinite(norm) and math.isfinite(total)) or total == 0:
        return math.nan if total != 0 else 0.0
    ratio = norm / total
    return ratio if math.isinf(p) else ratio**p


def _ratio(norm: float, weight_norm: float) -> float:
    """norm / weight norm; a zero weight norm gives inf (or nan for a zero norm too)."""
    if weight_norm == 0:
        return math.nan if norm == 0 else math.inf
    return norm / weight_norm


def verdict(
    nonfinite: NonFinite, total: float, max_norm: float | None, allow_nonfinite: bool,
    overflow: bool = False,
) -> str:
    """What the report concludes, worst first.

    Non-finite gradients are a finding unless allowed. A NaN total cannot be
    compared with ``--max-norm``: with a threshold it is a finding whatever
    ``--allow-nonfinite`` says. A finite total beyond float64's range is a
    finding of its own (it exceeds every threshold, and no float says by how much).
    """
    if nonfinite.total and not allow_nonfinite:
        return NONFINITE
    if math.isnan(total) and max_norm is not None:
        return NONFINITE
    if overflow:
        return OVERFLOW
    if max_norm is not None and total > max_norm:
        return EXCEEDED
    return OK


def build_inspect_report(
    *,
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    sums: PowerSums,
    ties: dict[str, list[str]],
    shares: Sequence[Sequence[str]] | None = None,
    group_rule: GroupRule,
    source: str,
    format: str,
    key: str,
    device: str,
    max_norm: float | None,
    allow_nonfinite: bool,
    group_by: str,
    skipped: list[str],
    what: str = "grads",
    step: int | None = None,
    description: Sequence[str] = (),
    measured: dict[str, Any] | None = None,
    roles: dict[str, int] | None = None,
    weight_sums: PowerSums | None = None,
    owned: PowerSums | None = None,
    counts: Sequence[int] | None = None,
    owned_counts: Sequence[int] | None = None,
    optimizer: str | None = None,
    chosen_by_auto: bool = False,
) -> InspectReport:
    """``names``, ``tensors`` and the rest are aligned and hold no tie duplicates.

    ``sums`` and ``counts`` describe each tensor's own elements (its row);
    ``owned`` and ``owned_counts`` the elements it holds first, which partition
    every element once (groups and the total). Without them, the tensors
    are taken to share no elements.

    ``weight_sums``, aligned too, are the same parameters' weights: each
    tensor and group then gets ``ratio = norm / weight norm``.
    """
    p = sums.norm_type
    if owned is None:
        owned = sums
    if counts is None:
        counts = [t.numel() for t in tensors]
    if owned_counts is None:
        owned_counts = counts
    group_names = [group_rule(n) for n in names]
    grouped = group_sums(group_names, owned)  # checkpoint order of first appearance
    order, groups, total = grouped.names, grouped.groups, grouped.total
    total_norm = float(total.norm[0])
    overflow = bool(total.overflow[0])
    # Whole columns at once: indexing tensors element by element is slow at
    # 20,000 tensors, and ``norm`` is computed on every access.
    norms = sums.norm.tolist()
    maxes = sums.max_abs.tolist()
    nonfinite_rows = nonfinite_counts(sums)
    ratios: list[float | None] = [None] * len(names)
    group_ratios: list[float | None] = [None] * len(order)
    if weight_sums is not None:
        ratios = [_ratio(a, b) for a, b in zip(norms, weight_sums.norm.tolist())]
        weight_groups = grouped.reduce(weight_sums).norm.tolist()

    tensor_rows = [
        TensorRow(
            name=name,
            group=group_names[i],
            shape=tuple(tensors[i].shape),
            dtype=str(tensors[i].dtype).removeprefix("torch."),
            num_elements=counts[i],
            norm=norms[i],
            max_abs=maxes[i],
            nonfinite=nonfinite_rows[i],
            tied=tuple(ties.get(name, ())),
            ratio=ratios[i],
            shares=tuple(shares[i]) if shares else (),
        )
        for i, name in enumerate(names)
    ]
    members = [0] * len(order)
    elements = [0] * len(order)
    for g, count in zip(grouped.index.tolist(), owned_counts):
        members[g] += 1
        elements[g] += count
    group_norms = groups.norm.tolist()
    group_maxes = groups.max_abs.tolist()
    group_counts = nonfinite_counts(groups)
    group_rows = []
    for g, name in enumerate(order):
        norm = group_norms[g]
        if weight_sums is not None:
            group_ratios[g] = _ratio(norm, weight_groups[g])
        group_rows.append(
            GroupRow(
                name=name,
                norm=norm,
                share=_share(norm, total_norm, p),
                max_abs=group_maxes[g],
                num_tensors=members[g],
                num_elements=elements[g],
                nonfinite=group_counts[g],
                ratio=group_ratios[g],
            )
        )
    nonfinite = nonfinite_counts(total)[0]
    return InspectReport(
        source=source,
        format=format,
        key=key,
        device=device,
        norm_type=p,
        total_norm=total_norm,
        max_abs=float(total.max_abs[0]),
        num_tensors=len(names),
        num_elements=sum(owned_counts),
        nonfinite=nonfinite,
        status=verdict(nonfinite, total_norm, max_norm, allow_nonfinite, overflow),
        groups=group_rows,
        tensors=tensor_rows,
        max_norm=max_norm,
        allow_nonfinite=allow_nonfinite,
        group_by=group_by,
        skipped=list(skipped),
        what=what,
        step=step,
        description=list(description),
        measured=dict(measured or {}),
        roles=dict(roles or {}),
        overflow=overflow,
        total_norm_log10=float(total.log2_norm[0]) * math.log10(2.0) if overflow else None,
        optimizer=optimizer,
        chosen_by_auto=chosen_by_auto,
    )
