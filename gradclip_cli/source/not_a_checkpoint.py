"""What a path that is not one checkpoint is instead, in the one line ``inspect`` says.

A run's folder (numbered checkpoint folders, per-step checkpoint files, a
norm log) or a log of norms over steps is what ``gradclip trend`` reads;
``inspect`` reads one checkpoint. Where its refusal meets one of them, it
says what the path is and where to go instead. Looking is bounded: at most
``_SCANNED`` children of a folder, and a file's first bytes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import InputError
from .vocabulary import NUMBERED_NAME, SHARD_NAME, last_number

_SCANNED = 1000  # children looked at for a hint; a refusal never waits on a huge folder


def _is_log(path: Path) -> bool:
    from .logs.recognise import log_kind

    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False
    return regular and log_kind(path) is not None


def run_folder_message(path: str) -> str | None:
    """Where ``path`` is a run's folder (numbered checkpoint folders: an HF
    ``output_dir``, DeepSpeed's ``global_stepN/``; per-step checkpoint files; a
    norm log), the one line inspect says instead of its refusal: what it is,
    ``gradclip trend PATH``, and the newest checkpoint in it to inspect. None
    for anything else (a layout that recognises it gives its own refusal)."""
    p = Path(path)
    if not p.is_dir():
        return None
    from .layouts import LAYOUTS, hf_sharded, near_miss

    if any(layout.recognises(p) for layout in LAYOUTS) or near_miss(p) is not None:
        return None  # a layout's own refusal says more (DeepSpeed's, DCP's: what is missing)
    try:
        children = sorted(c for _, c in zip(range(_SCANNED), p.iterdir()))
    except OSError:
        return None
    if any(c.name.endswith(hf_sharded.INDEX_SUFFIX) for c in children):
        return None  # a sharded set's folder: its shards number parts, not steps
    folders = [c for c in children if NUMBERED_NAME.fullmatch(c.name) and c.is_dir()]
    files = [c for c in children if _step_of_name(c.name) is not None and is_checkpoint_file(c)]
    shards = [c for c in files if SHARD_NAME.fullmatch(c.name)]
    if shards and not folders and len(shards) == len(files):
        # model-00001-of-00002.safetensors ..: one checkpoint's parts, whose index is gone.
        span = f"{shards[0].name} .. {shards[-1].name}" \
            if len(shards) > 1 else shards[0].name
        one = os.path.join(path, shards[0].name)
        return (f"{path}: the shards of one sharded checkpoint ({span}) without the "
                "index that lists their tensors (a '*.index.json', which the save writes "
                "last): the set is read through its index; to measure one shard alone, "
                f"'gradclip inspect {one}'")
    trend = f"for norms over the run use 'gradclip trend {path}'"
    # One file with a number in its name (bf16.pt, gpt2.pt) beside other checkpoints is no
    # run of per-step files, nor the newest of them.
    if len(files) == 1 and any(c != files[0] and is_checkpoint_file(c) for c in children):
        files = []
    numbered = folders or files
    if numbered:
        numbered.sort(key=lambda c: (_step_of_name(c.name) or 0, c.name))
        what = ("numbered checkpoint" if folders else "per-step checkpoint file") + \
            ("s" if len(numbered) > 1 else "")
        span = numbered[0].name if len(numbered) == 1 else \
            f"{numbered[0].name} .. {numbered[-1].name}"
        newest = os.path.join(path, numbered[-1].name)
        return (f"{path}: a run's folder of {len(numbered)} {what} ({span}), not one "
                f"checkpoint: {trend}; to inspect the newest, 'gradclip inspect {newest}'")
    logs = [c for c in children if c.suffix in (".json", ".jsonl") and _is_log(c)]
    if logs:
        return (f"{path}: a run's folder with a log of gradient norms "
                f"({logs[0].name}), not one checkpoint: {trend}")
    return None


def _step_of_name(name: str) -> int | None:
    """The last number in a name's stem (``step_19.pt`` -> 19), the order trend gives."""
    return last_number(name.split(".", 1)[0])


def is_checkpoint_file(path: Path) -> bool:
    """A regular file whose first bytes one of the file readers recognises."""
    from . import READERS
    from .files.small_file import read_head

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        head = read_head(path, 64, what="a checkpoint file")
    except (OSError, InputError):
        return False
    return any(reader.recognises(head) for reader in READERS)


def trend_hint(path: str) -> str | None:
    """Where inspect refuses a run's logs or its output folder: the command that reads them.

    A ``trainer_state.json`` or a monitor's ``grads.jsonl`` holds norms over
    steps, and an ``output_dir`` holds several checkpoints: ``trend`` reads
    both (docs/reference/contract.md, "Over time"); inspect reads one checkpoint.
    """
    p = Path(path)
    if _is_log(p):
        what = "a log of gradient norms over steps"
    elif p.is_dir():
        from .layouts import LAYOUTS

        if any(layout.recognises(p) for layout in LAYOUTS):
            return None  # a checkpoint: its own refusal says what it holds
        try:
            children = [c for _, c in zip(range(_SCANNED), p.iterdir())]
        except OSError:
            return None
        if any(NUMBERED_NAME.fullmatch(c.name) and c.is_dir() for c in children):
            what = "a run's folder of numbered checkpoints"
        elif any(c.suffix in (".json", ".jsonl") and _is_log(c) for c in children):
            what = "a run's folder with a log of gradient norms"
        else:
            return None
    else:
        return None
    return f"it is {what}: for norms over the run use 'gradclip trend {path}'"
