"""``clip`` of a set of files under a launcher: which rank writes each file.

Each file that holds gradients is read, clipped and written by one rank;
the sink writes the set from every rank at once and switches it in whole
(``sink/sharded_set.write_set_by_ranks``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..sink.sharded_set import set_member
from .pieces import assign

if TYPE_CHECKING:
    from ..source.interface import WriteBackPlan
    from .launcher import Session


def shard_owners(session: Session | None, plan: WriteBackPlan | None) -> dict[str, int] | None:
    """Under a launcher (``session``), the rank that reads, clips and writes each file of a
    set (by its ``set_member`` name in ``plan.folder``): the files that hold its
    gradients (``WriteBackPlan.files``: the shards of an HF set, the ``.distcp`` files
    holding a DCP set's gradient chunks); contiguous runs of files of about equal bytes
    (``pieces.assign``). Other files of the folder (the index, ``.metadata``) are rank
    0's to copy. None where one process writes the output, holding every scaled
    tensor: no launcher, or one file (rank 0 scales, checks and writes it; the other
    ranks share only the first measuring)."""
    if session is None or plan is None or plan.folder is None or not plan.files:
        return None
    files = [f.path for f in plan.files]
    owners = assign([os.stat(f).st_size for f in files], session.world_size)
    return {set_member(f, plan.folder): r for f, r in zip(files, owners)}
