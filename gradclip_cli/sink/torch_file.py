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
    _save(ckpt.root, file)


class _Recording:
    """A file that remembers the first OSError of a write: torch's zip writer
    swallows it and reports "unexpected pos 768 vs 662" instead (a full disk)."""

    def __init__(self, file: BinaryIO):
        self._file = file
        self.error: OSError | None = None

    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self):
        try:
            return self._file.flush()
        except OSError as error:
            self.error = self.error or error
            raise

    def __getattr__(self, name):
        return getattr(self._file, name)


def _save(root, file: BinaryIO, **options) -> None:
    recording = _Recording(file)
    try:
        torch.save(root, recording, **options)
    except Exception:
        if recording.error is not None:
            raise recording.error from None
        raise


def write_torch_legacy(ckpt: Checkpoint, file: BinaryIO) -> None:
    """Save ``ckpt.root`` in the legacy (pre-1.6, non-zip) format, as the input was."""
    _save(ckpt.root, file, _use_new_zipfile_serialization=False)
