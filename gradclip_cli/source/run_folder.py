"""A training run's folder (an HF ``output_dir``): every series of norms it holds.

A run folder keeps the same run several times over, at different grains:

* the monitor's JSON Lines log (``gradclip.monitor/1``, any name): every
  logged step, the total and every group;
* a Trainer's ``trainer_state.json``: ``log_history``'s ``grad_norm``, every
  ``logging_steps``, the total only. Each ``checkpoint-N/`` keeps a copy as it
  was then; the newest (the folder's own, written by ``save_state``, or the
  last checkpoint's) holds the most steps, and it alone is read;
* a tracker's run (``source/logs/trackers.py``): TensorBoard event files
  (the Trainer's ``runs/``, Lightning's ``version_N/``), MLflow, trackio, W&B
  or Lightning's ``metrics.csv``, the gradient-norm tag its rule finds;
* the numbered checkpoints themselves (``checkpoint-N/``, ``global_stepN/``):
  one point each, every ``save_steps``, measured as ``inspect`` measures them
  (a Trainer checkpoint holds Adam's moments, not gradients).

``discover`` lists them all and chooses the one a trend judges: the finest
grained (most points), then one that logs gradients themselves over
checkpoints (whose ``auto`` may be a moment), then one with per-group norms
(the layer that spiked) over the total alone, then one that keeps the
numbers as logged over a float32 copy (TensorBoard's). Judging several series at once
would count each step twice. The others are named with the reason they
were not judged.

A Trainer's ``training_args.bin`` says whether it clipped (``max_grad_norm``):
when it did, the optimizer only ever saw clipped gradients, so the moments
that checkpoints keep barely move at a spike, while the logs (taken before
clipping) show it whole.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gradclip_cli import tracker_tags
from gradclip_cli.errors import GradclipError, InputError, MissingExtraError, UsageError
from gradclip_cli.escaping import visible
from gradclip_cli.source.exclude import Exclusion
from gradclip_cli.source.files import sqlite_file, training_args
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.logs import LoggedNorms, LogKind, monitor_log, trackers, trainer_state
from gradclip_cli.source.logs.recognise import log_kind
from gradclip_cli.source.vocabulary import last_number

MONITOR, TRAINER_STATE, CHECKPOINTS = "gradclip-monitor", "trainer-state", "checkpoints"
TRACKER = "tracker"
TRAINER_STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class Series:
    """One series of the run: a log file (``log`` its kind, ``entries`` as read) or
    the numbered checkpoints (``paths`` in step order, ``steps`` their numbers)."""

    kind: str
    paths: tuple[Path, ...]
    steps: tuple[int | None, ...]
    per_group: bool
    log: LogKind | None = None
    entries: tuple[LoggedNorms, ...] = ()
    tracker: trackers.TrackerSeries | None = None  # the tag and run, for a tracker's series

    @property
    def points(self) -> int:
        return len(self.steps)

    @property
    def source(self) -> str:
        """The file, or the first and last checkpoint folder."""
        if self.kind != CHECKPOINTS or len(self.paths) == 1:
            return str(self.paths[0])
        return f"{self.paths[0]} .. {self.paths[-1]}"

    def describe(self) -> str:
        steps = [s for s in self.steps if s is not None]
        span = f", steps {min(steps)}-{max(steps)}" if steps else ""
        if self.kind == MONITOR:
            what = "gradclip monitor log, gradient norms"
        elif self.kind == TRAINER_STATE and trainer_state.gradclip_totals(self.paths[0]):
            # gradclip's callback logged the monitor's norms there: those are the points.
            what = f"Trainer log_history {tracker_tags.TOTAL_NORM}, gradclip's callback"
        elif self.kind == TRAINER_STATE:
            what = "Trainer log_history grad_norm"
        elif self.kind == TRACKER:
            what = self.tracker.describe()
        else:
            what = "checkpoints"
        groups = "per group" if self.per_group else "total only"
        return f"{visible(str(self.source))} ({what}, {self.points} points{span}, {groups})"


@dataclass(frozen=True)
class Clipping:
    """Whether the Trainer clipped: ``max_grad_norm`` (> 0: clipped to it; 0 or NaN:
    never), None when unknown, with the file read (or why it could not be)."""

    max_grad_norm: float | None
    source: Path | None
    why_unknown: str | None = None

    @property
    def clipped(self) -> bool | None:
        """Whether the Trainer changed gradients by clipping: it calls its clip when
        ``max_grad_norm > 0`` (never for NaN), and a limit of inf changes none."""
        if self.max_grad_norm is None:
            return None
        return self.max_grad_norm > 0 and not math.isinf(self.max_grad_norm)


@dataclass(frozen=True)
class MonitorClipping:
    """What a GradMonitor log records of its own clipping (``clip_coef``, ``clipped_to``):
    the steps it scaled, of ``logged``, and the limits it scaled them to."""

    source: Path
    logged: int
    clipped: int  # steps scaled by a number (a NaN coefficient clips nothing to anything)
    limits: tuple[float, ...]  # the distinct ``clipped_to``, smallest first
    smallest_coef: float | None
    # Non-finite steps the monitor scaled by a NaN coefficient, as torch's clip_grad_norm_
    # does: every gradient of the step NaN, clipped to no limit.
    nan_steps: tuple[int | None, ...] = ()

    @classmethod
    def of(cls, series: Series) -> MonitorClipping:
        return cls.of_log(series.paths[0], series.entries)

    @classmethod
    def of_log(cls, path: Path, entries) -> MonitorClipping:
        """From a monitor log's entries (``LoggedNorms``)."""
        scaled = [e for e in entries if e.clip_coef is not None]
        clipped = [e for e in scaled if not math.isnan(e.clip_coef)]
        limits = sorted({e.clipped_to for e in clipped if e.clipped_to is not None})
        coefs = [e.clip_coef for e in clipped]
        return cls(path, len(entries), len(clipped), tuple(limits),
                   min(coefs) if coefs else None,
                   tuple(e.step for e in scaled if math.isnan(e.clip_coef)))

    def note(self) -> str:
        """The note for a log trended by itself, where the monitor clipped."""
        if not self.clipped:  # NaN coefficients alone
            return f"clipping: {self.words()}"
        return (f"clipping: {self.words()}: the logged norms are from before its clipping, "
                "the optimizer saw the clipped gradients")

    def words(self) -> str:
        """``gradclip's GradMonitor (grads.jsonl) clipped 30 of 30 logged steps ...``."""
        who = f"gradclip's GradMonitor ({visible(str(self.source))})"
        nan = ""
        if self.nan_steps:
            shown = ", ".join(str(s) for s in self.nan_steps[:5])
            more = ", ..." if len(self.nan_steps) > 5 else ""
            nan = (f"; clip_coef NaN at {len(self.nan_steps)} non-finite step(s) "
                   f"({shown}{more}): their gradients scaled to NaN, as torch's "
                   "clip_grad_norm_ does")
        if not self.clipped and nan:
            return f"{who} clipped none of its {self.logged} logged steps{nan}"
        if not self.clipped:
            return f"{who} records no clipping in its {self.logged} logged steps"
        if len(self.limits) == 1:
            to = f" to total norm {self.limits[0]:g}"
        elif self.limits:
            to = f" to total norms {self.limits[0]:g}-{self.limits[-1]:g}"
        else:
            to = ""
        coef = "" if self.smallest_coef is None else \
            f", clip_coef down to {self.smallest_coef:.3g}"
        return f"{who} clipped {self.clipped} of {self.logged} logged steps{to}{coef}{nan}"


