"""``clip`` of a sharded set under a launcher: each shard written by the rank that read it.

The set is still switched in whole (``sink/sharded_set.py``): rank 0 makes
the one temporary folder and tells the others its name; every rank writes
its own shards into it (an HF set's shards, or the ``.distcp`` files of a
DCP set's gradient chunks, copied with the chunks patched); rank 0 also
copies the index or ``.metadata`` and the folder's other files; one
exchange then tells every rank whether all the writes succeeded.
Only then does rank 0 switch the folder in. A failed write on any rank is
reported once, naming that rank, and the temporary folder is removed by
rank 0 after every rank has stopped writing into it: the input is
untouched, as in one process. A rank that dies leaves the others to time
out in the exchange (``launcher.Session``), and the input is untouched too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..errors import OutputError
from ..sink.atomic import _output_error
from ..sink.sharded_set import begin_set, discard_set, fill_set, set_member, switch_set
from ..source.interface import Contents
from .launcher import Session
from .pieces import assign


def shard_owners(files: list[Path], folder: Path, world_size: int) -> dict[str, int]:
    """The rank that reads, clips and writes each file of a set (by its ``set_member`` name
    in ``folder``): the files that
    hold its gradients (``WriteBack.files``: the shards of an HF set, the ``.distcp``
    files holding a DCP set's gradient chunks); contiguous runs of files of about equal
    bytes (``pieces.assign``). Other files of the folder (the index, ``.metadata``) are
    rank 0's to copy."""
    owners = assign([os.stat(f).st_size for f in files], world_size)
    return {set_member(f, folder): r for f, r in zip(files, owners)}


def write_set_by_ranks(session: Session, contents: Contents, target: Path, writers: dict,
                       *, in_place: bool, owners: dict[str, int],
                       patch: Callable[[str, Path], None] | None = None) -> None:
    """Write the clipped set at ``target`` from every rank at once (see the module docstring)."""
    temp = begin_set(contents, target, in_place=in_place) if session.primary else None
    temp = Path(session.exchange(None if temp is None else str(temp))[0])
    failure = None
    try:
        fill_set(contents, temp, writers, patch=patch,
                 mine=lambda name: owners.get(name, 0) == session.rank)
    except OutputError as error:
        failure = str(error)
    except OSError as error:
        failure = str(_output_error(Path(target), error))
    try:
        outcomes = session.exchange(failure)
    except BaseException:
        if session.primary:
            discard_set(temp)
        raise
    failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
    if failed:
        if session.primary:
            discard_set(temp)
        rank, text = failed[0]
        # Every rank raises the same line, so it is reported once, as it is.
        raise OutputError(f"rank {rank}: {text}")
    if session.primary:
        switch_set(temp, target, in_place=in_place)

