"""Which rank reads which piece: contiguous runs of about equal bytes.

A *piece* is the unit one rank reads and measures whole: a tensor of one
file today, a shard file or a DCP chunk for sharded layouts. Pieces are
numbered in single-process order; the split only decides who computes each,
never the order results are combined in (combine.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def assign(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that owns each piece, given each piece's size in bytes.

    Rank ``r`` owns the pieces whose byte midpoint lies in
    ``[r * B / W, (r + 1) * B / W)`` of the running total ``B`` (``W`` ranks):
    each rank reads one contiguous run (sequential reads, no seeking between
    ranks' regions), and no rank reads more than its share by more than half
    of one piece on each side. A piece larger than a share is still read
    whole by one rank; ranks may then own nothing.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = sum(sizes)
    if total == 0:
        # Nothing to read: spread by count so every rank still has a share.
        n = len(sizes)
        return [i * world_size // n for i in range(n)] if n else []
    owners = []
    before = 0
    for size in sizes:
        middle2 = 2 * before + size  # twice the midpoint: integers stay exact
        owners.append(min(world_size - 1, middle2 * world_size // (2 * total)))
        before += size
    return owners


def owned(owners: Sequence[int], rank: int) -> list[int]:
    """Indices of the pieces ``rank`` owns, in order."""
    return [i for i, r in enumerate(owners) if r == rank]