@dataclass(frozen=True)
class RunFolder:
    path: Path
    series: tuple[Series, ...]  # every series found; ``judged`` among them
    judged: Series
    why_not: dict[int, str]  # index in ``series`` -> why it was not judged
    clipping: Clipping | None  # None: no Trainer arguments in the folder
    unread: tuple[str, ...] = ()  # logs found but not read as a series, and why
    # What the folder's GradMonitor log says of its own clipping (the finest
    # log when there are several); None: no monitor log.
    monitor_clipping: MonitorClipping | None = None
    # Trackers' runs not read as a series (a store of several runs, no --run: a
    # Lightning fit resumed into a new logger version): the norm audit still holds
    # each one's framework total against the monitor log.
    audited_runs: tuple[trackers.TrackerRun, ...] = ()

    def notes(self) -> list[str]:
        """What was found and chosen, one line each: where every series came from.
        Escaped where made, as inspect's notes are: every format shows them as they are."""
        lines = [f"judged: {self.judged.describe()}"]
        for i, series in enumerate(self.series):
            if series is not self.judged:
                lines.append(f"not judged: {series.describe()}: {self.why_not[i]}")
        lines += [f"not read: {visible(why)}" for why in self.unread]  # a refusal's raw line
        lines += [f"{visible(str(s.source))}: {s.tracker.choice_note}" for s in self.series
                  if s.tracker is not None]
        if self.judged.kind == TRAINER_STATE:
            monitors = [s for s in self.series if s.kind == MONITOR]
            where = (
                f"{visible(str(monitors[0].source))}, coarser, has every layer's: trend it alone"
                if monitors
                else "a GradMonitor log beside it would give every layer's norm"
            )
            lines.append(
                "layer: log_history holds the total norm only, so a spike cannot "
                f"be placed in a layer; {where}"
            )
        note = self.clipping_note()
        if note is not None:
            lines.append(note)
        return lines

    def clipping_note(self) -> str | None:
        """Who clipped the gradients the optimizer saw: the Trainer (its arguments'
        ``max_grad_norm``) and gradclip's monitor (its log's ``clip_coef``), one line;
        None when the folder holds neither the arguments nor a monitor log."""
        clip, monitor = self.clipping, self.monitor_clipping
        monitor_clipped = monitor is not None and monitor.clipped > 0
        by_monitor = (
            f"{monitor.words()}: the logged norms are from before its clipping, the "
            "optimizer (and the Adam moments in the checkpoints) saw the clipped gradients"
            if monitor_clipped else None
        )
        if clip is None:
            return None if by_monitor is None else f"clipping: {by_monitor}"
        where = visible(str(clip.source)) if clip.source is not None else ""
        if clip.max_grad_norm is None:
            known = "" if by_monitor is None else f"; {by_monitor}"
            return f"clipping: unknown ({visible(clip.why_unknown)}){known}"
        if not clip.clipped:
            why = (": a NaN, which is never > 0" if math.isnan(clip.max_grad_norm)
                   else ": an infinite limit, which changes no gradient"
                   if math.isinf(clip.max_grad_norm) else "")
            trainer = (f"clipping: the Trainer did not clip (max_grad_norm "
                       f"{clip.max_grad_norm:g} in {where}{why})")
            if by_monitor is not None:
                return f"{trainer}; {by_monitor}"
            either = "" if monitor is None else f" ({monitor.words()})"
            return f"{trainer}: the optimizer saw every gradient as logged{either}"
        also = "" if by_monitor is None else f"; {by_monitor}"
        return (
            f"clipping: the Trainer clipped gradients to max_grad_norm "
            f"{clip.max_grad_norm:g} ({where}); the logged norms are from before "
            "clipping, but the Adam moments in the checkpoints only saw clipped "
            f"gradients, so a spike barely shows in exp_avg{also}"
        )


