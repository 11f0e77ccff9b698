"""Logs of gradient norms written during training (not checkpoints): read for ``trend``.

Two kinds, each one module, recognised by content: a Hugging Face Trainer's
``trainer_state.json`` (``log_history`` entries with ``grad_norm``) and the
JSON Lines log of gradclip's own training-loop monitor (``gradclip.monitor/1``).
Each yields ``LoggedNorms``, one per logged step, numbers as written;
``recognise.log_kind`` tells which kind a file is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import read_small_file


@dataclass(frozen=True)
class LoggedNorms:
    """One logged step: the total norm, per-group norms when logged, and
    non-finite element counts ``(nan, posinf, neginf)`` when logged.
    ``nonfinite_origin``: where a non-finite value began, ``(forward module,
    backward parameter)`` (each may be None), when the monitor located it
    (``GradMonitor(locate_nonfinite=True)``); None otherwise."""

    step: int | None
    total_norm: float
    norm_type: float
    groups: dict[str, float] = field(default_factory=dict)
    nonfinite: tuple[int, int, int] | None = None
    # Where the writer scaled the gradients after logging them (gradclip's monitor:
    # ``clip_coef``, ``clipped_to``); None where it did not, or does not say.
    clip_coef: float | None = None
    clipped_to: float | None = None
    nonfinite_origin: tuple[str | None, str | None] | None = None


@dataclass(frozen=True)
class LogKind:
    name: str
    recognises: Callable[[str], bool]  # given the file's first bytes, decoded
    read: Callable[[Path], list[LoggedNorms]]


# A log is read whole; a million monitor steps are some 300 MB.
MAX_LOG_BYTES = 1 << 30


def read_text(path: Path, what: str) -> str:
    """A log's text, read by the one small-file reader (a regular file, bounded)."""
    data = read_small_file(path, limit=MAX_LOG_BYTES, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not UTF-8 text (byte {error.start})") from None

