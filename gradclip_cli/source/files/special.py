"""What ``stat`` calls a path that is neither a regular file nor a folder.

Inputs and outputs are refused alike when they are one of these (see
``source.check_input`` and ``sink.atomic.check_target``); the name goes in
the one-line message.
"""

from __future__ import annotations

import stat

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def special_kind(mode: int) -> str | None:
    """``"a character device"`` and so on for ``st_mode``; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")