def numbered_folders(path: Path, exclusion: Exclusion | None = None) -> list[tuple[int, Path]]:
    """``(number, folder)`` of the numbered subfolders (``checkpoint-N``,
    ``global_stepN``), in step order; empty when there are none. A tracker's
    numbered run folders (Lightning's ``version_N/``, W&B's, MLflow's
    experiments) are runs, not checkpoints."""
    children = _children(path, exclusion)
    numbered = [
        (n, c) for c in children
        if (n := last_number(c.name)) is not None and c.is_dir()
        and not trackers.holds_tracker_files(c)
    ]
    return sorted(numbered, key=lambda nc: nc[0])


def discover(path: Path, what: str, choice: trackers.Choice | None = None,
             exclusion: Exclusion | None = None) -> RunFolder | None:
    """The series in run folder ``path`` and the one to judge for ``--what what``;
    None when ``path`` holds numbered checkpoints and nothing else to choose from
    (then the checkpoints are the series, as before), or holds neither numbered
    checkpoints nor a tracker's run."""
    choice = choice or trackers.Choice()
    exclusion = exclusion or Exclusion()
    folders = numbered_folders(path, exclusion)
    stores = trackers.runs_in(path, exclusion.excludes)
    if not folders and not any(stores):
        return None
    unread: list[str] = []
    logs = _monitor_logs(path, exclusion)
    state = _newest_trainer_state(path, folders, unread, exclusion)
    if state is not None:
        logs.append(state)
    audited: list[trackers.TrackerRun] = []
    tracked = _tracker_series(path, stores, choice, unread, audited,
                              alone=not folders and not logs)
    series: list[Series] = [
        Series(CHECKPOINTS, tuple(f for _, f in folders), tuple(n for n, _ in folders), True)
    ] if folders else []
    logs += tracked
    series += logs
    clipping = _clipping(path, folders)
    if not logs and clipping is None and not unread:
        return None
    if not series:
        raise InputError(f"{path}: {unread[0]}")
    _copies_agree(path, series)
    judged, why_not = _choose(series, what)
    monitors = [s for s in series if s.kind == MONITOR]
    monitor_clipping = MonitorClipping.of(max(monitors, key=lambda s: s.points)) \
        if monitors else None
    return RunFolder(path, tuple(series), judged, why_not, clipping, tuple(unread),
                     monitor_clipping, tuple(audited))


