"""What the paths given to ``trend`` and ``autopsy`` stand for: checkpoints and norm logs.

A path is a file (a checkpoint, a norm log, a tracker's file), one
checkpoint folder (a layout recognises it), a run's folder of numbered
checkpoints (``run_folder.py`` finds its series), or a folder of checkpoint
files and logs, recognised by content. ``expand`` yields an ``Input`` for
each; whether a folder is one checkpoint is asked of the caller
(``why_not_checkpoint``), which opens it as the command will.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, UsageError
from . import run_folder
from .exclude import Exclusion
from .layouts import accelerate_fsdp
from .logs import LogKind, trackers
from .logs.recognise import log_kind
from .not_a_checkpoint import is_checkpoint_file


@dataclass(frozen=True)
class Input:
    """One file or folder to read: a checkpoint (``kind`` None) or a norm log.

    ``folder_step`` is the number of the ``checkpoint-N/`` folder it came
    from, the step of a checkpoint that states none itself."""

    path: Path
    kind: LogKind | None = None
    folder_step: int | None = None
    entries: tuple | None = None  # a log's entries, when run-folder discovery read them
    # The tag and run of a tracker's series: what a report names as the quantity judged
    # where --tag named the tag.
    tracker: trackers.TrackerSeries | None = None

    @classmethod
    def of_series(cls, series: run_folder.Series) -> Input:
        """A run folder's log series (its file, its entries as read, its tracker's tag)."""
        return cls(series.paths[0], series.log, None, series.entries, series.tracker)


def expand(path: Path, why_not_checkpoint, folder_step: int | None = None, *,
            what: str = "auto", runs: list | None = None,
            choice: trackers.Choice | None = None,
            exclusion: Exclusion | None = None) -> Iterator[Input]:
    """The checkpoints and logs ``path`` stands for.

    A folder is, in this order: a run's folder of numbered checkpoints (an
    HF ``output_dir`` of ``checkpoint-N/``, ``global_stepN/``), whose one
    judged series (``source/run_folder.py``: its monitor log, its newest
    ``trainer_state.json`` or the checkpoints in step order) is appended to
    ``runs``; one checkpoint (a layout the loader reads); or a folder of
    checkpoint files and logs, recognised by content (anything else in it is
    skipped).
    """
    choice = choice or trackers.Choice()
    exclusion = exclusion or Exclusion()
    if not path.is_dir():
        tracked = run_folder.tracker_file(path, choice)
        if tracked is None:
            yield Input(path, log_kind(path), folder_step)
            return
        if runs is not None:
            runs.append(tracked)
        yield Input.of_series(tracked.judged)
        return
    # accelerate's FSDP folder numbers its parts (pytorch_model_fsdp_0/, optimizer_0/):
    # one checkpoint, not a run.
    if folder_step is None and not accelerate_fsdp.recognises(path):
        run = run_folder.discover(path, what, choice, exclusion)
        if run is not None:
            if runs is not None:
                runs.append(run)
            if run.judged.kind != run_folder.CHECKPOINTS:
                yield Input.of_series(run.judged)
                return
        numbered = run_folder.numbered_folders(path, exclusion)
        if numbered:
            for number, child in numbered:
                yield from expand(child, why_not_checkpoint, number)
            return
    reason = why_not_checkpoint(path)
    if reason is None:
        yield Input(path, None, folder_step)
    else:
        yield from _folder_of_files(path, reason, folder_step, exclusion)


def kept(paths: list[Path], exclusion: Exclusion) -> list[Path]:
    """The inputs ``--exclude`` leaves in; none left is exit 2."""
    kept = [path for path in paths if not exclusion.excludes(path)]
    if not kept:
        raise UsageError(f"--exclude leaves out every input ({paths[0]} ...)")
    return kept


def once(inputs: list[Input]) -> list[Input]:
    """Each file or folder once, the first name it has (a run folder and its own
    trainer_state.json, given together, are one series, not two; timm's ``last.pth.tar``
    and ``model_best.pth.tar`` are hard links to a ``checkpoint-N.pth.tar``, one point)."""
    seen, kept = set(), []
    for item in inputs:
        try:
            st = os.stat(item.path)
            same = (st.st_dev, st.st_ino)
        except OSError:  # read later, where the error names the file
            same = os.path.realpath(item.path)
        if same not in seen:
            seen.add(same)
            kept.append(item)
    return kept


def children(path: Path) -> list[Path]:
    try:
        return sorted(c for c in path.iterdir() if not c.name.startswith("."))
    except OSError as error:
        raise InputError(f"{path}: cannot list the folder: {error.strerror or error}") from None


def _folder_of_files(path: Path, reason: str, folder_step: int | None,
                     exclusion: Exclusion | None = None) -> list[Input]:
    found = []
    listed = children(path)
    for child in listed if exclusion is None else exclusion.keep(listed):
        if not child.is_file():
            continue
        kind = log_kind(child)
        if kind is not None or is_checkpoint_file(child):
            found.append(Input(child, kind, folder_step))
    if not found:
        raise InputError(f"{path}: neither a checkpoint ({reason}) nor a folder of "
                         "checkpoints, trainer_state.json or gradclip monitor logs")
    return found


def expand_every(path: Path, why_not_checkpoint, choice: trackers.Choice,
                 exclusion: Exclusion) -> Iterator[Input]:
    """What ``path`` stands for to the autopsy, which reads every grain: every series of a
    run folder (its numbered checkpoints, its logs, its trackers' series, the checkpoint
    files in its other folders, such as the monitor's ``spikes/``), where ``expand``
    keeps only the one ``trend`` judges; a tracker's file (``--tag``, ``--run``)."""
    why_not = why_not_checkpoint
    if not path.is_dir():
        tracked = run_folder.tracker_file(path, choice)
        if tracked is None:
            yield Input(path, log_kind(path))
        else:
            yield Input.of_series(tracked.judged)
        return
    if accelerate_fsdp.recognises(path) or why_not(path) is None:
        yield Input(path)
        return
    found_run = run_folder.discover(path, "auto", choice, exclusion)
    found = False  # a folder of trackers' files alone (TensorBoard's) is a run, as to trend
    for series in () if found_run is None else found_run.series:
        if series.kind == run_folder.TRACKER:
            found = True
            yield Input.of_series(series)
    numbered = run_folder.numbered_folders(path, exclusion)
    for number, child in numbered:
        yield from expand(child, why_not, number)
    for child in exclusion.keep(children(path)):
        if child.is_file():
            kind = log_kind(child)
            if kind is not None or is_checkpoint_file(child):
                found = True
                yield Input(child, kind)
        elif child.is_dir() and child not in {c for _, c in numbered}:
            for inner in exclusion.keep(children(child)):
                if inner.is_file() and (log_kind(inner) is not None
                                        or is_checkpoint_file(inner)):
                    found = True
                    yield Input(inner, log_kind(inner))
    if not numbered and not found:
        raise InputError(f"{path}: neither a checkpoint nor a folder of "
                         "checkpoints, trainer_state.json or gradclip monitor logs")
