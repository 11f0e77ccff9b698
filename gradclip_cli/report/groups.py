"""Tensors' power sums reduced to groups and a total: the one group reduction.

Every place that shows group norms (``inspect``'s report, ``trend`` and
``compare``, ``clip``'s check, the training-loop monitor) groups through
``group_sums`` and reads non-finite counts through ``nonfinite_counts``, so a
group's norm and its counts mean the same thing wherever they are shown.
The math is the core's (``PowerSums.reduce``); this module only decides
which piece goes to which group: groups in the order their first member
appears, as a checkpoint or ``named_parameters()`` lists them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core import PowerSums
from .model import NonFinite


@dataclass(frozen=True)
class GroupSums:
    """Power sums of each group and of all pieces together.

    ``names``: the groups, in order of their first member; ``index``: each
    piece's group (a position in ``names``), for reducing other sums aligned
    with the same pieces (the same parameters' weights) into the same groups.
    """

    names: list[str]
    index: torch.Tensor
    groups: PowerSums
    total: PowerSums

    def reduce(self, sums: PowerSums) -> PowerSums:
        """``sums``, aligned with the same pieces, combined into these groups."""
        return sums.reduce(self.index, len(self.names))


@dataclass(frozen=True)
class Grouping:
    """Which group each piece belongs to, worked out once for a list of group names.

    What ``group_sums`` computes before it reduces: the training-loop monitor
    keeps one for as long as its model's parameters stay the same, instead of
    mapping 1,000 names to positions on every step.
    """

    names: list[str]
    index: torch.Tensor

    @classmethod
    def of(cls, members: Sequence[str]) -> Grouping:
        """``members[i]`` is piece i's group; groups in order of their first member."""
        names = list(dict.fromkeys(members))
        position = {g: i for i, g in enumerate(names)}
        return cls(names, torch.tensor([position[g] for g in members], dtype=torch.int64))

    def sums(self, sums: PowerSums) -> GroupSums:
        """``sums`` (one piece per member) reduced into the groups, and their total.

        The total is reduced from the pieces themselves, not from the groups:
        one rounding step fewer, and the same total whatever the grouping.
        """
        return GroupSums(
            self.names, self.index, sums.reduce(self.index, len(self.names)), sums.total()
        )


def group_sums(members: Sequence[str], sums: PowerSums) -> GroupSums:
    """Reduce ``sums`` (one piece per name) into groups; ``members[i]`` is piece i's group."""
    return Grouping.of(members).sums(sums)


def nonfinite_counts(sums: PowerSums) -> list[NonFinite]:
    """Each piece's NaN, +inf and -inf counts (whole columns at once: indexing a
    tensor element by element is slow at 20,000 pieces)."""
    return [
        NonFinite(*counts)
        for counts in zip(sums.nan.tolist(), sums.posinf.tolist(), sums.neginf.tolist())
    ]
