"""Writing a file so that readers see the old one or the new one, never half of either.

The data goes to a fresh temporary file beside the target, is flushed and
fsync'd, and then ``os.replace`` swaps it in. The existing target is never
opened for writing: it may be memory-mapped by this very process (the loaded
input, under ``--in-place``), and truncating a mapped file kills the process
with SIGBUS on the next page fault. A new inode plus a rename leaves the old
mapping valid.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from gradclip_cli.errors import GradclipError, OutputError
from gradclip_cli.source.files.special import special_kind

# mkstemp's random part (8 characters) plus the dots and ".tmp" around it.
_TEMP_OVERHEAD = len(".") + len(".") + 8 + len(".tmp")
_NAME_MAX = 255  # bytes per name on Linux, macOS and Windows file systems

# Plain-language causes for the errors a user can act on; strerror covers the rest.
_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "the folder does not exist",
    errno.EISDIR: "the target is a directory",
    errno.ELOOP: "a loop of symbolic links",
    errno.ENAMETOOLONG: "the file name is too long",
}


def atomic_write(
    target: Path, write: Callable[[BinaryIO], None], *, mode_from: Path | None = None
) -> None:
    """Create or replace ``target`` with what ``write`` puts into the file object it is given.

    Args:
        target: the file to create or replace; its folder must exist.
        write: called once with a binary file open for writing.
        mode_from: copy this file's permission bits (the input, usually);
            without it an existing target keeps its mode and a new one gets
            the umask default.

    On any failure, an interrupt included, the temporary file is removed, the
    target is left as it was, and ``OutputError`` says why in one line.
    """
    stage(target, write, mode_from=mode_from).commit()


class Staged:
    """A file written in full beside its target, not yet in its place.

    ``commit`` renames it into place (the one step left, which needs no
    space); ``discard`` removes it, leaving the target as it was. A command
    that writes two things stages the one it can prepare first (its report),
    writes the other, and commits: it never writes one and then fails on the
    other's data.
    """

    def __init__(self, temp: Path, target: Path):
        self.temp, self.target = temp, target

    def commit(self) -> None:
        try:
            os.replace(self.temp, self.target)
        except BaseException as error:
            self.discard()
            if not isinstance(error, (Exception, KeyboardInterrupt)):
                raise
            raise _output_error(self.target, error) from error
        _fsync_folder(self.target.parent)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.temp.unlink()


def stage(
    target: Path, write: Callable[[BinaryIO], None], *, mode_from: Path | None = None
) -> Staged:
    """``atomic_write``'s first half: ``target``'s new content written, flushed and
    fsync'd to a temporary file beside it, which ``Staged.commit`` puts in place."""
    target = Path(target)
    folder = target.parent
    check_folder(target)
    check_target(target)
    mode = _mode_for(target, mode_from)
    try:
        descriptor, temp_name = tempfile.mkstemp(
            prefix=f".{_temp_stem(target.name, folder)}.", suffix=".tmp", dir=folder
        )
    except OSError as error:
        raise _output_error(target, error) from None
    temp = Path(temp_name)
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fchmod(file.fileno(), mode)
            os.fsync(file.fileno())
    except BaseException as error:
        with contextlib.suppress(OSError):
            temp.unlink()
        if not isinstance(error, (Exception, KeyboardInterrupt)):
            raise  # SystemExit and friends: cleaned up, but not ours to reword
        raise _output_error(target, error) from error
    return Staged(temp, target)


def links_kept(target: Path | str) -> int:
    """How many other hard links of the file at ``target`` keep its old bytes when an
    atomic replace gives ``target`` a new file (symlinks followed); 0 for no file."""
    replaced = check_target(target)
    return 0 if replaced is None else replaced.st_nlink - 1


def check_folder(target: Path | str) -> None:
    """Refuse an output path whose folder does not exist (an ``OutputError``): checked
    before any work, so that a command never writes one file and then fails on another."""
    folder = Path(target).parent
    if not folder.is_dir():
        raise OutputError(f"{target}: cannot write: the folder {folder} does not exist")


def check_target(target: Path | str) -> os.stat_result | None:
    """Refuse an output path that exists and is not a regular file.

    Returns the ``stat`` of the existing file (symlinks followed), or None when
    there is none yet. A folder, a FIFO or a device (``-o /dev/null``) would be
    replaced by a regular file: as root, the system's own ``/dev/null``. Such a
    target is an ``OutputError`` and is never touched.
    """
    try:
        info = os.stat(target)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise _output_error(Path(target), error) from None
    kind = special_kind(info.st_mode)
    if kind is not None:
        raise OutputError(
            f"{target}: cannot write: it is {kind}, not a regular file; nothing was changed"
        )
    return info


def _temp_stem(name: str, folder: Path) -> str:
    """``name``, cut so that the temporary name stays within the folder's name limit.

    The target keeps its full name (only the temporary one is shortened): a
    248-byte target is valid, but ``.{name}.XXXXXXXX.tmp`` would be 262 bytes.
    """
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = _NAME_MAX
    room = max(1, min(limit, _NAME_MAX) - _TEMP_OVERHEAD)
    # Cut bytes, not characters; surrogateescape keeps a cut character's bytes as they are.
    return os.fsdecode(os.fsencode(name)[:room])


def _mode_for(target: Path, mode_from: Path | None) -> int:
    for source in (mode_from, target):
        if source is not None:
            with contextlib.suppress(OSError):
                return stat.S_IMODE(os.stat(source).st_mode)
    return 0o666 & ~_current_umask()


def _current_umask() -> int:
    # The only portable way to read the umask is to set it and put it back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable. Some file systems refuse to fsync a folder;
    the replace has already happened, so that is not worth failing over."""
    with contextlib.suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _output_error(target: Path, error: BaseException) -> OutputError:
    if isinstance(error, KeyboardInterrupt):
        why = "interrupted"
    elif isinstance(error, GradclipError):
        why = str(error)
    elif isinstance(error, OSError):
        why = _CAUSES.get(error.errno, error.strerror or str(error))
    else:
        lines = str(error).strip().splitlines()
        why = lines[0] if lines else type(error).__name__
    return OutputError(f"{target}: cannot write: {why}; nothing was changed")
