"""The distinct storage elements behind a list of tensors.

A tensor's elements are its storage's elements, whatever the view. Tied
weights (one tensor under two names), a transpose of another entry,
overlapping slices and stride-0 expansions all name some storage elements
more than once; counting them once per name would inflate a norm, and
scaling them once per name would clip them by the coefficient squared (or
the element of a scalar expanded to 10^12 elements a trillion times).

So the core measures and scales *pieces*: disjoint sets of storage elements.
For tensors ``t_0 .. t_{n-1}``, ``distinct_elements`` gives

* ``owned[i]``: the elements that ``t_i`` covers and no earlier tensor does.
  Together they partition every covered element exactly once: totals and
  groups are sums over them, and clipping scales each of them once;
* ``covered[i]``: the elements ``t_i`` covers, for its own row in a report:
  an index ``j`` when they are exactly ``owned[j]``, else a gathered piece;
* ``tie_of[i]``: the first tensor covering exactly the same elements (tied).

The common cases cost nothing: a tensor alone in its storage is its own
piece (an expansion first reduced to the elements it repeats), views of one
storage whose extents do not meet are one piece each (a flat gradient
buffer), and views identical up to expansion are one piece (tied weights).
Only storages with partly overlapping views, or a view overlapping itself,
are gathered into copies, and their cost follows the storage's size, never a
tensor's logical size.

Complex elements are measured as ``|z|`` (computed in a wider type, so it
cannot overflow spuriously) and scaled as complex numbers. A sparse tensor's
elements are its stored values (torch's norm of a sparse tensor is that of its
values); duplicate COO entries are summed first, as the dense tensor would be.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_WIDER_COMPLEX = {torch.complex32: torch.complex64, torch.complex64: torch.complex128}


@dataclass
class Piece:
    """A set of storage elements.

    ``target`` is a view of them to scale in place. A gathered piece has none
    and lives at ``base[index]`` (``base`` a flat view of the whole storage);
    a sparse COO piece is ``sparse``'s values (``target`` is its stored
    values, duplicates included). ``measure`` reads the current values each
    time it is asked, so a piece measured after scaling sees the new ones.
    """

    target: torch.Tensor | None = None
    base: torch.Tensor | None = None
    index: torch.Tensor | None = None
    sparse: torch.Tensor | None = None

    @property
    def measure(self) -> torch.Tensor:
        """Real values whose p-norm is the piece's (``|z|`` for complex)."""
        if self.index is not None:
            return measurable(self.base.index_select(0, self.index))
        if self.sparse is not None:
            return measurable(self.sparse.coalesce().values())
        return measurable(self.target)

    def numel(self) -> int:
        """How many distinct elements the piece holds."""
        if self.index is not None:
            return self.index.numel()
        if self.sparse is not None:  # a hybrid tensor's entries are rows of values
            return self.sparse.coalesce()._values().numel()
        return self.target.numel()


@dataclass
class Elements:
    """Disjoint pieces of ``n`` tensors' elements (see the module docstring).

    ``whole`` is set when every tensor is real and its own piece (``owned[i]``
    is all of tensor ``i``): the common case, which the drop-ins read and
    scale as the tensors themselves, without a piece object per tensor.
    """

    owned: Sequence[Piece]
    covered: Sequence[int | Piece]
    tie_of: Sequence[int]
    shares: Sequence[tuple[int, ...]]  # other tensors sharing at least one element
    whole: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.owned)

    def measured(self) -> tuple[list[torch.Tensor], list[int]]:
        """Everything to measure once, and for each tensor the position of its own elements.

        Positions ``0 .. n-1`` are the owned pieces; gathered coverage follows.
        """
        tensors = [p.measure for p in self.owned]
        rows = []
        for c in self.covered:
            if isinstance(c, int):
                rows.append(c)
            else:
                rows.append(len(tensors))
                tensors.append(c.measure)
        return tensors, rows

    def only(self, keep: Sequence[bool]) -> Elements:
        """The elements owned by the tensors ``keep`` marks, the others left out: what
        one rank scales when each rank clips its own shards of a set."""
        owned = [p if k else Piece() for p, k in zip(self.owned, keep)]
        return Elements(owned, self.covered, self.tie_of, self.shares)

    def count(self, i: int) -> int:
        """Distinct elements tensor ``i`` covers."""
        c = self.covered[i]
        return (self.owned[c] if isinstance(c, int) else c).numel()


def readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd: norms and clipping never record a graph (torch's
    clip functions run under ``no_grad``), and parameters load with ``requires_grad``."""
    return t.detach() if t.requires_grad else t


def distinct_elements(tensors: Sequence[torch.Tensor]) -> Elements:
    """The disjoint pieces behind ``tensors`` (see the module docstring)."""
    apart = _apart(tensors)
    if apart is not None:
        return apart
    n = len(tensors)
    tensors = [t.detach() if t.requires_grad else t for t in tensors]
    owned: list[Piece | None] = [None] * n
    covered: list[int | Piece] = list(range(n))
    tie_of = list(range(n))
    shares: list[tuple[int, ...]] = [()] * n
    by_storage: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            owned[i] = _sparse_piece(t)
        elif t.numel() == 0:
            owned[i] = Piece(target=t)
        else:
            by_storage.setdefault((t.device, _storage_key(t), t.dtype), []).append(i)
    for members in by_storage.values():
        if len(members) == 1 and tensors[members[0]].is_contiguous():
            # The common case, kept cheap for 20,000 tensors: alone in its
            # storage, and contiguous (no expanded or overlapping dims).
            owned[members[0]] = Piece(target=tensors[members[0]])
            continue
        _split_storage(tensors, members, owned, covered, tie_of, shares)
    return Elements(owned, covered, tie_of, shares)  # type: ignore[arg-type]


def _apart(tensors: Sequence[torch.Tensor]) -> Elements | None:
    """The pieces when no two tensors can share an element (``apart``), else None."""
    if not apart(tensors):
        return None
    whole = list(map(readable, tensors)) if any(map(_REQUIRES_GRAD, tensors)) else list(tensors)
    real = not any(t.is_complex for t in set(map(_DTYPE, tensors)))
    n = len(whole)
    return Elements(_WholePieces(whole), range(n), range(n), ((),) * n, whole if real else None)


def apart(tensors: Sequence[torch.Tensor], nbytes: torch.Tensor | None = None) -> bool:
    """Whether no two of ``tensors`` can share an element, from their metadata alone.

    The common case (a gradient per parameter, each its own allocation):
    every tensor dense, contiguous and nonempty, and their byte ranges
    ``[data_ptr, data_ptr + nbytes)`` pairwise disjoint. False says only
    that this check cannot tell (``distinct_elements`` then looks closer).
    ``nbytes``: the tensors' sizes in bytes (int64), when the caller has them.
    A tensor without an address (``meta``, fake) gives False: it has no
    range to compare.
    """
    starts = _contiguous_starts(tensors)
    if starts is None:
        return False
    if nbytes is None:
        sizes = array("q", map(_NBYTES, tensors))
        if not all(sizes):
            return False
        if len(sizes) < 2:
            return True
        nbytes = torch.frombuffer(sizes, dtype=torch.int64)
    elif not bool(nbytes.all()):
        return False
    return _disjoint(starts, nbytes)


class ApartAgain:
    """``apart`` for a caller that asks about its tensors on every step (the monitor).

    A True answer depends on the tensors' metadata alone: every one
    contiguous, and their addresses and byte sizes. It is kept with the
    addresses and sizes it was found for, and given again, without sorting
    the ranges, while every tensor is contiguous at the same address with
    the same size (gradients kept from step to step, or allocated again at
    the same places): the same ranges, so the same answer.
    """

    def __init__(self) -> None:
        self._seen: tuple[array, array, int] | None = None

    def __call__(self, tensors: Sequence[torch.Tensor], numels: array, itemsize: int) -> bool:
        """``apart(tensors)`` for tensors of one dtype (``itemsize`` bytes an element)
        holding ``numels`` elements (an ``array("q")``)."""
        starts = _contiguous_starts(tensors)
        if starts is None:
            return False
        seen = (starts, numels, itemsize)
        if seen == self._seen:  # arrays compare their buffers, at C speed
            return True
        self._seen = None
        if not all(numels):
            return False
        if len(numels) > 1 and not _disjoint(
            starts, torch.frombuffer(numels, dtype=torch.int64) * itemsize
        ):
            return False
        self._seen = seen
        return True


def _contiguous_starts(tensors: Sequence[torch.Tensor]) -> array | None:
    """The tensors' addresses (an ``array("q")``), when every one is contiguous and
    has one; else None."""
    # Passes over metadata at C speed (map), not a Python loop: the monitor asks
    # on every step, for 1,000 tensors. No layout but torch.strided gets past
    # them: a sparse COO tensor is not contiguous, CSR, CSC and BSR ones
    # refuse is_contiguous(), and those and mkldnn ones refuse data_ptr().
    try:
        if not all(map(torch.Tensor.is_contiguous, tensors)):
            return None
        starts = array("q", map(torch.Tensor.data_ptr, tensors))
    except RuntimeError:  # no data_ptr() (fake, functional, sparse, mkldnn)
        return None
    return starts if all(starts) else None


def _disjoint(starts: array, nbytes: torch.Tensor) -> bool:
    """Whether the byte ranges ``[starts[i], starts[i] + nbytes[i])`` are pairwise disjoint."""
    if len(starts) < 2:
        return True
    begin = torch.frombuffer(starts, dtype=torch.int64)
    order = begin.argsort()
    end = begin + nbytes
    return not bool((end[order[:-1]] > begin[order[1:]]).any())


_NBYTES = attrgetter("nbytes")
_REQUIRES_GRAD = attrgetter("requires_grad")
_DTYPE = attrgetter("dtype")


class _WholePieces(Sequence):
    """``Piece(target=t)`` for each tensor, made when asked for."""

    def __init__(self, tensors: list[torch.Tensor]):
        self._tensors = tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [Piece(target=t) for t in self._tensors[i]]
        return Piece(target=self._tensors[i])


def _storage_key(t: torch.Tensor):
    """What identifies ``t``'s storage (``t`` not empty), read from metadata, never data.

    The storage's address where there is one, without building a storage
    object (2 us each). A ``meta`` or fake tensor has no data: its
    ``data_ptr()`` is 0 (or refuses), and there the storage object itself,
    which views of one tensor share, is compared by identity.
    """
    try:
        address = t.data_ptr()
    except RuntimeError:
        address = 0
    if address:
        return address - t.storage_offset() * t.element_size()
    return StorageWeakRef(t.untyped_storage())


def _split_storage(tensors, members, owned, covered, tie_of, shares) -> None:
    views = {i: _essential(tensors[i]) for i in members}
    if len(members) == 1:
        (i,) = members
        if not _overlaps_itself(views[i]):
            owned[i] = _view_piece(views[i])
            return
    else:
        first = members[0]
        if all(_same_view(views[first], views[i]) for i in members) and not _overlaps_itself(
            views[first]
        ):
            owned[first] = _view_piece(views[first])
            for i in members[1:]:
                owned[i] = _empty_piece(views[i])
                covered[i] = tie_of[i] = first
                shares[i] = tuple(j for j in members if j != i)
            shares[first] = tuple(members[1:])
            return
        if _extents_disjoint(views, members):
            for i in members:
                owned[i] = _view_piece(views[i])
            return
    _gather_storage(tensors, members, views, owned, covered, tie_of, shares)


def _gather_storage(tensors, members, views, owned, covered, tie_of, shares) -> None:
    """Partial overlaps: one mask of covered positions per tensor over the storage span."""
    lo = min(v.storage_offset() for v in views.values())
    hi = max(_last_offset(v) for v in views.values()) + 1
    flat = _flat_storage(tensors[members[0]])
    base = flat[lo:hi]
    # Masks describe positions, not values: they are built on the CPU from
    # offsets and strides, so nothing is read from the device (or from meta).
    masks = {i: _coverage(views[i], lo, hi - lo) for i in members}
    before = torch.zeros(hi - lo, dtype=torch.bool)
    owns_all = {}
    for k, i in enumerate(members):
        mine = masks[i] & ~before
        owns_all[i] = torch.equal(mine, masks[i])
        before |= masks[i]
        owned[i] = _gathered(base, mine)
        shares[i] = tuple(j for j in members if j != i and bool((masks[i] & masks[j]).any()))
        tie_of[i] = next((j for j in members[:k] if torch.equal(masks[i], masks[j])), i)
        if owns_all[i]:
            covered[i] = i
        elif tie_of[i] != i and owns_all[tie_of[i]]:
            covered[i] = tie_of[i]
        else:
            covered[i] = _gathered(base, masks[i])


def _essential(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its repeating dimensions: size-1 and stride-0 dims dropped.

    The result is a view of the same storage elements, each named as often as
    the remaining strides name it (once, unless the view overlaps itself).
    """
    dims = [(size, stride) for size, stride in zip(t.shape, t.stride())
            if size > 1 and stride != 0]
    if len(dims) == t.dim():
        return t
    sizes = [s for s, _ in dims]
    strides = [s for _, s in dims]
    return t.as_strided(sizes, strides, t.storage_offset())


