"""Where the clipped checkpoint goes: one writer per input format, behind an atomic replace.

Adding a format is one new module and one line in ``WRITERS``. Which files
a checkpoint is written back as is its layout's to say, as plain data (a
``WriteBackPlan``: one file, or a set as a folder); ``write_back.execute``
writes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from gradclip_cli.errors import OutputError
from gradclip_cli.sink.atomic import atomic_write, check_target, links_kept
from gradclip_cli.sink.safetensors_file import write_safetensors
from gradclip_cli.sink.torch_file import write_torch_legacy, write_torch_zip
from gradclip_cli.source.interface import Checkpoint

__all__ = ["WRITERS", "atomic_write", "check_target", "links_kept", "write_checkpoint"]

WRITERS: dict[str, Callable[[Checkpoint, BinaryIO], None]] = {
    "torch-zip": write_torch_zip,
    "torch-legacy": write_torch_legacy,
    "safetensors": write_safetensors,
}


def write_checkpoint(ckpt: Checkpoint, output: Path | str) -> int:
    """Write ``ckpt.root`` to ``output`` in the input's own format, atomically.

    The caller has already clipped the gradient tensors in ``ckpt.root`` in
    place; everything else (nesting, other entries, names, dtypes, shapes,
    tied storages, safetensors metadata) is written as loaded. The new file
    takes the input's permission bits.

    When ``output`` is a symlink (``--in-place`` on a linked checkpoint), it
    is resolved first: the file it points to is replaced atomically and the
    link stays a link. Raises ``OutputError``; on failure nothing is changed.

    Returns how many other names (hard links) the replaced file had. The
    replace gives ``output`` a new file, so those names keep the old bytes;
    the caller says so (writing through every link instead would give up
    atomicity, and the input may be mapped by this very process).
    """
    writer = WRITERS.get(ckpt.format)
    if writer is None:
        raise OutputError(f"{output}: cannot write checkpoints of format {ckpt.format!r}")
    target = Path(os.path.realpath(output)) if os.path.islink(output) else Path(output)
    kept = links_kept(target)
    atomic_write(target, lambda file: writer(ckpt, file), mode_from=ckpt.path)
    return kept
