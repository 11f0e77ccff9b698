"""Writing ``torch.save`` files in the format the input had (zip or legacy)."""

from __future__ import annotations

from typing import BinaryIO

import torch

from gradclip_cli.source.interface import Checkpoint


def write_torch_zip(ckpt: Checkpoint, file: BinaryIO) -> None:
    """Save ``ckpt.root`` in the zip format.

    ``torch.save`` pickles each storage once, so tensors that shared a storage
    in the input (tied weights, views) still share one in the output.
    """
    torch.save(ckpt.root, file)


def write_torch_legacy(ckpt: Checkpoint, file: BinaryIO) -> None:
    """Save ``ckpt.root`` in the legacy (pre-1.6, non-zip) format, as the input was."""
    torch.save(ckpt.root, file, _use_new_zipfile_serialization=False)
