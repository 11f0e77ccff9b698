"""What a report shows of a long list: the rows a person reads, and sparklines.

A checkpoint can hold 20,000 groups and a run logged every step thousands of
points; the table and the Markdown report show the same chosen rows (every
finding kept) and say how many they leave out. Plain data and strings: no rich.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..report import GroupRow, InspectReport
    from ..report.trend import TrendPoint, TrendReport

# More groups than a person reads (and rich renders 20,000 rows slowly): show
# the largest, and any holding NaN/inf, in checkpoint order.
MAX_GROUPS = 60


def groups_to_show(report: InspectReport) -> list[GroupRow]:
    groups = report.groups
    if len(groups) <= MAX_GROUPS:
        return groups

    def size(g):
        return math.inf if not math.isfinite(g.norm) else g.norm

    keep = {id(g) for g in sorted(groups, key=size, reverse=True)[:MAX_GROUPS]}
    return [g for g in groups if id(g) in keep]


# One row per point, but a run logged every step has thousands: beyond this
# many, the table keeps every spike or non-finite point and the newest ones.
MAX_POINTS = 60
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60
MAX_SPARK_GROUPS = 20


def points_to_show(report: TrendReport) -> list[TrendPoint]:
    points = report.points
    if len(points) <= MAX_POINTS:
        return points
    flagged = [i for i, p in enumerate(points) if p.spike or p.is_nonfinite][-MAX_POINTS // 2:]
    room = MAX_POINTS - len(flagged)
    keep = set(flagged) | set(range(len(points) - room, len(points)))
    return [p for i, p in enumerate(points) if i in keep]


def largest_norm(report: TrendReport, group: str) -> float:
    norms = [p.groups[group] for p in report.points if group in p.groups]
    return max((math.inf if not math.isfinite(v) else v for v in norms), default=0.0)


def sparkline(values: list[float | None], width: int = SPARK_WIDTH) -> str:
    """One character per point on a log scale between the series' smallest and largest
    positive value; ``!`` marks NaN/inf, a space a point where the group is absent.
    Longer series are folded into ``width`` buckets, each showing its largest value,
    so a one-point spike stays visible."""
    if len(values) > width:
        size = len(values) / width
        buckets = [values[int(i * size):int((i + 1) * size)] for i in range(width)]
        values = [_bucket_max(b) for b in buckets]
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    low, high = (min(logs), max(logs)) if logs else (0.0, 0.0)
    line = []
    for v in values:
        if v is None:
            line.append(" ")
        elif not math.isfinite(v):
            line.append("!")
        elif v <= 0 or high == low:
            line.append(SPARK[0] if v <= 0 else SPARK[len(SPARK) // 2])
        else:
            level = round((math.log(v) - low) / (high - low) * (len(SPARK) - 1))
            line.append(SPARK[level])
    return "".join(line)


def _bucket_max(bucket: list[float | None]) -> float | None:
    present = [v for v in bucket if v is not None]
    if not present:
        return None
    bad = [v for v in present if not math.isfinite(v)]
    return bad[0] if bad else max(present)
