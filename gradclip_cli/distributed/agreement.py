"""Before any work, the ranks of a launch agree that they run one command on the same files.

Every rank of a ``torchrun`` launch combines its share of the sums with the
others' as if all had read one checkpoint. Ranks given different command
lines, or the same path naming different files (a node-local disk, a copy
still being written), would add up pieces of different checkpoints into a
number that belongs to none of them, and ``clip`` would write it. So the
first exchange of every command gathers each rank's command line and the
identity of every input; if any rank differs from rank 0, every rank stops
with the same message (exit 3) and nothing is read or written.

An input's identity is cheap by design: for each regular file its size,
modification time and a hash of its first and last ``EDGE_BYTES`` (a
safetensors header sits at the start, a torch zip's central directory and a
DCP ``.metadata`` pickle's index at the end; small files such as an index,
``latest`` or ``.metadata`` are hashed whole). A folder's identity is that of
every file under it (symbolic links to folders are not followed). No data
file is read whole, and nothing other than a regular file is opened for
reading (a FIFO would block, ``/dev/zero`` never end): its kind alone is
its identity.
"""

from __future__ import annotations

import hashlib
import os
import stat

from ..errors import InputError

EDGE_BYTES = 64 * 1024


def _file_digest(path: str, size: int) -> str:
    """A hash of a regular file's first and last ``EDGE_BYTES`` (all of it when smaller)."""
    digest = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        return f"unreadable: {error.errno}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"  # replaced between the stat and the open
        digest.update(os.pread(fd, EDGE_BYTES, 0))
        if size > EDGE_BYTES:
            digest.update(os.pread(fd, EDGE_BYTES, max(EDGE_BYTES, size - EDGE_BYTES)))
    except OSError as error:
        return f"unreadable: {error.errno}"
    finally:
        os.close(fd)
    return digest.hexdigest()


def _entry(path: str) -> tuple:
    """(kind, size, modification time, header hash) of one path, following links."""
    try:
        st = os.stat(path)
    except OSError as error:
        return ("missing", error.errno)
    if stat.S_ISREG(st.st_mode):
        return ("file", st.st_size, st.st_mtime_ns, _file_digest(path, st.st_size))
    if stat.S_ISDIR(st.st_mode):
        return ("folder",)
    return ("special", stat.S_IFMT(st.st_mode))


def input_identity(path: str) -> str:
    """One hash naming what ``path`` is now: a file's, or every file's under a folder."""
    digest = hashlib.sha256()
    top = _entry(path)
    digest.update(repr(top).encode())
    if top[0] == "folder":
        for root, folders, files in os.walk(path, followlinks=False):
            folders.sort()
            for name in sorted(
                files + [f for f in folders if os.path.islink(os.path.join(root, f))]
            ):
                full = os.path.join(root, name)
                relative = os.path.relpath(full, path)
                digest.update(repr((relative, _entry(full))).encode())
    return digest.hexdigest()


def _ranks(ranks: list[int]) -> str:
    """``rank 1 differs`` or ``ranks 1, 3 differ``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} differs"
    return f"ranks {', '.join(map(str, ranks))} differ"


def check_agreement(session, command_line: list[str], inputs: list[str]) -> None:
    """Raise ``InputError`` on every rank alike unless all ranks run the same command on
    the same files (``session.exchange`` is the one collective)."""
    mine = (list(command_line), [input_identity(str(p)) for p in inputs])
    everyone = session.exchange(mine)
    reference_line, reference_inputs = everyone[0]
    other_line = [r for r, (line, _) in enumerate(everyone) if line != reference_line]
    if other_line:
        raise InputError(
            f"the ranks were not given the same command line: "
            f"{_ranks(other_line)} from rank 0; every rank must run the "
            "same command on the same files (nothing was read or written)"
        )
    other_inputs = [r for r, (_, ids) in enumerate(everyone) if ids != reference_inputs]
    if other_inputs:
        differing = [
            str(p)
            for i, p in enumerate(inputs)
            if any(everyone[r][1][i] != reference_inputs[i] for r in other_inputs)
        ]
        raise InputError(
            f"the ranks do not see the same input files: {_ranks(other_inputs)} "
            f"from rank 0 in {', '.join(differing)} (size, modification "
            "time or header); every rank must read the same files (nothing was "
            "read or written)"
        )
