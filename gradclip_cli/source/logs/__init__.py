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


@dataclass(frozen=True)
class LoggedNorms:
    """One logged step: the total norm, per-group norms when logged, and
    non-finite element counts ``(nan, posinf, neginf)`` when logged."""

    step: int | None
    total_norm: float
    norm_type: float
    groups: dict[str, float] = field(default_factory=dict)
    nonfinite: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class LogKind:
    name: str
    recognises: Callable[[str], bool]  # given the file's first bytes, decoded
    read: Callable[[Path], list[LoggedNorms]]


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None

