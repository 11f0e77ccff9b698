"""How ``clip`` writes back the checkpoints a layout can write (``source/interface.py``,
``WriteBack``): one file, or a set of files written as a folder.

A layout builds one of these in its ``write_back(contents)``, once the
gradients it holds are the tensors clip scales in place; writing is this
package's (``write_checkpoint``, ``sharded_set``), and under a launcher each
file of a set is written by the rank that reads it (``distributed/sets.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gradclip_cli.source.interface import Checkpoint, Contents


@dataclass
class FileWriteBack:
    """One checkpoint file, written whole in its own format by one process."""

    checkpoint: Checkpoint
    folder: Path | None = None
    files: list[Path] = field(default_factory=list)
    tensor_count: int | None = None

    def copies(self, name: str) -> tuple[Path, ...]:
        return ()

    def write(
        self,
        target: Path | str,
        *,
        in_place: bool,
        session=None,
        owners: dict[str, int] | None = None,
    ) -> int:
        from gradclip_cli.sink import write_checkpoint

        return write_checkpoint(self.checkpoint, target)


@dataclass
class SetWriteBack:
    """A set of files (``contents.shards`` in their own formats, every other file of
    ``contents.folder`` copied, each ``patch``-ed), written as a new folder.

    ``files``: the files holding gradients, which ranks share; ``pieces``: for a
    held gradient that other files hold too, those files (written from it);
    ``tensor_count``: the tensors the report counts, where held gradients are
    pieces of them.
    """

    contents: Contents
    files: list[Path]
    tensor_count: int | None = None
    patch: Callable[[str, Path], None] | None = None
    pieces: dict[str, tuple[Path, ...]] = field(default_factory=dict)

    @property
    def folder(self) -> Path | None:
        return self.contents.folder

    def copies(self, name: str) -> tuple[Path, ...]:
        return self.pieces.get(name, ())

    def write(
        self,
        target: Path | str,
        *,
        in_place: bool,
        session=None,
        owners: dict[str, int] | None = None,
    ) -> int:
        from gradclip_cli.sink import WRITERS

        if in_place and os.path.islink(target):
            # As for one file (``write_checkpoint``): the folder the link names is
            # replaced and the link stays a link; swapping the link itself would
            # leave the set where it was and the link's name on a new folder.
            target = os.path.realpath(target)
        if session is not None:
            from gradclip_cli.distributed.sets import write_set_by_ranks

            write_set_by_ranks(
                session,
                self.contents,
                Path(target),
                WRITERS,
                in_place=in_place,
                owners=owners or {},
                patch=self.patch,
            )
        else:
            from gradclip_cli.sink.sharded_set import write_set

            write_set(self.contents, Path(target), WRITERS, in_place=in_place, patch=self.patch)
        return 0