def _children(path: Path, exclusion: Exclusion | None = None) -> list[Path]:
    try:
        children = sorted(c for c in path.iterdir() if not c.name.startswith("."))
    except OSError as error:
        raise InputError(f"{path}: cannot list the folder: {error.strerror or error}") from None
    return children if exclusion is None else exclusion.keep(children)


def _tracker_series(path: Path, stores: list, choice: trackers.Choice,
                    unread: list[str], audited: list[trackers.TrackerRun], *,
                    alone: bool) -> list[Series]:
    """The trackers' runs under ``path``, a series each. Where other series may be
    there (``alone`` False) and no --tag/--run was given, one that cannot be read
    (several runs, no norm tag) is noted in ``unread``, not fatal; several runs are
    added to ``audited`` (the norm audit reads each). A missing extra is exit 3,
    naming it and the ``--exclude`` that leaves the run out."""
    found = []
    try:
        runs = trackers.choose_runs(stores, choice, str(path))
    except GradclipError as error:
        if alone or choice.run is not None:
            raise
        unread.append(str(error))
        audited += [run for runs in stores for run in runs]
        return []
    # --tag reads the runs that log it: each tracker names a key its own way (the
    # Trainer's TensorBoard and W&B 'train/grad_norm', MLflow's 'grad_norm'), so a run
    # without it is noted, and refused only when no run of the folder has it.
    untagged: list[GradclipError] = []
    for run in runs:
        try:
            read = trackers.norm_series(run, choice)
        except MissingExtraError as error:
            # Never a note: the judged series and the norm audit may rest on this run.
            if alone:
                raise
            raise MissingExtraError(f"{error}; or leave it out: --exclude "
                                    f"{_top_name(path, run.source)}") from None
        except trackers.NoSuchTag as error:
            untagged.append(error)
            continue
        except GradclipError as error:
            if alone or choice.tag is not None:
                raise
            unread.append(str(error))
            continue
        found.append(Series(TRACKER, (run.source,), tuple(e.step for e in read.entries),
                            read.per_group, trackers.KIND, read.entries, read))
    if untagged and not found:
        raise untagged[0]
    unread += [str(error) for error in untagged]
    return found


