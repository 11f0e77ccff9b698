"""``--verify``: check what a file says about itself before trusting its data.

A torch zip stores a CRC32 per entry, but ``torch.load`` never checks it, so a
flipped bit in a tensor loads silently. A safetensors file has no checksum;
what can be checked is that the header's ``data_offsets`` tile the byte buffer
exactly: no overlap, no gap, nothing past the end.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

from gradclip_cli.errors import InputError, IntegrityError
from gradclip_cli.source.files.safetensors_file import read_header

_CHUNK = 1 << 20  # stream entries: a multi-GB tensor must not be read whole


def verify_torch_zip(path: Path, span: tuple[int, int] | None = None) -> None:
    """Recompute every zip entry's CRC32 and compare it with the stored one.

    ``span`` (start, length): check the ``torch.save`` blob at those bytes of
    a bigger file (a DCP chunk), read whole: a chunk is what bounds memory.
    Raises ``IntegrityError`` naming the first damaged entry, ``InputError``
    when the archive itself cannot be read.
    """
    source: Path | io.BytesIO = path
    if span is not None:
        with open(path, "rb") as file:
            file.seek(span[0])
            source = io.BytesIO(file.read(span[1]))
    try:
        with zipfile.ZipFile(source) as archive:
            for info in archive.infolist():
                _check_entry(path, archive, info)
    except zipfile.BadZipFile as error:
        raise InputError(f"{path}: truncated or corrupt zip archive: {error}") from None
    except (OSError, EOFError, ValueError, OverflowError, NotImplementedError) as error:
        # OverflowError: an offset past any file, seeked in a chunk's in-memory copy.
        raise InputError(f"{path}: cannot read zip archive: {error}") from None


def _check_entry(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    crc = 0
    try:
        with archive.open(info) as entry:
            while chunk := entry.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
    except zipfile.BadZipFile as error:
        # zipfile checks the CRC itself at the end of the entry and says so.
        if "CRC" in str(error):
            raise _mismatch(path, info.filename) from None
        raise
    if crc != info.CRC:
        raise _mismatch(path, info.filename)


def _mismatch(path: Path, entry: str) -> IntegrityError:
    return IntegrityError(f"{path}: checksum mismatch in entry '{entry}': the data is damaged")


def verify_safetensors(path: Path) -> None:
    """Check that the header's tensors cover the byte buffer exactly, in order."""
    header = read_header(path)
    position = 0
    for entry in header.entries:
        if entry.begin < position:
            raise IntegrityError(f"{path}: tensor '{entry.name}' overlaps the one before it")
        if entry.begin > position:
            raise IntegrityError(
                f"{path}: unexplained bytes {position}..{entry.begin} before tensor '{entry.name}'"
            )
        position = entry.end
    if position != header.buffer_size:
        raise IntegrityError(
            f"{path}: {header.buffer_size - position} bytes after the last tensor "
            "are not described by the header"
        )
