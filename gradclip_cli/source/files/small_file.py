"""Reading a small file whole (an index, a Trainer state, a tag, DCP's ``.metadata``), bounded.

Every small file a layout opens (``latest``, ``trainer_state.json``,
``config.json``, an index, ``.metadata``) and every norm log ``trend`` reads
goes through ``read_small_file``, under one rule:

* it is a regular file: a FIFO would block ``open`` until a writer came, a
  device (``/dev/zero``) gives endless bytes, a folder has none. ``stat``
  decides before anything is opened, and the file is opened with
  ``O_NONBLOCK`` and checked again (``fstat``), so a path swapped for a FIFO
  in between cannot block either;
* when it belongs to a checkpoint (``folder``), its real path (symlinks
  followed) lies inside the checkpoint's real folder;
* it is at most ``limit`` bytes, counted while reading, not taken from
  ``stat``: ``/proc`` files report a size of 0 whatever they hold;
* a message about it names the file and never quotes what a refused file
  holds; one about an accepted file quotes at most ``excerpt``'s short,
  escaped cut.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.special import special_kind

EXCERPT_CHARS = 80  # what a message may quote of a file's content (a long shard name fits)


def quoted(value: object) -> str:
    """``value`` for an error message: text quoted plainly ('...'), raw; anything else as
    repr() writes it. The message is escaped once, whole, where it is shown."""
    return f"'{value}'" if isinstance(value, str) else repr(value)


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """A short cut of ``value`` (content from a file) for a message, raw (the message is
    escaped once, whole, where it is shown): text quoted,
    a number or constant as written, a container by its kind alone (it may be nested
    too deeply to write out)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if isinstance(value, str):
        return quoted(value[:limit]) + ("..." if len(value) > limit else "")
    if value is None or isinstance(value, (bool, int, float)):
        text = repr(value)
        return text[:limit] + ("..." if len(text) > limit else "")
    kinds = {dict: "an object", list: "a list", tuple: "a tuple"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def check_inside(path: Path, folder: Path, *, what: str) -> None:
    """``InputError`` unless ``path``'s real path lies inside ``folder``'s real path."""
    real_folder = Path(os.path.realpath(folder))
    real = Path(os.path.realpath(path))
    if real != real_folder and real_folder not in real.parents:
        raise InputError(f"{path}: {what} leads outside the checkpoint's "
                         f"folder (to {real}); refusing to read it")


def read_small_file(path: Path, *, limit: int, what: str, folder: Path | None = None) -> bytes:
    """The bytes of ``path``, under the module's rule; ``InputError`` naming it otherwise.

    ``what`` names the file's kind in messages ("DCP metadata"). ``folder``:
    the checkpoint's folder, which the file's real path must stay inside.
    """
    path = Path(path)
    if folder is not None:
        check_inside(path, folder, what=what)
    data = _read(path, limit + 1, what, size_limit=limit)
    if len(data) > limit:
        raise InputError(f"{path}: more than {limit} bytes is too large "
                         f"for {what}")
    return data


def read_head(path: Path, limit: int, *, what: str = "a file") -> bytes:
    """The first ``limit`` bytes of ``path`` (for recognising a kind by content), under
    the same rule of file kinds: ``InputError`` for a FIFO, a device, a folder."""
    return _read(Path(path), limit, what)


def _read(path: Path, count: int, what: str, size_limit: int | None = None) -> bytes:
    with open_regular(path, what) as file:
        size = os.fstat(file.fileno()).st_size
        if size_limit is not None and size > size_limit:
            raise InputError(f"{path}: {size} bytes is too large for {what}")
        try:
            return file.read(count)
        except OSError as error:
            raise InputError(f"{path}: cannot read ({what}): "
                             f"{error.strerror or error}") from None


@contextlib.contextmanager
def open_regular(path: Path, what: str) -> Iterator[BinaryIO]:
    """``path`` open for reading, once ``stat`` and ``fstat`` both say it is a regular file.

    ``stat`` decides before anything is opened (a device is never opened); the
    file is then opened with ``O_NONBLOCK`` so that a path swapped for a FIFO in
    between returns at once instead of waiting for a writer, and ``fstat`` on the
    descriptor must agree. ``InputError`` naming ``path`` (and ``what``) otherwise.
    """
    shown = str(path)
    try:
        info = os.stat(path)
        _check_regular(shown, info, what)
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        if os.path.islink(path):
            raise InputError(f"{shown}: a symbolic link to a missing file ({what})") from None
        raise InputError(f"{shown}: no such file ({what})") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise InputError(f"{shown}: a loop of symbolic links ({what})") from None
        raise InputError(f"{shown}: cannot read ({what}): {error.strerror or error}") from None
    with os.fdopen(descriptor, "rb") as file:
        opened = os.fstat(descriptor)
        _check_regular(shown, opened, what)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise InputError(f"{shown}: changed while being opened ({what}); "
                             "refusing to read it")
        yield file


def _check_regular(shown: str, info: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{shown}: is {special_kind(info.st_mode)}, not a regular file "
                         f"({what}); refusing to read it")
