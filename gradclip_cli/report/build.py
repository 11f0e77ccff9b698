"""Turn per-tensor norm summaries into a report: groups, totals, verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..escaping import visible
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

if TYPE_CHECKING:
    from ..measuring import Measurement


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
    measurement: Measurement,
    *,
    tensors: Sequence[torch.Tensor],
    ties: dict[str, list[str]],
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
    notes: Sequence[str] = (),
    measured: dict[str, Any] | None = None,
    roles: dict[str, int] | None = None,
    optimizer: str | None = None,
    chosen_by_auto: bool = False,
) -> InspectReport:
    """The report of one ``Measurement`` (``measuring.py``); ``tensors`` (the stored
    tensors' descriptions: shape, dtype) are aligned with its names.

    Rows are each tensor's own elements (``sums``, ``counts``); groups and the
    total add the elements each holds first (``owned``, ``owned_counts``),
    which partition every element once. Where the measurement holds the same
    parameters' weights, each tensor and group gets ``ratio = norm / weight
    norm``. ``notes``: the lines of ``description`` every format carries.
    """
    names, sums, owned = measurement.names, measurement.sums, measurement.owned
    counts, owned_counts = measurement.counts, measurement.owned_counts
    shares, weight_sums = measurement.shares, measurement.weights
    p = sums.norm_type
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
        notes=list(notes),
    )


# Why ``--what auto`` measured something other than gradients (docs/reference/contract.md:
# "the report says which was used and why"); the verdict's threshold clause says the same.
AUTO_CHOSE = "--what auto: no gradients saved"


def inspect_header(contents, selection, step, check=None, auto: bool = False
                   ) -> dict[str, Any]:
    """The header of an inspect report, worded from what the layout and the selection
    found (``source/``): ``description`` (the layout's lines, then the step's note, why
    ids name the rows, the buffers set apart, what was measured, the ``--previous``
    cross-check's lines), ``notes`` (those of them every format carries: the layout's,
    the step's, the ids'), and ``measured`` (its account in the JSON document; ``chosen``: why
    ``--what auto`` (``auto``) chose other than gradients)."""
    notes = [*contents.notes, *([step.note] if step.note else []),
             *([selection.ids_note] if selection.ids_note else [])]
    chosen = AUTO_CHOSE if auto and selection.what != "grads" else None
    description = [*contents.description, *notes, *_buffers_apart(contents, selection.what),
                   f"measured: {selection.measured}" + (f"; {chosen}" if chosen else ""),
                   *([] if check is None else check.lines)]
    measured = {"what": selection.what, "explain": selection.explain,
                "evidence": selection.evidence, **({"chosen": chosen} if chosen else {}),
                **({} if check is None else {"cross_check": check.disagreement.as_json()})}
    return {"description": description, "notes": notes, "measured": measured}


def _buffers_apart(contents, what: str) -> list[str]:
    """The buffers set apart from the weights, named (a few), when weights are measured."""
    buffers = list(contents.buffers or ())
    if what != "weights" or not buffers:
        return []
    more = f" and {len(buffers) - 3} more" if len(buffers) > 3 else ""
    return [f"buffers, not weights: {visible(', '.join(buffers[:3]))}{more}"]
