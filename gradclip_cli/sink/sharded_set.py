"""Writing a set of files back as a folder (an index and its shards, DCP's Hugging Face
layout's safetensors files, a DCP folder), by one process or by every rank at once.

A reader must never see a mix of old and new shards, and there is no way to
replace several files at once. So the whole folder is written anew, beside
the target, under a hidden temporary name: every shard in its own format
(through ``WRITERS``), the index and every other file of the folder copied
byte for byte, its subfolders with them and its symbolic links as links (an
in-place clip replaces the folder: whatever the copy lacked would be lost).
A FIFO, socket or device in the folder cannot be copied, so the set is
refused before anything is written. Each file is fsync'd, then the folder is
switched in:

* a new output folder: one ``rename`` of the finished temporary folder;
* ``--in-place``: ``renameat2(RENAME_EXCHANGE)`` swaps the two folders in
  one step on Linux, then the old one (now under the temporary name) is
  removed. Where the exchange is unavailable (not Linux, or a file system
  without it), two renames: the old folder to ``.<name>.old-*`` and the new
  one to ``<name>``.

What a crash leaves (kill -9 at any moment): before the switch, the input
untouched and a ``.<name>.clipped-*.tmp`` folder beside it; after an
exchange, the clipped set in place and the old set in that temporary
folder; in the two-rename fallback, between the renames, no folder at
``<name>`` at all, the old set at ``.<name>.old-*`` and the new one at
``.<name>.clipped-*.tmp``, each whole. Never a folder holding some shards
of each.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from gradclip_cli.errors import OutputError
from gradclip_cli.escaping import visible
from gradclip_cli.sink import WRITERS
from gradclip_cli.sink.atomic import _fsync_folder, _output_error
from gradclip_cli.source.files.special import special_kind
from gradclip_cli.source.interface import Checkpoint

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def write_set(folder: Path, shards: Mapping[str, Checkpoint], target: Path, *,
              in_place: bool, patch: Callable[[str, Path], None] | None = None) -> None:
    """Write ``folder`` to ``target``, a folder, with ``shards`` (by ``set_member`` name,
    already clipped in place) in their own formats; replace it only when ``in_place``.

    ``patch(name, copy)``, when given, changes a copied file (``name``: its
    ``set_member`` name) before it is fsync'd (a DCP ``.distcp`` file's clipped
    chunks).
    """
    temp = begin_set(folder, target, in_place=in_place)
    try:
        fill_set(folder, shards, temp, patch=patch)
    except BaseException as error:
        discard_set(temp)
        if not isinstance(error, (Exception, KeyboardInterrupt)):
            raise
        raise _output_error(Path(target), error) from error
    switch_set(temp, target, in_place=in_place)


def write_set_by_ranks(ranks, folder: Path, shards: Mapping[str, Checkpoint], target: Path,
                       *, in_place: bool, owners: Mapping[str, int],
                       patch: Callable[[str, Path], None] | None = None) -> None:
    """``write_set`` from every rank at once, under a launcher: each file written by the
    rank ``owners`` gives it (by ``set_member`` name; rank 0 for the rest).

    ``ranks``: how they talk (``distributed.launcher.Session``: ``rank``,
    ``primary``, ``exchange``). The set is still switched in whole: rank 0
    makes the one temporary folder and tells the others its name; every rank
    writes its own files into it (an HF set's shards, or the ``.distcp``
    files of a DCP set's gradient chunks, copied with the chunks patched);
    rank 0 also copies the index or ``.metadata`` and the folder's other
    files; one exchange then tells every rank whether all the writes
    succeeded. Only then does rank 0 switch the folder in. A failed write on
    any rank is reported once, naming that rank, and the temporary folder is
    removed by rank 0 after every rank has stopped writing into it: the
    input is untouched, as in one process. A rank that dies leaves the
    others to time out in the exchange, and the input is untouched too.
    """
    temp = begin_set(folder, target, in_place=in_place) if ranks.primary else None
    temp = Path(ranks.exchange(None if temp is None else str(temp))[0])
    failure = None
    try:
        fill_set(folder, shards, temp, patch=patch,
                 mine=lambda name: owners.get(name, 0) == ranks.rank)
    except OutputError as error:
        failure = str(error)
    except OSError as error:
        failure = str(_output_error(Path(target), error))
    try:
        outcomes = ranks.exchange(failure)
    except BaseException:
        if ranks.primary:
            discard_set(temp)
        raise
    failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
    if failed:
        if ranks.primary:
            discard_set(temp)
        rank, text = failed[0]
        # Every rank raises the same line, so it is reported once, as it is.
        raise OutputError(f"rank {rank}: {text}")
    if ranks.primary:
        switch_set(temp, target, in_place=in_place)


def begin_set(source: Path, target: Path, *, in_place: bool) -> Path:
    """Check ``target`` and make the hidden temporary folder the new set is written into."""
    target = Path(target)
    parent = target.parent
    if not parent.is_dir():
        raise OutputError(f"{target}: cannot write: the folder {parent} does not exist")
    if not in_place and (target.exists() or target.is_symlink()):
        raise OutputError(f"{target}: cannot write: it exists; a set is written as a new "
                          "folder (or use --in-place)")
    try:
        temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.clipped-", suffix=".tmp",
                                     dir=parent))
        os.chmod(temp, stat.S_IMODE(os.stat(source).st_mode))
    except OSError as error:
        raise _output_error(target, error) from None
    return temp


def fill_set(source: Path, shards: Mapping[str, Checkpoint], temp: Path, *,
             mine: Callable[[str], bool] | None = None,
             patch: Callable[[str, Path], None] | None = None) -> None:
    """Write into ``temp`` everything ``source`` holds: ``shards`` in their own format,
    other files copied (and ``patch``-ed), each fsync'd; subfolders made, links copied
    as links.

    Files are named by ``set_member`` (their '/'-separated path in the folder).
    ``mine(name)``: whether this process writes the file ``name`` (all when
    None); under a launcher each rank writes its own (``write_set_by_ranks``),
    and every rank makes the subfolders.
    """
    members = _members(Path(source), shards)
    for name, entry in members:
        out = temp.joinpath(*name.split("/"))
        if entry.is_dir(follow_symlinks=False):
            out.mkdir(exist_ok=True)
            os.chmod(out, stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode))
        elif mine is not None and not mine(name):
            continue
        elif name in shards:
            # A shard is written from what was read, as a plain file, even where the
            # folder linked it (inside itself).
            _write_shard(shards[name], out)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry.path), out)
        else:
            _copy(Path(entry.path), out, name, patch)


def set_member(path: Path | str, folder: Path | str) -> str:
    """How a set's writers (and ranks) name a file of the set: its path in ``folder``,
    '/'-separated (``model-00001-of-00002.safetensors``, ``sub/__0_0.distcp``)."""
    return Path(os.path.relpath(path, folder)).as_posix()


def _members(source: Path, shards: dict) -> list[tuple[str, os.DirEntry]]:
    """Every entry under ``source`` (a folder before what it holds), by ``set_member``
    name; ``OutputError`` for one that cannot be copied (a FIFO, socket or device)."""
    members: list[tuple[str, os.DirEntry]] = []
    folders = [(source, "")]
    while folders:
        folder, prefix = folders.pop()
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            name = prefix + entry.name
            members.append((name, entry))
            if name in shards or entry.is_symlink():
                continue
            if entry.is_dir(follow_symlinks=False):
                folders.append((Path(entry.path), name + "/"))
            elif not entry.is_file(follow_symlinks=False):
                kind = special_kind(entry.stat(follow_symlinks=False).st_mode)
                raise OutputError(f"{entry.path} is {kind}, which cannot be "
                                  "copied into the new folder")
    return members


def switch_set(temp: Path, target: Path, *, in_place: bool) -> None:
    """Put the finished set in ``temp`` at ``target``: one rename, or an exchange in place."""
    target = Path(target)
    try:
        _fsync_folder(temp)
        if in_place:
            _switch(temp, target)
        else:
            os.rename(temp, target)
    except BaseException as error:
        discard_set(temp)
        if not isinstance(error, (Exception, KeyboardInterrupt)):
            raise
        raise _output_error(target, error) from error
    _fsync_folder(target.parent)


def discard_set(temp: Path) -> None:
    """Remove an unfinished set's temporary folder (best effort: the input is untouched)."""
    with contextlib.suppress(OSError):
        shutil.rmtree(temp)


def _write_shard(ckpt: Checkpoint, out: Path) -> None:
    writer = WRITERS.get(ckpt.format)
    if writer is None:
        raise OutputError(f"{out}: cannot write shards of format {ckpt.format!r}")
    with open(out, "xb") as file:
        writer(ckpt, file)
        file.flush()
        os.fchmod(file.fileno(), stat.S_IMODE(os.stat(ckpt.path).st_mode))
        os.fsync(file.fileno())


def _copy(source: Path, out: Path, name: str,
          patch: Callable[[str, Path], None] | None = None) -> None:
    with open(source, "rb") as read, open(out, "xb") as write:
        shutil.copyfileobj(read, write, 1 << 20)
        write.flush()
        if patch is not None:
            patch(name, out)
        os.fchmod(write.fileno(), stat.S_IMODE(os.fstat(read.fileno()).st_mode))
        os.fsync(write.fileno())


def _switch(new: Path, target: Path) -> None:
    """Put ``new`` at ``target`` (an existing folder) and remove the old one.

    Until the new set is at ``target`` a failure leaves the old one there (an
    error: nothing was changed); once it is, the clip is done, and an old set
    that cannot be removed is left beside it, said on stderr.
    """
    if _exchange(new, target):
        _remove_old(new, target)  # ``new`` now holds the old set
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    _remove_old(old, target)


def _remove_old(old: Path, target: Path) -> None:
    try:
        shutil.rmtree(old)
    except OSError as e:
        print(f"gradclip: warning: {visible(str(target))} holds the clipped set; the old one "
              f"could not be removed ({e.strerror or e}) and is left at {visible(str(old))}",
              file=sys.stderr)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code))
