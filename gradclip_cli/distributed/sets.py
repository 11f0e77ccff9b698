"""``clip`` of a set of files under a launcher: which rank writes each file.

Each file that holds gradients is read, clipped and written by one rank;
the sink writes the set from every rank at once and switches it in whole
(``sink/sharded_set.write_set_by_ranks``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..sink.sharded_set import set_member
from .pieces import assign


def shard_owners(files: list[Path], folder: Path, world_size: int) -> dict[str, int]:
    """The rank that reads, clips and writes each file of a set (by its ``set_member`` name
    in ``folder``): the files that hold its gradients (``WriteBackPlan.files``: the
    shards of an HF set, the ``.distcp`` files holding a DCP set's gradient chunks);
    contiguous runs of files of about equal bytes (``pieces.assign``). Other files of
    the folder (the index, ``.metadata``) are rank 0's to copy."""
    owners = assign([os.stat(f).st_size for f in files], world_size)
    return {set_member(f, folder): r for f, r in zip(files, owners)}
