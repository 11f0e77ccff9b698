"""Which kind of norm log a file is, from its first bytes (``trend`` asks of every input)."""

from __future__ import annotations

from pathlib import Path

from gradclip_cli.source.logs import LogKind, monitor_log, trainer_state

# Enough for a monitor log's first line or the keys a trainer_state.json puts
# before its log_history.
_HEAD_BYTES = 1 << 16


def log_kind(path: Path) -> LogKind | None:
    """The kind of norm log ``path`` is, or None when it is not one (a checkpoint, say)."""
    try:
        with open(path, "rb") as file:
            head = file.read(_HEAD_BYTES)
    except OSError:
        return None  # the checkpoint loader reports unreadable files
    if not head.lstrip().startswith(b"{"):
        return None
    text = head.decode("utf-8", errors="replace").lstrip()
    for kind in (monitor_log.KIND, trainer_state.KIND):
        if kind.recognises(text):
            return kind
    return None
