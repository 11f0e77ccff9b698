"""Whether a tensor's stored pieces (DCP chunks, DCP Hugging Face pieces) tile it exactly.

A piece is a box: ``offsets`` and ``sizes``, one per dimension, covering
``[offsets[d], offsets[d] + sizes[d])`` in each. The pieces tile the tensor when
none overlaps another and no element is left out. Comparing every pair is
quadratic (16,000 one-element chunks of a ``[1, 16000]`` tensor took 276 s),
so:

* dimensions that every piece spans whole are dropped: they cannot separate
  two pieces, nor leave a gap;
* with one or two dimensions left (every real layout: FSDP cuts dimension 0,
  tensor parallelism one more), a sweep along the first, keeping the pieces it
  crosses sorted along the second, finds an overlap with its neighbours alone
  (the pieces it crosses are disjoint there): ``O(n log n)``;
* with three or more, the signed corners decide: a box's indicator is the
  signed sum of the orthants at its ``2^k`` corners, and orthants at distinct
  points are independent, so the pieces tile the tensor exactly when their
  signed corner counts are those of the tensor's own box (the argument
  behind the "perfect rectangle" check, in ``k`` dimensions):
  ``O(n 2^k)``. Only a refusal then looks for the overlapping pair, pairwise
  along the dimension that separates the pieces best, within a budget; past it, a refusal whose
  elements add up to the tensor's or more is an overlap (there is no other way
  to miss a tiling), and one short of it is a gap.

Semantics are those of the pairwise check they replace: a reach past the
tensor first, then an overlap (naming two pieces), then a gap.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)

# Pairs compared while looking for an overlap in three or more dimensions, once
# the corners have said the pieces do not tile: well under a second in Python.
PAIR_BUDGET = 500_000
# Beyond this many cut dimensions, 2^k corners a piece cost more than pairs would.
MAX_CORNER_DIMENSIONS = 10


class Overlap(Exception):
    """Two pieces share elements (``pair``: both, as given; None when not named)."""

    def __init__(self, pair: tuple[Box, Box] | None):
        super().__init__(pair)
        self.pair = pair


class Gap(Exception):
    """Some element is in no piece; ``covered``: the elements the pieces hold."""

    def __init__(self, covered: int):
        super().__init__(covered)
        self.covered = covered


def check(size: Sequence[int], boxes: Sequence[Box]) -> None:
    """Raise ``Overlap`` or ``Gap`` unless ``boxes`` (distinct, each inside a tensor of
    ``size``, same number of dimensions) tile it exactly; empty boxes are ignored."""
    live = sorted((tuple(o), tuple(s)) for o, s in boxes if math.prod(s))
    total = math.prod(size)
    covered = sum(math.prod(s) for _, s in live)
    cut = [d for d in range(len(size)) if any(o[d] != 0 or s[d] != size[d] for o, s in live)]
    if not cut:  # every piece is the whole tensor; distinct, so at most one
        if covered != total:
            raise Gap(covered)
        return
    if len(cut) <= 2:
        pair = _sweep_overlap(live, cut)
        if pair is not None:
            raise Overlap(pair)
        if covered != total:
            raise Gap(covered)
        return
    corners = len(cut) <= MAX_CORNER_DIMENSIONS
    if corners and covered == total and _corners_tile(live, cut, size):
        return
    pair, exhausted = _pairwise_overlap(live, cut, PAIR_BUDGET if corners else None)
    if pair is not None:
        raise Overlap(pair)
    # All elements held (or more) without a tiling is an overlap: the corners said no,
    # or the budget ran out. Fewer is a gap.
    if covered > total or (covered == total and (corners or exhausted)):
        raise Overlap(None)
    if covered < total:
        raise Gap(covered)
    # Past the corners' dimensions the pairwise check was complete: no overlap, every
    # element held.


def _overlaps(a: Box, b: Box) -> bool:
    return all(
        max(ao, bo) < min(ao + asz, bo + bsz) for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1])
    )


def _sweep_overlap(live: list[Box], cut: list[int]) -> tuple[Box, Box] | None:
    """Two overlapping boxes (in ``cut``, one or two dimensions; every other is spanned
    whole by all), or None. A sweep along ``cut[0]``: the boxes it crosses are disjoint
    along ``cut[1]`` until an overlap is found, so a new box need only be compared with
    its neighbours there."""
    first = cut[0]
    second = cut[1] if len(cut) > 1 else None

    def span(box: Box) -> tuple[int, int]:
        if second is None:
            return (0, 1)  # one dimension: any two boxes the sweep crosses at once meet
        return box[0][second], box[0][second] + box[1][second]

    by_start = sorted(range(len(live)), key=lambda i: live[i][0][first])
    ending: list[tuple[int, int]] = []  # (end along first, box) of the boxes crossed
    starts: list[int] = []  # their starts along second, sorted
    crossed: list[int] = []  # the boxes, in that order
    for i in by_start:
        at = live[i][0][first]
        while ending and ending[0][0] <= at:
            _, j = heapq.heappop(ending)
            k = bisect.bisect_left(starts, span(live[j])[0])
            while crossed[k] != j:  # equal starts only in one dimension
                k += 1
            del starts[k], crossed[k]
        lo, hi = span(live[i])
        k = bisect.bisect_left(starts, lo)
        if k < len(crossed) and starts[k] < hi:
            return _ordered(live[i], live[crossed[k]])
        if k > 0 and span(live[crossed[k - 1]])[1] > lo:
            return _ordered(live[i], live[crossed[k - 1]])
        starts.insert(k, lo)
        crossed.insert(k, i)
        heapq.heappush(ending, (at + live[i][1][first], i))
    return None


def _ordered(a: Box, b: Box) -> tuple[Box, Box]:
    return (a, b) if a <= b else (b, a)


def _corners_tile(live: list[Box], cut: list[int], size: Sequence[int]) -> bool:
    """Whether the signed corner counts of ``live`` (in the ``cut`` dimensions) are the
    tensor's own: exactly when the boxes tile it (see the module's docstring)."""
    counts: dict[tuple[int, ...], int] = {}
    k = len(cut)
    for offsets, sizes in live:
        lows = [offsets[d] for d in cut]
        highs = [offsets[d] + sizes[d] for d in cut]
        for mask in range(1 << k):
            corner = tuple(highs[j] if mask >> j & 1 else lows[j] for j in range(k))
            sign = -1 if bin(mask).count("1") & 1 else 1
            counts[corner] = counts.get(corner, 0) + sign
    expected = {}
    for mask in range(1 << k):
        corner = tuple(size[cut[j]] if mask >> j & 1 else 0 for j in range(k))
        expected[corner] = -1 if bin(mask).count("1") & 1 else 1
    return {c: n for c, n in counts.items() if n} == expected


def _pairwise_overlap(
    live: list[Box], cut: list[int], budget: int | None
) -> tuple[tuple[Box, Box] | None, bool]:
    """Two overlapping boxes, found comparing the pairs that a sweep along one dimension
    crosses at once, and whether ``budget`` pairs ran out first. The sweep runs along the
    cut dimension with the most distinct offsets, where the fewest boxes meet."""
    d = max(cut, key=lambda c: len({o[c] for o, _ in live}))
    ordered = sorted(live, key=lambda box: box[0][d])
    tests = 0
    for i, a in enumerate(ordered):
        a_end = a[0][d] + a[1][d]
        for b in ordered[i + 1 :]:
            if b[0][d] >= a_end:
                break
            tests += 1
            if budget is not None and tests > budget:
                return None, True
            if _overlaps(a, b):
                return _ordered(a, b), False
    return None, False
