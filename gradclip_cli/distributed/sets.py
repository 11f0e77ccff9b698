"""``clip`` of a set of files under a launcher: which rank writes each file.

Each file that holds gradients is read, clipped and written by one rank;
the sink writes the set from every rank at once and switches it in whole
(``sink/sharded_set.write_set_by_ranks``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..sink.sharded_set import set_member
from .pieces import assign

if TYPE_CHECKING:
    from ..source.interface import WriteBackPlan
    from .launcher import Session


def shard_owners(files: list[Path], folder: Path, world_size: int) -> dict[str, int]:
    """The rank that reads, clips and writes each file of a set (by its ``set_member`` name
    in ``folder``): the files that hold its gradients (``WriteBackPlan.files``: the
    shards of an HF set, the ``.distcp`` files holding a DCP set's gradient chunks);
    contiguous runs of files of about equal bytes (``pieces.assign``). Other files of
    the folder (the index, ``.metadata``) are rank 0's to copy."""
    owners = assign([os.stat(f).st_size for f in files], world_size)
    return {set_member(f, folder): r for f, r in zip(files, owners)}


def set_owners(session: Session | None, plan: WriteBackPlan | None) -> dict[str, int] | None:
    """Under a launcher (``session``), who clips and writes each file of a set: each rank
    its own shards (``shard_owners`` of ``plan``'s files). None where one process
    writes the output, holding every scaled tensor: no launcher, or one file (rank 0
    scales, checks and writes it; the other ranks only share the first measuring)."""
    if session is None or plan is None or plan.folder is None or not plan.files:
        return None
    return shard_owners([f.path for f in plan.files], plan.folder, session.world_size)
