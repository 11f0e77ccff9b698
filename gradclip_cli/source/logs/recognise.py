"""Which kind of norm log a file is, from its first bytes (``trend`` asks of every input)."""

from __future__ import annotations

from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import read_head
from gradclip_cli.source.logs import LogKind, monitor_log, trainer_state

# Enough for a monitor log's first line or the keys a trainer_state.json puts
# before its log_history.
_HEAD_BYTES = 1 << 16


def log_kind(path: Path) -> LogKind | None:
    """The kind of norm log ``path`` is, or None when it is not one (a checkpoint, say)."""
    try:
        head = read_head(path, _HEAD_BYTES, what="a norm log")
    except InputError:
        return None  # the checkpoint loader reports unreadable and special files
    if not head.lstrip().startswith(b"{"):
        return None
    text = head.decode("utf-8", errors="replace").lstrip()
    for kind in (monitor_log.KIND, trainer_state.KIND):
        if kind.recognises(text):
            return kind
    return None
