"""The tiling check of DCP chunks and DCP Hugging Face pieces (``layouts/tiling.py``).

The reference counts, element by element, how many boxes hold each element
(an array the tensor's size): an element held twice is an overlap, one held by
none a gap, and an overlap is reported before a gap, as the pairwise check
did. Large layouts (16,000 chunks) are checked for the verdict alone.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradclip_cli.errors import InputError
from gradclip_cli.source.layouts import tiling
from gradclip_cli.source.layouts.dcp_folder import check_tiling

WHERE = Path("ckpt/.metadata")


def _reference(size, boxes) -> str:
    counts = np.zeros(size, dtype=np.int64)
    for offsets, sizes in boxes:
        counts[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    if (counts >= 2).any():
        return "overlap"
    if (counts == 0).any():
        return "gap"
    return "ok"


def _verdict(size, boxes) -> str:
    try:
        tiling.check(size, boxes)
    except tiling.Overlap as overlap:
        if overlap.pair is not None:
            a, b = overlap.pair
            assert a in boxes and b in boxes and a != b
            assert all(
                max(ao, bo) < min(ao + asz, bo + bsz)
                for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1])
            )
        return "overlap"
    except tiling.Gap as gap:
        assert gap.covered == sum(math.prod(s) for _, s in boxes)
        return "gap"
    return "ok"


def _grid(size, cuts):
    """The boxes of a grid: ``cuts[d]`` the cut points along dimension d."""
    edges = [[0, *sorted(c), n] for c, n in zip(cuts, size)]
    spans = [[(a, b - a) for a, b in zip(e, e[1:]) if b > a] for e in edges]
    return [
        (tuple(o for o, _ in combo), tuple(s for _, s in combo))
        for combo in itertools.product(*spans)
    ]


@st.composite
def layouts(draw):
    """A grid tiling of a small tensor (1-4 dimensions), then perturbed: boxes dropped,
    moved, resized, split off or added, as a hostile metadata file might."""
    dims = draw(st.integers(1, 4))
    size = tuple(draw(st.integers(1, 5)) for _ in range(dims))
    cuts = [
        draw(st.sets(st.integers(1, max(1, n - 1)), max_size=2)) if n > 1 else set() for n in size
    ]
    boxes = _grid(size, cuts)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["drop", "move", "grow", "add"]))
        if kind == "drop" and len(boxes) > 1:
            boxes.pop(draw(st.integers(0, len(boxes) - 1)))
        elif kind in ("move", "grow") and boxes:
            i = draw(st.integers(0, len(boxes) - 1))
            offsets, sizes = map(list, boxes[i])
            d = draw(st.integers(0, dims - 1))
            if kind == "move":
                offsets[d] = draw(st.integers(0, size[d] - sizes[d]))
            else:
                sizes[d] = draw(st.integers(1, size[d] - offsets[d]))
            boxes[i] = (tuple(offsets), tuple(sizes))
        elif kind == "add":
            offsets = tuple(draw(st.integers(0, n - 1)) for n in size)
            sizes = tuple(draw(st.integers(1, n - o)) for o, n in zip(offsets, size))
            boxes.append((offsets, sizes))
    return size, list(dict.fromkeys(boxes))  # distinct, as the layouts hand them over


@settings(max_examples=400, deadline=None, database=None)
@given(layouts())
def test_verdict_is_the_element_counts(layout):
    size, boxes = layout
    assert _verdict(size, boxes) == _reference(size, boxes)


def test_every_grid_tiles_in_every_dimension_count():
    for size, cuts in [
        ((6,), [{2, 3}]),
        ((4, 6), [{1}, {2, 4}]),
        ((2, 3, 4), [{1}, {1, 2}, {2}]),
        ((2, 2, 2, 2), [{1}] * 4),
        ((3, 1, 5, 2, 2), [{1}, set(), {4}, {1}, {1}]),
    ]:
        assert _verdict(size, _grid(size, cuts)) == "ok", size


N = 16_000


@pytest.mark.parametrize(
    "shape, box",
    [
        ((1, N), lambda i: ((0, i), (1, 1))),  # every chunk shares the first dimension
        ((N,), lambda i: ((i,), (1,))),
        ((2, N // 4, 2), lambda i: ((i % 2, i // 2 % (N // 4), i // (N // 2)), (1, 1, 1))),
        (
            (2, 2, N // 8, 2),
            lambda i: ((i % 2, i // 2 % 2, i // 4 % (N // 8), i // (N // 2)), (1, 1, 1, 1)),
        ),
    ],
)
def test_sixteen_thousand_chunks(shape, box):
    """Many one-element chunks: accepted whole; one missing is a gap naming the counts;
    one moved onto its neighbour is an overlap naming both."""
    count = math.prod(shape)
    boxes = [box(i) for i in range(count)]
    assert len(set(boxes)) == count
    check_tiling(WHERE, "w", shape, boxes)
    with pytest.raises(InputError, match=rf"cover {count - 1} of its {count} elements \(a gap\)"):
        check_tiling(WHERE, "w", shape, boxes[:-1])
    offsets, sizes = boxes[N // 2]
    d = next(d for d in range(len(shape)) if offsets[d] + sizes[d] < shape[d])
    grown = list(boxes)
    grown[N // 2] = (offsets, tuple(n + (k == d) for k, n in enumerate(sizes)))
    with pytest.raises(InputError, match=r"'w' at \[.*\] and \[.*\] overlap"):
        check_tiling(WHERE, "w", shape, grown)


def test_a_large_overlap_among_many_chunks_in_three_dimensions():
    """Three cut dimensions, 8,000 chunks: an added chunk over two others is an overlap."""
    shape = (20, 20, 20)
    boxes = _grid(shape, [set(range(1, 20))] * 3)
    check_tiling(WHERE, "w", shape, boxes)
    extra = ((3, 3, 3), (2, 1, 1))
    with pytest.raises(InputError, match="overlap"):
        check_tiling(WHERE, "w", shape, [*boxes, extra])
    with pytest.raises(InputError, match="a gap"):
        check_tiling(WHERE, "w", shape, boxes[1:])


def test_more_cut_dimensions_than_corners_pay_for():
    """Eleven cut dimensions (2^11 corners a piece): the complete pairwise check decides.
    A staircase: piece j holds the half of dimension j where the earlier pieces end."""
    dims = 11
    assert tiling.MAX_CORNER_DIMENSIONS < dims
    shape = (2,) * dims
    boxes = [
        (
            tuple(1 if d < j else 0 for d in range(dims)),
            tuple(1 if d <= j else 2 for d in range(dims)),
        )
        for j in range(dims)
    ]
    boxes.append(((1,) * dims, (1,) * dims))
    assert _verdict(shape, boxes) == _reference(shape, boxes) == "ok"
    assert _verdict(shape, boxes[:-1]) == "gap"
    grown = [((0,) * dims, (2,) + (1,) + (2,) * (dims - 2)), *boxes[1:]]
    assert _verdict(shape, grown) == _reference(shape, grown) == "overlap"