def _top_name(folder: Path, source: Path) -> str:
    """The name, in ``folder``, of the child that holds ``source`` (what ``--exclude``
    matches a run folder's listing against)."""
    try:
        return Path(source).relative_to(folder).parts[0]
    except (ValueError, IndexError):
        return Path(source).name


def _log_series(kind: str, log: LogKind, path: Path) -> Series:
    entries = tuple(log.read(path))
    return Series(
        kind, (path,), tuple(e.step for e in entries), any(e.groups for e in entries), log, entries
    )


def _monitor_logs(path: Path, exclusion: Exclusion | None = None) -> list[Series]:
    found = []
    for child in _children(path, exclusion):
        if child.is_file() and log_kind(child) is monitor_log.KIND:
            found.append(_log_series(MONITOR, monitor_log.KIND, child))
    return found


def _newest_trainer_state(
    path: Path, folders: list[tuple[int, Path]], unread: list[str],
    exclusion: Exclusion | None = None,
) -> Series | None:
    """The folder's own ``trainer_state.json``, or the last checkpoint's when that one
    logs later steps (the run went on after ``save_state``, or never called it), less
    what ``--exclude`` leaves out. One that cannot be read as a series is added to
    ``unread`` with why."""
    candidates = [path / TRAINER_STATE_FILE]
    if folders:
        candidates.append(folders[-1][1] / TRAINER_STATE_FILE)
    read = []
    for file in candidates:
        if not os.path.isfile(file) or log_kind(file) is not trainer_state.KIND:
            continue
        if exclusion is not None and exclusion.excludes(file):
            continue
        try:
            read.append(_log_series(TRAINER_STATE, trainer_state.KIND, file))
        except InputError as error:
            # A Trainer state with no grad_norm (older transformers, or a
            # logging_steps past the run's end) holds no series; a damaged one
            # is no series either: the checkpoints still are, and the notes say why.
            unread.append(str(error))
    if not read:
        return None
    return max(
        read,
        key=lambda s: (
            max((x for x in s.steps if x is not None), default=-1),
            s.points,
            s.paths[0].parent == path,
        ),
    )


def _clipping(path: Path, folders: list[tuple[int, Path]]) -> Clipping | None:
    """From the folder's own ``training_args.bin`` (``save_model`` writes one), else the
    newest checkpoint's; None when the folder holds neither (not a Trainer run)."""
    candidates = [
        path / training_args.FILE_NAME,
        *(f / training_args.FILE_NAME for _, f in reversed(folders)),
    ]
    file = next((c for c in candidates if os.path.isfile(c)), None)
    if file is None:
        return None
    try:
        return Clipping(training_args.max_grad_norm(file), file)
    except InputError as error:
        return Clipping(None, file, str(error))


def _copies_agree(path: Path, series: list[Series]) -> None:
    """The framework's own total, where the folder keeps it twice (``trainer_state.json``'s
    ``grad_norm`` and a tracker's ``train/grad_norm``, two trackers' ``grad_norm``), is
    one logged number: copies equal at every step both hold (to float32, which
    TensorBoard keeps). Where they are not, the folder holds two runs (an ``output_dir``
    trained into again, without its tracker): judging either as the folder's run could
    be the old one, so exit 2 naming both and the ``--exclude`` that leaves one out."""
    copies = []
    for s in series:
        if s.kind == TRAINER_STATE:
            try:
                norms = trainer_state.framework_totals(s.paths[0])
            except GradclipError:
                continue
            copies.append((trainer_state.GRAD_NORM, s, trainer_state.GRAD_NORM, norms))
        elif s.kind == TRACKER and s.tracker is not None:
            copies += [(trackers.total_name(tag), s, tag, norms)
                       for tag, norms in s.tracker.totals]
    for i, (name, a, a_tag, a_norms) in enumerate(copies):
        for other, b, b_tag, b_norms in copies[i + 1:]:
            if other != name or a is b:
                continue
            step = next((k for k in sorted(a_norms.keys() & b_norms.keys())
                         if not _same_logged(a_norms[k], b_norms[k])), None)
            if step is None:
                continue
            raise UsageError(
                f"{path}: two runs' series: {quoted(a_tag)} of {a.source} and "
                f"{quoted(b_tag)} of {b.source} are copies of one logged total, yet differ "
                f"at step {step} ({a_norms[step]:.6g} and {b_norms[step]:.6g}); leave one run "
                f"out: --exclude {_top_name(path, a.paths[0])} or --exclude "
                f"{_top_name(path, b.paths[0])}")


