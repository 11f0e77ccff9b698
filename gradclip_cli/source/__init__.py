"""Where checkpoints come from: one module per file kind, chosen by the file's first bytes.

Adding a kind is one new module and one line in ``READERS``.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradclip_cli.errors import InputError
from gradclip_cli.source import locate
from gradclip_cli.source.files import safetensors_file, torch_file, verify
from gradclip_cli.source.files.special import special_kind
from gradclip_cli.source.interface import Checkpoint, GradientSelection

__all__ = [
    "Checkpoint", "GradientSelection", "READERS", "check_input", "load_checkpoint",
    "packed_dtype", "select_gradients",
]

_HEAD_BYTES = 64  # enough for every magic number below


@dataclass(frozen=True)
class Reader:
    """One checkpoint kind: how to recognise it, load it, and (optionally) verify it."""

    format: str  # the value of Checkpoint.format
    recognises: Callable[[bytes], bool]  # given the file's first bytes
    load: Callable[..., Checkpoint]  # load(path, *, trust_pickle) -> Checkpoint
    verify: Callable[[Path], None] | None = None  # raises IntegrityError; None: no checksums
    # What ``--verify`` cannot check in this kind, for the report; None: every checksum.
    unchecked: str | None = None


READERS: tuple[Reader, ...] = (
    Reader("torch-zip", torch_file.is_torch_zip, torch_file.load_torch_zip,
           verify.verify_torch_zip),
    Reader("safetensors", safetensors_file.is_safetensors, safetensors_file.load_safetensors,
           verify.verify_safetensors,
           "safetensors stores no checksums: only the header's layout was checked"),
    Reader("torch-legacy", torch_file.is_pickle, torch_file.load_torch_legacy, None,
           "a legacy torch file (not a zip) stores no checksums: nothing was checked"),
)  # fmt: skip

# Files read under ``--verify`` whose kind stores no checksums, while ``unverified`` runs.
_UNVERIFIED: contextvars.ContextVar[dict[Path, str] | None] = \
    contextvars.ContextVar("gradclip_unverified", default=None)


@contextlib.contextmanager
def unverified() -> Iterator[dict[Path, str]]:
    """Collect, for the report, each file ``load_checkpoint`` read under ``verify`` that
    stores no checksums: path -> what ``--verify`` could not check (``Reader.unchecked``)."""
    found: dict[Path, str] = {}
    token = _UNVERIFIED.set(found)
    try:
        yield found
    finally:
        _UNVERIFIED.reset(token)


def select_gradients(
    root: Any, key: str | None, *, path: Path | str | None = None
) -> GradientSelection:
    """``locate.select_gradients``, refusing tensors that hold no measurable values.

    A nested tensor has no single shape or storage to measure, and a meta
    tensor has no data at all (a model saved from the meta device): neither
    can be measured nor clipped, so either is an ``InputError`` naming the
    file and the tensor, not a failure deep in the arithmetic.
    """
    selection = locate.select_gradients(root, key, path=path)
    where = f"{path}: " if path is not None else ""
    for name, tensor in selection.tensors.items():
        if tensor.is_nested:
            raise InputError(f"{where}gradient '{name}' is a nested tensor; gradclip measures "
                             "dense tensors only")
        if tensor.device.type == "meta":
            raise InputError(f"{where}gradient '{name}' is a meta tensor: it has no data "
                             "(saved from a model on the meta device)")
        if (packed := packed_dtype(tensor.dtype)) is not None:
            raise InputError(f"{where}gradient '{name}' is {packed}")
    return selection


# Storage-only dtypes: torch reads them but no kernel (not even a copy) takes them.
_PACKED = {"torch.float4_e2m1fn_x2"}


def packed_dtype(dtype: object) -> str | None:
    """What a storage-only ``dtype`` (a torch dtype) is, for a refusal's message; None for
    any other."""
    if str(dtype) not in _PACKED:
        return None
    return (f"{str(dtype).removeprefix('torch.')} (two 4-bit floats packed per byte), which "
            "torch cannot compute with")


def load_checkpoint(
    path: Path | str, *, trust_pickle: bool = False, verify: bool = False
) -> Checkpoint:
    """Load the checkpoint at ``path``, recognising its kind by content, not by suffix.

    Args:
        path: the file to read.
        trust_pickle: allow full unpickling (runs code from the file); the
            default refuses such files with ``UnsafeCheckpointError``.
        verify: check the file's stored checksums (or layout) before loading;
            a mismatch raises ``IntegrityError``.

    Every failure is an ``InputError`` with one line naming the file.
    """
    path = Path(path)
    reader = _reader_for(path, _read_head(path))
    if verify and reader.verify is not None:
        reader.verify(path)
    if verify and reader.unchecked is not None and (found := _UNVERIFIED.get()) is not None:
        found[path] = reader.unchecked
    return reader.load(path, trust_pickle=trust_pickle)


def check_input(path: Path | str) -> os.stat_result:
    """The gate every input passes before anything opens it: a regular file or a folder.

    Returns the ``stat`` of what ``path`` names (symlinks followed). Anything
    else is an ``InputError`` with one line: a missing file, a dangling
    symlink or a symlink loop, and every special file. A FIFO (``/dev/stdin``
    from a pipe included) would block ``open`` until a writer came and then
    give a stream that cannot be mapped or re-read; a device gives endless or
    empty bytes. None is a checkpoint, so none is opened: ``stat`` alone
    decides. Whether a folder is a checkpoint is for the layouts to say.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise InputError(f"{path}: a symbolic link to a missing file (dangling)") from None
        raise InputError(f"{path}: no such file") from None
    except PermissionError:
        raise InputError(f"{path}: permission denied") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise InputError(f"{path}: a loop of symbolic links") from None
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
    if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
        return info
    kind = special_kind(info.st_mode)
    raise InputError(f"{path}: is {kind}, not a checkpoint file; refusing to read it")


def _read_head(path: Path) -> bytes:
    info = check_input(path)
    if stat.S_ISDIR(info.st_mode):
        # The one place a folder is turned away; a checkpoint-folder layout claims
        # its folders before this point.
        raise InputError(f"{path}: is a directory, not a checkpoint file")
    try:
        # O_NONBLOCK: should the path be swapped for a FIFO after the check,
        # open returns at once instead of waiting for a writer; fstat catches it.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except PermissionError:
        raise InputError(f"{path}: permission denied") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
    with os.fdopen(descriptor, "rb") as file:
        opened = os.fstat(descriptor)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise InputError(f"{path}: changed while being opened; refusing to read it")
        try:
            head = file.read(_HEAD_BYTES)
        except OSError as error:
            raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
    if not head:
        raise InputError(f"{path}: empty file, not a checkpoint")
    return head


def _reader_for(path: Path, head: bytes) -> Reader:
    for reader in READERS:
        if reader.recognises(head):
            return reader
    kind = "a text file" if _looks_like_text(head) else "an unrecognised format"
    raise InputError(
        f"{path}: not a checkpoint: {kind} (expected a torch.save file or a .safetensors file)"
    )


def _looks_like_text(head: bytes) -> bool:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        # A multi-byte character may be cut at the end of the head.
        text = head[:-3].decode("utf-8", errors="replace")
        if "\ufffd" in text:
            return False
    return all(ch.isprintable() or ch in "\t\r\n\f" for ch in text)
