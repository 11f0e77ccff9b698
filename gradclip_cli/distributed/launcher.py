"""A CLI run under a launcher: the process group, and one exchange per step.

``torchrun`` (and ``srun``, ``mpirun`` wrappers, any launcher) starts one
process per rank with ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set. Each
runs the same command; ``join`` makes them one process group (``gloo`` on the
CPU, ``nccl`` with ``--device cuda``, each rank on its ``LOCAL_RANK`` GPU).

Every collective goes through ``Session.exchange``, which gathers one
*envelope* per rank: ``("ok", payload)`` from a rank that got this far, or
``("done", code, message, failed)`` from one that finished, normally or
with an error. An error on one rank thus reaches every rank in the very
collective the others are waiting in, and all of them stop there: no rank
waits for a partner that has given up, and every rank exits with the code
of the first failure (or rank 0's code when none failed). Each collective
also has a timeout (``GRADCLIP_DIST_TIMEOUT`` seconds, default 1800), for a
rank that died without a word.

This module does not import torch at module level: ``launched()`` is asked
before every command.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import GradclipError

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE")
TIMEOUT_VARIABLE = "GRADCLIP_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800.0


def launched() -> bool:
    """True when a launcher started this process as one rank of several (or of one)."""
    return all(name in os.environ for name in LAUNCHER_VARIABLES)


def launcher_rank() -> int:
    """This process's rank as the launcher set it (0 without a launcher)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankFailure(GradclipError):
    """A failure every rank has seen (in one exchange): report it, exit with its code."""

    def __init__(self, message: str, exit_code: int, quiet: bool = False):
        super().__init__(message)
        self.exit_code = exit_code
        self.quiet = quiet


@dataclass
class Session:
    """This rank's place in the process group of one command."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device this rank computes on
    timeout_s: float
    owns_group: bool
    closed: bool = False  # a failure was agreed: no further collectives

    @property
    def primary(self) -> bool:
        """Rank 0: the one that prints."""
        return self.rank == 0

    def exchange(self, payload: Any) -> list[Any]:
        """Every rank's ``payload``, in rank order; ``RankFailure`` if any rank failed."""
        envelopes = self._gather(("ok", payload))
        failure = _first_failure(envelopes)
        if failure is not None:
            self.closed = True
            raise RankFailure(*_describe(failure, envelopes))
        if any(e[0] != "ok" for e in envelopes):
            self.closed = True
            raise RankFailure("the ranks ran different steps (a bug in gradclip)", 3)
        return [e[1] for e in envelopes]

    def agree(self, code: int, message: str | None, failed: bool) -> tuple[int, str | None]:
        """The final exchange: the exit code and message every rank ends with."""
        if self.closed:
            return code, message
        try:
            envelopes = self._gather(("done", code, message, failed))
        except RankFailure as error:
            return error.exit_code, str(error)
        self.closed = True
        failure = _first_failure(envelopes)
        if failure is not None:
            text, exit_code, quiet = _describe(failure, envelopes)
            return exit_code, None if quiet else text
        if any(e[0] != "done" for e in envelopes):
            return 3, "the ranks ran different steps (a bug in gradclip)"
        return envelopes[0][1], None

    def _gather(self, envelope) -> list:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, envelope)
        except Exception as error:  # a peer died or the timeout passed
            self.closed = True
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise RankFailure(f"rank {self.rank}: lost the other ranks within "
                              f"{self.timeout_s:g} s ({first})", 3) from None
        return out


def _first_failure(envelopes: list) -> tuple[int, tuple] | None:
    for rank, envelope in enumerate(envelopes):
        if envelope[0] == "done" and envelope[3]:
            return rank, envelope
    return None


def _describe(failure, envelopes) -> tuple[str, int, bool]:
    """(message, exit code, quiet): the first failing rank's, named unless all say the same."""
    rank, (_, code, message, _) = failure
    quiet = message is None
    same_everywhere = all(e[0] == "done" and e[2] == message for e in envelopes)
    if not quiet and not same_everywhere:
        message = f"rank {rank}: {message}"
    return message or "", code, quiet


_current: Session | None = None
_command_line: list[str] | None = None


def set_command_line(args: list[str]) -> None:
    """The arguments this process's command was given, which every rank must share."""
    global _command_line
    _command_line = list(args)


def current() -> Session | None:
    """The session of the command now running, None without a launcher."""
    return _current


def join(device, device_text: str = "cpu", inputs=()) -> Session | None:
    """Join (or create) the process group when launched; None otherwise.

    Before anything is read, the ranks agree on the command line and on the
    identity of every path in ``inputs`` (``agreement.py``): if any rank
    differs, every rank raises the same ``InputError`` (exit 3).

    ``device`` is the parsed ``--device``; ``cuda`` without an index (or
    ``auto`` that found CUDA) becomes ``cuda:LOCAL_RANK``, and the backend is
    ``nccl`` there, ``gloo`` elsewhere. A process group that already exists
    (gradclip called from inside a training script) is used as it is.
    """
    global _current
    if not launched():
        return None
    import torch
    import torch.distributed as dist

    timeout_s = _timeout_s()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda" and ":" not in device_text:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise GradclipError("RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are "
                                "not: start gradclip with torchrun (or set all four)")
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        except Exception as error:
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise GradclipError(f"cannot join the process group ({backend}): {first}") from None
    _current = Session(dist.get_rank(), dist.get_world_size(), local_rank, device, timeout_s,
                       owns)
    from .agreement import check_agreement

    command_line = sys.argv[1:] if _command_line is None else _command_line
    check_agreement(_current, command_line, [str(p) for p in inputs])
    return _current


def leave() -> None:
    """Destroy the process group this command created, if any."""
    global _current
    session, _current = _current, None
    if session is None or not session.owns_group:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _timeout_s() -> float:
    text = os.environ.get(TIMEOUT_VARIABLE, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise GradclipError(f"{TIMEOUT_VARIABLE} must be a number of seconds > 0, got {text!r}")
    return value
