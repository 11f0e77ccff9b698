"""Per-piece power sums from every rank, put back in single-process order.

Each rank measures the pieces it owns (pieces.py) with the core's
``tensor_power_sums``, whose per-tensor results depend on nothing but the
tensor itself (the same rows, summed in the same order, with pointwise
``pow``). Gathering those few numbers per tensor once, and placing them at
their single-process index, gives every rank the very ``PowerSums`` one
process would have computed; groups and totals are then reduced from it with
``PowerSums.reduce`` exactly as without a launcher. Nothing is summed across
ranks in a rank-dependent order, so the report is the same to the last digit
whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core import PowerSums
from ..core.power_sums import F64
from .launcher import Session

_FLOAT_FIELDS = ("scale", "power_sum", "max_abs")
_COUNT_FIELDS = ("nan", "posinf", "neginf")


def gather_power_sums(
    session: Session, local: PowerSums, mine: Sequence[int], size: int
) -> PowerSums:
    """All ``size`` pieces' sums on every rank, given this rank's ``local`` sums of ``mine``.

    Payloads are Python floats and ints: pickled exactly, whatever the backend.
    """
    payload = (list(mine), [getattr(local, f).tolist() for f in _FLOAT_FIELDS + _COUNT_FIELDS])
    columns = {f: torch.zeros(size, dtype=F64) for f in _FLOAT_FIELDS}
    columns.update({f: torch.zeros(size, dtype=torch.int64) for f in _COUNT_FIELDS})
    seen = torch.zeros(size, dtype=torch.int64)
    for indices, values in session.exchange(payload):
        where = torch.tensor(indices, dtype=torch.int64)
        seen.index_add_(0, where, torch.ones_like(where))
        for field, column in zip(_FLOAT_FIELDS + _COUNT_FIELDS, values):
            columns[field][where] = torch.tensor(column, dtype=columns[field].dtype)
    if not bool((seen == 1).all()):
        raise RuntimeError("pieces measured by the ranks do not cover the checkpoint once")
    return PowerSums(local.norm_type, **columns)