def _overlaps_itself(v: torch.Tensor) -> bool:
    """Whether two indices of ``v`` (stride-0 dims already dropped) name one element.

    Sorted by stride, dims are disjoint when each stride exceeds the span of
    all smaller ones. That test is sufficient; a view failing it is gathered
    exactly (slower, never wrong).
    """
    span = 0
    for size, stride in sorted(zip(v.shape, v.stride()), key=lambda d: d[1]):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.storage_offset() == b.storage_offset() and tuple(a.shape) == tuple(b.shape)
            and a.stride() == b.stride()) or _transposed(a, b)


def _transposed(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same elements in another dimension order (``m`` and ``m.t()``)."""
    if a.storage_offset() != b.storage_offset() or a.dim() != b.dim():
        return False
    return sorted(zip(a.shape, a.stride())) == sorted(zip(b.shape, b.stride()))


def _last_offset(v: torch.Tensor) -> int:
    return v.storage_offset() + sum(st * (s - 1) for s, st in zip(v.shape, v.stride()))


def _extents_disjoint(views, members) -> bool:
    """Whether no two views' [first, last] element ranges meet (and none overlaps itself)."""
    spans = sorted((views[i].storage_offset(), _last_offset(views[i])) for i in members)
    if any(_overlaps_itself(views[i]) for i in members):
        return False
    return all(prev[1] < nxt[0] for prev, nxt in zip(spans, spans[1:]))


def _flat_storage(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a 1-D tensor of its dtype (a view)."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((numel,), (1,), 0)


def _coverage(v: torch.Tensor, lo: int, size: int) -> torch.Tensor:
    """Boolean mask over storage positions ``lo .. lo+size-1`` of the elements ``v`` names.

    Each dimension widens the set ``S`` to ``S + {0, s, .., (n-1) s}`` by
    doubling (``S | S << k s``), so the work is the span's size times
    ``log2 n`` per dimension, whatever the view's logical size.
    """
    mask = torch.zeros(size, dtype=torch.bool)
    mask[v.storage_offset() - lo] = True
    for n, stride in zip(v.shape, v.stride()):
        have = 1  # the mask now holds offsets i * stride for i < have
        while have < n:
            step = min(have, n - have)
            shift = step * stride
            if shift < size:
                mask[shift:] |= mask[: size - shift].clone()
            have += step
    return mask


def _gathered(base: torch.Tensor, mask: torch.Tensor) -> Piece:
    return Piece(base=base, index=mask.nonzero().flatten().to(base.device))


def _view_piece(v: torch.Tensor) -> Piece:
    return Piece(target=v)


def _empty_piece(v: torch.Tensor) -> Piece:
    return Piece(target=v.as_strided((0,), (1,), v.storage_offset()))


def measurable(t: torch.Tensor) -> torch.Tensor:
    """Real values whose p-norm is the elements' p-norm: ``|z|`` for complex."""
    if not t.is_complex():
        return t
    wide = _WIDER_COMPLEX.get(t.dtype)
    # |z| of complex64 in complex128: hypot cannot overflow where |z| fits in float64.
    return (t.to(wide) if wide is not None else t).abs()


def _sparse_piece(t: torch.Tensor) -> Piece:
    if t.layout == torch.sparse_coo:
        # _values() is a view into t; coalescing (a copy, when there are
        # duplicate indices) gives the values whose norm is the dense norm.
        return Piece(target=t._values(), sparse=t)
    if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return Piece(target=t.values())
    raise ValueError(f"tensors of layout {t.layout} are not supported")


def find_ties(tensors: Sequence[torch.Tensor]) -> list[int]:
    """For each tensor, the first tensor holding exactly the same elements (itself if none)."""
    return list(distinct_elements(tensors).tie_of)
