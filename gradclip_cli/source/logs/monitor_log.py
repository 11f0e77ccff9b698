"""The JSON Lines log of gradclip's training-loop monitor (``gradclip.monitor/1``).

One object per line: ``{"schema": "gradclip.monitor/1", "step": int,
"total_norm": number | "nan" | "inf" | "-inf", "norm_type": number,
"groups": {name: norm}, "nonfinite": {"nan", "posinf", "neginf"},
"clip_coef": number | null, "clipped_to": number | null, ...}`` (the last two
where the monitor scaled the gradients after logging them), and
``"nonfinite_origin": {"forward": name | null, "backward": name | null}`` where
the monitor located a non-finite value. Other keys are ignored. A last line
without its newline is a write the training process had not finished (it may
still be running, or it died mid-write): it is skipped with a warning, never
guessed at.

The monitor appends, so a run resumed from an earlier checkpoint (the
Trainer's ``resume_from_checkpoint``, Lightning's ``ckpt_path``) logs its
steps again after the lines of the run it replaces. A step at or below one
logged before it starts the run over from there: the earlier lines from that
step on are superseded, with a warning, as TensorBoard purges the events of
a restarted run ("orphaned" steps). Sorted by step instead, the two runs'
steps would interleave, and the crashed run's last line would stay the
newest point after the resumed run had moved on.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.json_text import parse_json
from gradclip_cli.source.files.small_file import excerpt
from gradclip_cli.source.logs import LoggedNorms, LogKind, read_text
from gradclip_cli.source.untrusted import is_count, is_number
from gradclip_cli.source.vocabulary import step_value

SCHEMA = "gradclip.monitor/1"
_NONFINITE_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def recognises(head: str) -> bool:
    first = head.split("\n", 1)[0]
    try:
        obj = parse_json(first, where="")
    except InputError:
        return False
    return isinstance(obj, dict) and obj.get("schema") == SCHEMA


def _norm(value: object, where: str) -> float:
    if isinstance(value, str) and value in _NONFINITE_WORDS:
        return _NONFINITE_WORDS[value]
    if is_number(value):
        if value < 0:  # no norm is negative: judged, it would pass as a calm step
            raise InputError(f"{where}: a norm must be >= 0, got {excerpt(value)}")
        return float(value)
    raise InputError(f"{where}: a norm must be a number or \"nan\"/\"inf\"/\"-inf\", "
                     f"got {excerpt(value)}")


def _count(value: object, where: str) -> int:
    if is_count(value):
        return value
    raise InputError(f"{where}: a non-finite count must be a whole number >= 0")


def _entry(obj: object, where: str) -> LoggedNorms:
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise InputError(f"{where}: not a {SCHEMA} object")
    step = step_value(obj.get("step"))
    if step is None:
        raise InputError(f"{where}: \"step\" must be a whole number >= 0")
    groups = obj.get("groups", {})
    if not isinstance(groups, dict):
        raise InputError(f"{where}: \"groups\" must be an object of name: norm")
    nonfinite = obj.get("nonfinite")
    counts = None
    if nonfinite is not None:
        if not isinstance(nonfinite, dict):
            raise InputError(f"{where}: \"nonfinite\" must be an object")
        counts = tuple(_count(nonfinite.get(k, 0), where) for k in ("nan", "posinf", "neginf"))
    origin = _origin(obj.get("nonfinite_origin"), where)
    norm_type = _norm(obj.get("norm_type", 2.0), where)
    if not norm_type > 0:
        raise InputError(f"{where}: \"norm_type\" must be > 0")
    clip_coef, clipped_to = obj.get("clip_coef"), obj.get("clipped_to")
    return LoggedNorms(
        step=step, total_norm=_norm(obj.get("total_norm"), where), norm_type=norm_type,
        groups={str(k): _norm(v, where) for k, v in groups.items()}, nonfinite=counts,
        clip_coef=None if clip_coef is None else _norm(clip_coef, where),
        clipped_to=None if clipped_to is None else _norm(clipped_to, where),
        nonfinite_origin=origin,
    )  # fmt: skip


def _origin(value: object, where: str) -> tuple[str | None, str | None] | None:
    """``nonfinite_origin`` as (forward module, backward parameter); None where absent or null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InputError(f"{where}: \"nonfinite_origin\" must be an object or null")
    names = tuple(value.get(k) for k in ("forward", "backward"))
    if not all(n is None or isinstance(n, str) for n in names):
        raise InputError(f"{where}: \"nonfinite_origin\" names must be strings or null")
    return None if names == (None, None) else names


def read(path: Path) -> list[LoggedNorms]:
    text = read_text(path, f"a {SCHEMA} log")
    lines = text.split("\n")
    unfinished = lines.pop()  # "" when the file ends with a newline
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        obj = parse_json(line, where=where, what="a JSON object", line=True)
        entry = _entry(obj, where)
        if entries and entry.step <= entries[-1].step:
            _resumed(entries, entry.step, where)
        entries.append(entry)
    shown = str(path)
    if not entries:  # one line: the error says what the warning would have
        unended = " (its last line has no newline: a write in progress?)" \
            if unfinished.strip() else ""
        raise InputError(f"{shown}: a {SCHEMA} log with no complete entries{unended}")
    if unfinished.strip():
        print(f"gradclip: warning: {visible(shown)}:{len(lines) + 1}: last line has no newline "
              "(a write in progress?); skipped", file=sys.stderr)
    return entries


def _resumed(entries: list[LoggedNorms], step: int, where: str) -> None:
    """Drop the entries a run resumed at ``step`` replaces (those from ``step`` on)."""
    last = entries[-1].step
    kept = [e for e in entries if e.step < step]
    superseded = len(entries) - len(kept)
    entries[:] = kept
    print(f"gradclip: warning: {visible(where)}: step {step} follows step {last}: a run resumed "
          f"from an earlier step; the {superseded} earlier line(s) for steps {step}-{last} "
          "are superseded", file=sys.stderr)


KIND = LogKind("gradclip-monitor", recognises, read)
