"""Reading a small file whole (an index, a Trainer state, DCP's ``.metadata``), bounded."""

from __future__ import annotations

import os
from pathlib import Path

from gradclip_cli.errors import InputError


def read_small_file(path: Path, *, limit: int, what: str) -> bytes:
    """The bytes of ``path``; ``InputError`` naming it when it is missing, larger than
    ``limit`` bytes (checked before reading) or unreadable. ``what`` names the file's
    kind in the message ("DCP metadata")."""
    try:
        size = os.stat(path).st_size
        if size > limit:
            raise InputError(f"{path}: {size} bytes is too large for {what}")
        with open(path, "rb") as file:
            return file.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file ({what})") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
