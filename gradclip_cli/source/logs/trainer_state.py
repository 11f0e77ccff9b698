"""A Hugging Face Trainer's ``trainer_state.json``: the ``grad_norm`` it logs each step.

``log_history`` is a list of dicts; the training entries carry ``step`` and
(transformers >= 4.38) ``grad_norm``, the total 2-norm that
``clip_grad_norm_`` returned before clipping. Python's json writes a NaN norm
as ``NaN``, which ``json.loads`` reads back. Entries without ``grad_norm``
(evaluation, the final summary) are not points.
"""

from __future__ import annotations

from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.json_text import parse_json
from gradclip_cli.source.logs import LoggedNorms, LogKind, read_text

# accelerate's clip_grad_norm_, which the Trainer calls, uses norm_type=2.
TRAINER_NORM_TYPE = 2.0


def recognises(head: str) -> bool:
    return '"log_history"' in head


def read(path: Path) -> list[LoggedNorms]:
    shown = visible(str(path))
    state = parse_json(read_text(path, "a Trainer state"), where=shown, what="a Trainer state")
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise InputError(f"{shown}: \"log_history\" must be a list of log entries")
    entries = []
    for i, entry in enumerate(history):
        if not isinstance(entry, dict) or "grad_norm" not in entry:
            continue
        norm, step = entry["grad_norm"], entry.get("step")
        if not isinstance(norm, (int, float)) or isinstance(norm, bool):
            raise InputError(f"{shown}: log_history[{i}]: grad_norm must be a number")
        if norm < 0:
            raise InputError(f"{shown}: log_history[{i}]: grad_norm must be >= 0, got {norm:g}")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise InputError(f"{shown}: log_history[{i}]: step must be a whole number")
        last = next((e.step for e in reversed(entries) if e.step is not None), None)
        if step is not None and last is not None and step <= last:
            # The Trainer logs in step order, and a resumed run starts from its
            # checkpoint's own log_history: a step again is no Trainer's log.
            raise InputError(f"{shown}: log_history[{i}]: grad_norm of step {step} after "
                             f"one of step {last}; a Trainer logs each step once, in order")
        entries.append(LoggedNorms(step=step, total_norm=float(norm),
                                   norm_type=TRAINER_NORM_TYPE))
    if not entries:
        raise InputError(f"{shown}: no log_history entry has a grad_norm "
                         "(transformers >= 4.38 logs it every logging_steps)")
    return entries


KIND = LogKind("trainer-state", recognises, read)
