"""Two checkpoints' per-group norms side by side: what changed between them.

For "the last good checkpoint and the first bad one": every group gets both
norms and ``ratio = b / a``; rows are ordered by ``|log ratio|``, largest
first, so the group that moved most leads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .model import EXCEEDED, NONFINITE, OK


@dataclass(frozen=True)
class CompareRow:
    name: str
    a: float | None  # None: the group is absent from A
    b: float | None
    ratio: float | None  # None when either side is absent

    @property
    def only(self) -> str | None:
        """``"a"`` or ``"b"``: the one side that holds the group; None when both do."""
        if self.a is None:
            return "b"
        if self.b is None:
            return "a"
        return None

    @property
    def nonfinite(self) -> bool:
        """A NaN or infinite norm on either side: the largest change
        (docs/reference/contract.md)."""
        return any(x is not None and not math.isfinite(x) for x in (self.a, self.b))

    @property
    def change(self) -> float:
        """``|log ratio|``: how far the group moved, either way (inf for 0 -> x, nan unknown)."""
        if self.ratio is None:
            return math.inf
        if math.isnan(self.ratio):
            return math.nan
        if self.ratio == 0 or math.isinf(self.ratio):
            return math.inf
        return abs(math.log(self.ratio))


@dataclass(frozen=True)
class CompareReport:
    a: str
    b: str
    what: str
    norm_type: float
    group_by: str
    fail_above: float | None
    total: CompareRow
    groups: list[CompareRow]
    status: str
    optimizer: str | None = None  # whose rule gave an optimizer quantity, for the words
    notes: tuple[str, ...] = ()  # the checkpoints' layout notes (what --verify could not check)

    @property
    def beyond(self) -> list[CompareRow]:
        """Groups whose ratio exceeds ``fail_above`` or falls below its inverse."""
        if self.fail_above is None:
            return []
        return [g for g in self.groups if ratio_beyond(g.ratio, self.fail_above)]

    @property
    def one_sided(self) -> list[CompareRow]:
        """Groups present in A only or in B only: a finding under ``fail_above``
        (a layer that appears or vanishes changed more than any ratio says)."""
        return [g for g in self.groups if g.only is not None]

    @property
    def total_beyond(self) -> bool:
        """The total's ratio is checked against ``fail_above`` too: two checkpoints
        with no group in common have no ratio but the total's (docs/reference/contract.md)."""
        return self.fail_above is not None and ratio_beyond(self.total.ratio, self.fail_above)

    @property
    def findings(self) -> int:
        """How many things ``fail_above`` flags: the total, groups beyond, one-sided groups."""
        if self.fail_above is None:
            return 0
        return int(self.total_beyond) + len(self.beyond) + len(self.one_sided)


def norm_ratio(a: float, b: float) -> float:
    """``b / a``; equal norms (two zeros included) are ratio 1, ``x / 0`` is inf."""
    if a == b:
        return 1.0
    if a == 0:
        return math.inf
    return b / a


def ratio_beyond(ratio: float | None, limit: float) -> bool:
    """Above ``limit`` or below ``1 / limit`` (NaN is neither)."""
    return ratio is not None and (ratio > limit or ratio < 1 / limit)


def row(name: str, a: float | None, b: float | None) -> CompareRow:
    ratio = None if a is None or b is None else norm_ratio(a, b)
    return CompareRow(name, a, b, ratio)


def build_compare_report(
    *,
    a: str,
    b: str,
    what: str,
    norm_type: float,
    group_by: str,
    totals: tuple[float, float],
    groups_a: dict[str, float],
    groups_b: dict[str, float],
    nonfinite: bool,
    fail_above: float | None,
) -> CompareReport:
    """Rows for the union of both sides' groups, largest ``|log ratio|`` first.

    A NaN or infinite norm on either side is the largest change (docs/reference/contract.md):
    those groups lead, whatever their ratio says (inf / inf is 1, NaN is no
    number at all); groups found on one side only come next (their change is
    unbounded); ties keep A's order, then B's.
    """
    names = list(dict.fromkeys([*groups_a, *groups_b]))
    rows = [row(n, groups_a.get(n), groups_b.get(n)) for n in names]

    def key(r: CompareRow) -> tuple[int, float]:
        if r.nonfinite:
            return (0, 0.0)
        change = r.change  # NaN only with a NaN norm, led above
        return (1, 0.0 if math.isnan(change) else -change)

    rows.sort(key=key)
    report = CompareReport(
        a=a, b=b, what=what, norm_type=norm_type, group_by=group_by, fail_above=fail_above,
        total=row("total", *totals), groups=rows, status=OK,
    )  # fmt: skip
    if nonfinite:
        status = NONFINITE
    elif report.findings:
        status = EXCEEDED
    else:
        status = OK
    return replace(report, status=status)