def _same_logged(a: float, b: float) -> bool:
    """One logged number, each copy kept as float64 or float32 (TensorBoard's)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or _to_float32(a) == _to_float32(b)


def _to_float32(value: float) -> float:
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # beyond float32: TensorBoard's copy of it is inf
        return math.copysign(math.inf, value)


def _float32(s: Series) -> bool:
    """Whether a tracker kept the series' values as float32 (TensorBoard): of two copies of
    one run's steps, the other keeps the numbers as logged."""
    return s.tracker is not None and s.tracker.run.stores_float32(s.tracker.tag)


def _choose(series: list[Series], what: str) -> tuple[Series, dict[int, str]]:
    """The finest-grained series ``what`` allows; why each other one is not judged."""
    logs_allowed = what in ("auto", "grads")

    def rank(s: Series) -> tuple:
        return (s.points, s.kind != CHECKPOINTS, s.per_group, not _float32(s),
                s.kind == MONITOR)

    allowed = [s for s in series if logs_allowed or s.kind == CHECKPOINTS]
    if not allowed:  # a folder of logs alone (a tracker's run): no checkpoint to measure
        raise UsageError(f"--what {what}: {series[0].source} logs gradient norms "
                         f"(grads) only, which cannot be measured as {what}; trend one kind "
                         "at a time")
    judged = max(allowed, key=rank)
    why_not = {}
    for i, s in enumerate(series):
        if s is judged:
            continue
        if s not in allowed:
            why_not[i] = f"a log of gradient norms, not {what}"
        elif s.points < judged.points:
            why_not[i] = f"fewer points than the judged series ({s.points} < {judged.points})"
        elif s.kind == CHECKPOINTS:
            why_not[i] = (
                "as many points, but the logs hold the gradients themselves "
                "(--what exp_avg trends the checkpoints)"
            )
        elif judged.per_group and not s.per_group:
            why_not[i] = "as many points, total only"
        elif _float32(s) and not _float32(judged):
            why_not[i] = ("as many points, stored as float32 (the judged series keeps the "
                          "numbers as logged)")
        else:
            why_not[i] = "as many points as the judged series"
        if s.kind == CHECKPOINTS and judged.kind != CHECKPOINTS and s.points < judged.points:
            why_not[i] += "; --what exp_avg trends them"
    return judged, why_not


def tracker_file(path: Path, choice: trackers.Choice) -> RunFolder | None:
    """A tracker's file named on the command line (an event file, ``mlflow.db``, a
    trackio database, a ``.wandb`` file, ``metrics.csv``) as a run folder of one
    series; None when it is no tracker's file. An SQLite file of neither
    tracker's schema is exit 3."""
    runs = trackers.given_runs(path)
    if runs is None:
        if sqlite_file.is_sqlite(path):
            raise InputError(f"{path}: an SQLite database, but neither "
                             "MLflow's store (tables runs, metrics) nor a trackio project "
                             "(table metrics with run_name, step, metrics)")
        return None
    if not runs:
        raise InputError(f"{path}: a tracker's store with no runs")
    run, = trackers.choose_runs([runs], choice, str(path))
    read = trackers.norm_series(run, choice)
    series = Series(TRACKER, (run.source,), tuple(e.step for e in read.entries),
                    read.per_group, trackers.KIND, read.entries, read)
    return RunFolder(path, (series,), series, {}, None)
