"""A Hugging Face Trainer's ``trainer_state.json``: the norms it logs each step.

``log_history`` is a list of dicts; the training entries carry ``step`` and
(transformers >= 4.38) ``grad_norm``, the total 2-norm that
``clip_grad_norm_`` returned before clipping. Python's json writes a NaN norm
as ``NaN``, which ``json.loads`` reads back. Entries without a norm
(evaluation, the final summary) are not points.

Where gradclip's Trainer callback ran, its training entries also carry the
monitor's norms under the tracker tags (``gradclip/total_norm``,
``gradclip/norm/<group>``; ``gradclip/norm_type`` where p is not 2): then
those entries are the series, per group, the monitor's float64 numbers as
logged, and the Trainer's own ``grad_norm`` is left to the norm audit
(``framework_totals``), never mixed into the series.
"""

from __future__ import annotations

from pathlib import Path

from gradclip_cli import tracker_tags
from gradclip_cli.errors import InputError
from gradclip_cli.source.files.json_text import parse_json
from gradclip_cli.source.logs import LoggedNorms, LogKind, read_text
from gradclip_cli.source.untrusted import is_number
from gradclip_cli.source.vocabulary import step_value

# accelerate's clip_grad_norm_, which the Trainer calls, uses norm_type=2.
TRAINER_NORM_TYPE = 2.0


def recognises(head: str) -> bool:
    return '"log_history"' in head


# The key a Trainer logs its own total under, and the tag of p in gradclip's entries.
GRAD_NORM = "grad_norm"
NORM_TYPE_TAG = tracker_tags.NORM_TYPE


def _history(path: Path) -> tuple[str, list]:
    shown = str(path)
    state = parse_json(read_text(path, "a Trainer state"), where=shown, what="a Trainer state")
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise InputError(f"{shown}: \"log_history\" must be a list of log entries")
    return shown, history


def _number(entry: dict, key: str, where: str) -> float:
    norm = entry[key]
    if not is_number(norm):
        raise InputError(f"{where}: {key} must be a number")
    if norm < 0:
        raise InputError(f"{where}: {key} must be >= 0, got {norm:g}")
    return float(norm)


def _points(shown: str, history: list, key: str) -> list[tuple[int, dict, int | None]]:
    """``(index, entry, step)`` of the entries holding ``key``, checked in step order."""
    points: list[tuple[int, dict, int | None]] = []
    for i, entry in enumerate(history):
        if not isinstance(entry, dict) or key not in entry:
            continue
        step = entry.get("step")
        if step is not None:
            step = step_value(step)
            if step is None:
                raise InputError(f"{shown}: log_history[{i}]: step must be a whole number >= 0")
        last = next((s for _, _, s in reversed(points) if s is not None), None)
        if step is not None and last is not None and step <= last:
            # The Trainer logs in step order, and a resumed run starts from its
            # checkpoint's own log_history: a step again is no Trainer's log.
            raise InputError(f"{shown}: log_history[{i}]: {key} of step {step} after "
                             f"one of step {last}; a Trainer logs each step once, in order")
        points.append((i, entry, step))
    return points


def read(path: Path) -> list[LoggedNorms]:
    shown, history = _history(path)
    gradclip = _points(shown, history, tracker_tags.TOTAL_NORM)
    if gradclip:
        return [_gradclip_entry(entry, step, f"{shown}: log_history[{i}]")
                for i, entry, step in gradclip]
    entries = [LoggedNorms(step=step, total_norm=_number(entry, GRAD_NORM,
                                                         f"{shown}: log_history[{i}]"),
                           norm_type=TRAINER_NORM_TYPE)
               for i, entry, step in _points(shown, history, GRAD_NORM)]
    if not entries:
        raise InputError(f"{shown}: no log_history entry has a grad_norm "
                         "(transformers >= 4.38 logs it every logging_steps)")
    return entries


def _gradclip_entry(entry: dict, step: int | None, where: str) -> LoggedNorms:
    norm_type = _number(entry, NORM_TYPE_TAG, where) if NORM_TYPE_TAG in entry \
        else TRAINER_NORM_TYPE
    if not norm_type > 0:
        raise InputError(f"{where}: {NORM_TYPE_TAG} must be > 0")
    groups = {}
    for key in entry:
        group = tracker_tags.group_of(key) if isinstance(key, str) else None
        if group is not None:
            groups[group] = _number(entry, key, where)
    return LoggedNorms(step=step, total_norm=_number(entry, tracker_tags.TOTAL_NORM, where),
                       norm_type=norm_type, groups=groups)


def framework_totals(path: Path) -> dict[int, float]:
    """The Trainer's own ``grad_norm`` by step (empty when it logged none): what the
    norm audit holds against gradclip's numbers."""
    shown, history = _history(path)
    return {step: _number(entry, GRAD_NORM, f"{shown}: log_history[{i}]")
            for i, entry, step in _points(shown, history, GRAD_NORM) if step is not None}


def gradclip_totals(path: Path) -> dict[int, float]:
    """gradclip's ``gradclip/total_norm`` by step (empty when its callback logged none)."""
    shown, history = _history(path)
    return {step: _number(entry, tracker_tags.TOTAL_NORM, f"{shown}: log_history[{i}]")
            for i, entry, step in _points(shown, history, tracker_tags.TOTAL_NORM)
            if step is not None}


KIND = LogKind("trainer-state", recognises, read)
