"""``gradclip trend``: norms over a run's checkpoints and logs, spikes judged against history.

Every input becomes points: a checkpoint is one (opened and measured as
``inspect`` does: any layout, any ``--what``), a monitor log or a
``trainer_state.json`` one per logged step. All checkpoints are read in this
one process, one after another, each released before the next, so 50
checkpoints cost their reading and no more start-ups (BENCHMARKS.md, "trend").

A trend judges one quantity: every point must measure the same ``what``.
Logs hold gradient norms (``grads``); with ``--what auto`` each checkpoint
picks its own (``grads`` if saved, else ``exp_avg``), and a run whose points
would mix kinds is exit 2 naming two that differ: z-scores of Adam's first
moment against a history of gradient norms would mean nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from .. import options, values
from ..core.spikes import DEFAULT_ALPHA, DEFAULT_WARMUP, DEFAULT_Z
from ..distributed import launcher
from ..errors import InputError, UsageError
from ..format.text import visible
from ..format.words import trend_verdict
from ..progress import Steps, progress_steps
from ..report import NonFinite, parse_group_by
from ..report.groups import group_sums, nonfinite_counts
from ..report.trend import (
    FAIL_ON_ANY,
    FAIL_ON_NEWEST,
    NONFINITE,
    SPIKE,
    ClippingFound,
    MonitorClipped,
    Observation,
    SeriesFound,
    build_trend_report,
    one_point_per_step,
    order_by_step,
)
from ..source import READERS, run_folder
from ..source.exclude import Exclusion
from ..source.layouts import LAYOUTS, accelerate_fsdp
from ..source.logs import LogKind, trackers
from ..source.logs.recognise import log_kind
from ..source.run_folder import RunFolder
from ..source.vocabulary import CheckpointStep, checkpoint_step, last_number
from ..source.what import EXPLAIN, WHATS
from .common import Loaded, Releasers, load, measure, output_format, prepare, speaks
from .norm_audit import norm_audits

# What --what may name (docs/reference/contract.md): the same choices inspect takes.
WHAT_CHOICES = WHATS
# What a norm log (monitor JSON Lines, trainer_state.json) holds.
LOGGED_WHAT = "grads"
# How a log's groups were made: by the writer (GradMonitor's group_by), not by --group-by.
LOGGED_GROUPS = "the log's writer"
DEFAULT_GROUP_BY = "layer"

@dataclass(frozen=True)
class Input:
    """One file or folder to read: a checkpoint (``kind`` None) or a norm log.

    ``folder_step`` is the number of the ``checkpoint-N/`` folder it came
    from, the step of a checkpoint that states none itself."""

    path: Path
    kind: LogKind | None = None
    folder_step: int | None = None
    entries: tuple | None = None  # a log's entries, when run-folder discovery read them


@dataclass(frozen=True)
class Measurement:
    """How checkpoints are measured: the same options ``inspect`` takes."""

    key: str | None
    norm_type: float
    device: object
    group_rule: object
    group_by: str
    trust_pickle: bool
    verify: bool
    session: object = None  # a launcher.Session under torchrun: ranks split each checkpoint
    what: str = "auto"


def run(
    *, paths: list[Path], what: str, group_by: str | None, z: float | None, alpha: float | None,
    warmup: int | None, fail_on: str, plot: Path | None, key: str | None,
    norm_type: str | None, device: str, format: str, trust_pickle: bool, verify: bool,
    quiet: bool, output_file: Path | None, progress: bool = True,
    tag: str | None = None, run_name: str | None = None, exclude: tuple[str, ...] = (),
) -> int:
    # First: an error document (--format json) goes to --output-file too.
    options.report_file(output_file, reads=paths, writes=[plot] if plot is not None else [])
    fmt = output_format(format)
    if plot is not None:
        _check_plot(plot)
    report = build(paths=paths, what=what, group_by=group_by, z=z, alpha=alpha, warmup=warmup,
                   fail_on=fail_on, key=key, norm_type=norm_type, device=device,
                   trust_pickle=trust_pickle, verify=verify,
                   progress=progress and not quiet, output_file=output_file,
                   tag=tag, run_name=run_name, exclude=exclude)
    # The report is drawn (a --output-file staged) before the plot is written:
    # nothing can fail over the report once the plot exists.
    if quiet and format == "table":
        # -q: the verdict alone on stdout; each finding a line on stderr.
        from ..format import table

        err = sys.stderr if speaks() else None
        pending = prepare(lambda out: table.print_trend_verdict(report, out, err), output_file,
                          trend_verdict(report))
    else:
        pending = prepare(lambda out: fmt.render_trend(report, out), output_file,
                          trend_verdict(report))
    if plot is not None and speaks():
        from ..format.plot import write_trend_plot

        try:
            write_trend_plot(report, plot)
        except BaseException:
            if pending is not None:
                pending.discard()
            raise
    if pending is not None:
        pending.deliver()
    # A norm audit that disagrees is a finding too (docs/guides/dashboards.md).
    return 1 if report.status in (SPIKE, NONFINITE) or report.disagreeing else 0


def build(
    *, paths: list[Path], what: str, group_by: str | None, z: float | None,
    alpha: float | None, warmup: int | None, fail_on: str, key: str | None,
    norm_type: object, device: str, trust_pickle: bool, verify: bool, progress: bool,
    output_file: Path | None = None, launched: bool = True,
    tag: str | None = None, run_name: str | None = None, exclude: tuple[str, ...] = (),
):
    """The ``TrendReport`` of ``paths`` (``report/trend.py``), which every format renders.

    ``group_by`` None: each log's own groups and ``layer`` for checkpoints.
    ``tag``, ``run_name``, ``exclude``: ``--tag``, ``--run``, ``--exclude``.
    ``launched``: under a launcher (``torchrun``) the ranks share each
    checkpoint, as the command does; the Python API passes False.
    """
    check_what(what)
    z = DEFAULT_Z if z is None else z
    alpha = DEFAULT_ALPHA if alpha is None else alpha
    warmup = DEFAULT_WARMUP if warmup is None else warmup
    fail_on = _fail_on(fail_on)
    _spike_options(z, alpha, warmup)
    regroup = group_by is not None  # --group-by given
    group_by = DEFAULT_GROUP_BY if group_by is None else group_by
    rule = parse_group_by(group_by)
    requested_p = None if norm_type is None else options.norm_type(norm_type)
    dev = options.device(device)
    # Under torchrun every rank reads every checkpoint's share, as inspect does
    # (docs/reference/contract.md, "Beyond one machine"); rank 0 alone writes the report.
    session = launcher.join(dev, device, paths) if launched else None
    if session is not None:
        dev = session.device
    with progress_steps(not progress or not speaks()) as steps:
        runs: list[RunFolder] = []
        choice, exclusion = trackers.Choice(tag, run_name), Exclusion(tuple(exclude))
        inputs = _once([item for path in _kept(paths, exclusion)
                        for item in _expand(path, lambda p: _loads(p, key, trust_pickle, steps),
                                            what=what, runs=runs, choice=choice,
                                            exclusion=exclusion)])
        if (tag is not None or run_name is not None) and not any(
                s.tracker is not None for r in runs for s in r.series):
            flag = "--tag" if tag is not None else "--run"
            raise UsageError(f"{flag} picks from a tracker's files (TensorBoard, MLflow, "
                             "trackio, W&B, metrics.csv); no input is one")
        logs = [(item.path, item.kind.read(item.path) if item.entries is None
                 else list(item.entries)) for item in inputs if isinstance(item.kind, LogKind)]
        if logs and regroup:
            raise UsageError(
                f"{visible(str(logs[0][0]))}: --group-by groups a checkpoint's tensors; a "
                "norm log holds the norms of the groups it was written with (GradMonitor's "
                "group_by), which cannot be grouped again: leave --group-by out")
        p = _norm_type(requested_p, logs)
        how = Measurement(key, p, dev, rule, group_by, trust_pickle, verify, session, what)
        kinds = OneKind(what)
        for path, _ in logs:
            kinds.check(str(path), LOGGED_WHAT, logged=True)
        observations: list[Observation] = []
        step_notes: list[str] = []
        optimizers: set[str | None] = set()
        logged = dict(logs)
        for item in inputs:
            if isinstance(item.kind, LogKind):
                observations += _logged_observations(item.path, logged[item.path])
                continue
            # One at a time: loading checkpoint i+1 on a thread while i was
            # measured made trend slower, not faster (BENCHMARKS.md, "trend").
            loaded = load(item.path, how.key, how.trust_pickle, how.verify, steps, how.what)
            options.report_file(output_file, reads=loaded.contents.files)
            kinds.check(str(item.path), loaded.selection.what)  # before measuring it
            m = measure_loaded(loaded, item.path, how, steps, item.folder_step)
            del loaded  # its mapping goes before the next checkpoint is opened
            optimizers.add(m.optimizer)
            if m.step_note is not None:
                step_notes.append(f"{visible(str(item.path))}: {m.step_note}")
            observations.append(Observation(
                source=str(item.path), step=m.step, total_norm=m.total_norm,
                groups=m.groups, nonfinite=m.nonfinite, what=m.what))
    observations, copies = one_point_per_step(observations)
    found = _found(runs)
    found["notes"] += step_notes + copies + exclusion.notes() + _monitor_clipping(logs, runs)
    if logs:
        group_by = (LOGGED_GROUPS if len(logs) == len(inputs)
                    else f"{group_by} (checkpoints), {LOGGED_GROUPS} (logs)")
    audits = norm_audits(runs, [(item.path, item.kind, logged[item.path]) for item in inputs
                                if isinstance(item.kind, LogKind)])
    report = build_trend_report(
        order_by_step(observations), what=kinds.what, norm_type=p, group_by=group_by, z=z,
        alpha=alpha, warmup=warmup, fail_on=fail_on, audits=audits, **found,
    )  # fmt: skip
    return replace(report, optimizer=one_optimizer(optimizers))


def one_optimizer(names: set[str | None]) -> str | None:
    """The optimizer every measured checkpoint names (its quantity's words: "Adam
    exp_avg"); None where they name several, or none."""
    return next(iter(names)) if len(names) == 1 else None


def check_what(text: str) -> str:
    return values.word("--what", text, WHAT_CHOICES)


class OneKind:
    """Checks that every point of a trend (or both sides of a compare) measures one ``what``.

    ``requested``: ``--what``; "auto" lets the first point decide. A second
    kind is a ``UsageError`` naming both sources: one series, one quantity.
    ``command`` ("trend" or "compare") words the way out.
    """

    def __init__(self, requested: str, command: str = "trend"):
        self.requested = requested
        self.command = command
        self.first: tuple[str, str] | None = None  # (source, what)
        self.logs = False

    @property
    def what(self) -> str:
        if self.first is not None:
            return self.first[1]
        return LOGGED_WHAT if self.requested == "auto" else self.requested

    def check(self, source: str, what: str, *, logged: bool = False) -> None:
        if logged and self.requested not in ("auto", what):
            raise UsageError(
                f"--what {self.requested}: {visible(source)} logs gradient norms ({what}) "
                f"only, which cannot be measured as {self.requested}; trend one kind at a time")
        self.logs |= logged
        if self.first is None:
            self.first = (source, what)
            return
        source0, what0 = self.first
        if what == what0:
            return
        compare = self.command == "compare"
        if logged or self.logs:
            fix = "a log holds gradient norms only: trend the logs and the checkpoints apart"
        elif "weights" in (what0, what):
            # The one that measures weights by default holds nothing else to measure;
            # the other holds optimizer state or gradients, and a model's weights too
            # wherever its layout keeps them.
            fix = ("give --what weights to measure both alike" if compare else
                   "give --what weights to measure every checkpoint alike, or trend them apart")
        else:
            # Neither holds for sure what the other measures: no flag makes them one series.
            fix = "no --what measures both alike" if compare else "trend them apart"
        rule = ("compare needs one quantity on both sides" if compare
                else "one trend judges one quantity")
        raise UsageError(f"{visible(source)} measures {what} ({EXPLAIN[what]}) but "
                         f"{visible(source0)} measures {what0}; {rule}: {fix}")


def _fail_on(text: str) -> str:
    return values.word("--fail-on", text, (FAIL_ON_NEWEST, FAIL_ON_ANY))


def _spike_options(z: float, alpha: float, warmup: int) -> None:
    """The rules the command line checked already (values.py), for callers that skip it."""
    values.threshold("--z", z, allow_zero=False)
    values.fraction("--alpha", alpha)
    values.whole("--warmup", warmup, least=1)


def _check_plot(plot: Path) -> None:
    """Before any checkpoint is read: a wrong suffix or a missing matplotlib is exit 2."""
    values.plot_file(str(plot))


def _norm_type(requested: float | None, logs: list[tuple[Path, list]]) -> float:
    """The p every point uses: ``--norm-type``, else the one the logs state, else 2.

    A log's norms cannot be re-measured, so a log in another p is exit 2.
    """
    stated = {(entry.norm_type, path) for path, entries in logs for entry in entries}
    p = requested
    for log_p, path in sorted(stated, key=lambda s: str(s[1])):
        if p is None:
            p = log_p
        elif log_p != p:
            given = "--norm-type" if requested is not None else "another input"
            raise UsageError(f"{path}: logs norms with p={log_p:g}, but {given} uses "
                             f"p={p:g}; trend compares one kind of norm")
    return 2.0 if p is None else p


def _loads(path: Path, key: str | None, trust_pickle: bool, steps: Steps) -> str | None:
    """None when ``path`` is one checkpoint (a layout recognises it), else why not.

    Recognition is by content and cheap (a folder's names, a small JSON
    file's keys): the checkpoint is read once, when it is measured, and a
    damaged one is reported then, naming its file.
    """
    if any(layout.recognises(path) for layout in LAYOUTS):
        return None
    try:
        load(path, key, trust_pickle, False, steps)
    except InputError as error:
        return str(error).removeprefix(f"{path}: ")
    return None


def _expand(path: Path, why_not_checkpoint, folder_step: int | None = None, *,
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
        yield Input(tracked.judged.paths[0], tracked.judged.log, None, tracked.judged.entries)
        return
    # accelerate's FSDP folder numbers its parts (pytorch_model_fsdp_0/, optimizer_0/):
    # one checkpoint, not a run.
    if folder_step is None and not accelerate_fsdp.recognises(path):
        run = run_folder.discover(path, what, choice, exclusion)
        if run is not None:
            if runs is not None:
                runs.append(run)
            if run.judged.kind != run_folder.CHECKPOINTS:
                yield Input(run.judged.paths[0], run.judged.log, None, run.judged.entries)
                return
        numbered = run_folder.numbered_folders(path, exclusion)
        if numbered:
            for number, child in numbered:
                yield from _expand(child, why_not_checkpoint, number)
            return
    reason = why_not_checkpoint(path)
    if reason is None:
        yield Input(path, None, folder_step)
    else:
        yield from _folder_of_files(path, reason, folder_step, exclusion)


def _kept(paths: list[Path], exclusion: Exclusion) -> list[Path]:
    """The inputs ``--exclude`` leaves in; none left is exit 2."""
    kept = [path for path in paths if not exclusion.excludes(path)]
    if not kept:
        raise UsageError(f"--exclude leaves out every input ({visible(str(paths[0]))} ...)")
    return kept


def _once(inputs: list[Input]) -> list[Input]:
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


def _found(runs: list[RunFolder]) -> dict:
    """The report's account of the run folders read: every series, the judged one,
    whether the Trainer clipped; a line of notes each."""
    series, clipping, notes = [], [], []
    for run in runs:
        for i, s in enumerate(run.series):
            series.append(SeriesFound(s.source, s.kind, s.points, s.per_group,
                                      s is run.judged, run.why_not.get(i)))
        note = run.clipping_note()
        if note is not None:
            c, m = run.clipping, run.monitor_clipping
            monitor = None if m is None else MonitorClipped(str(m.source), m.logged, m.clipped,
                                                            m.limits)
            clipping.append(ClippingFound(
                None if c is None else c.max_grad_norm,
                None if c is None or c.source is None else str(c.source), note,
                None if c is None else c.clipped, monitor))
        notes += run.notes()
    return {"series": series, "clipping": clipping, "notes": notes}


def _monitor_clipping(logs: list[tuple[Path, list]], runs: list[RunFolder]) -> list[str]:
    """A note for each GradMonitor log trended by itself that records its own clipping
    (a run folder's note says it already, beside the Trainer's)."""
    covered = {r.monitor_clipping.source for r in runs if r.monitor_clipping is not None}
    notes = []
    for path, entries in logs:
        if path in covered or not any(getattr(e, "clip_coef", None) is not None
                                      for e in entries):
            continue
        notes.append(run_folder.MonitorClipping.of_log(path, entries).note())
    return notes


def _children(path: Path) -> list[Path]:
    try:
        return sorted(c for c in path.iterdir() if not c.name.startswith("."))
    except OSError as error:
        raise InputError(f"{path}: cannot list the folder: {error.strerror or error}") from None


def _folder_of_files(path: Path, reason: str, folder_step: int | None,
                     exclusion: Exclusion | None = None) -> list[Input]:
    found = []
    children = _children(path)
    for child in children if exclusion is None else exclusion.keep(children):
        if not child.is_file():
            continue
        kind = log_kind(child)
        if kind is not None or _is_checkpoint_file(child):
            found.append(Input(child, kind, folder_step))
    if not found:
        raise InputError(f"{path}: neither a checkpoint ({reason}) nor a folder of "
                         "checkpoints, trainer_state.json or gradclip monitor logs")
    return found


def _is_checkpoint_file(path: Path) -> bool:
    from ..source.files.small_file import read_head

    try:  # never blocks: a path swapped for a FIFO after is_file() is refused
        head = read_head(path, 64, what="a checkpoint file")
    except InputError:
        return False
    return any(reader.recognises(head) for reader in READERS)


def _step_of(stated: int | None, root: object, path: Path, folder_step: int | None
             ) -> CheckpointStep:
    """The step by the rule inspect follows too (``vocabulary.checkpoint_step``: what the
    checkpoint records, else a step-numbered name, its own or its folder's); else, for
    the order alone, the last number in its name, else its numbered folder's number."""
    found = checkpoint_step(stated, root, path)
    if found.step is not None:
        return found
    stem = path.name if path.is_dir() else path.name.split(".", 1)[0]
    number = last_number(stem)
    return CheckpointStep(number if number is not None else folder_step)


@dataclass(frozen=True)
class Measured:
    """One checkpoint's total and per-group norms: all that trend and compare show."""

    total_norm: float
    nonfinite: NonFinite
    groups: dict[str, float]  # in checkpoint order of first appearance
    step: int | None
    what: str = LOGGED_WHAT  # what was measured (``--what auto`` decides per checkpoint)
    step_note: str | None = None  # where its name gives another step than it records
    optimizer: str | None = None  # whose rule gave an optimizer quantity ("Adam")


def measure_checkpoint(path: Path, how: Measurement, steps: Steps,
                       folder_step: int | None = None) -> Measured:
    """Load (any layout), select ``how.what`` and measure one checkpoint, grouped;
    its pages are released as they are read."""
    loaded = load(path, how.key, how.trust_pickle, how.verify, steps, how.what)
    return measure_loaded(loaded, path, how, steps, folder_step)


def measure_loaded(loaded: Loaded, path: Path, how: Measurement, steps: Steps,
                   folder_step: int | None = None) -> Measured:
    """Measure and group one loaded checkpoint; its pages are released as they are read."""
    release = Releasers(loaded.contents.files or [path])
    # Groups and the total count each shared element once: the owned sums.
    _, sums = measure(loaded, how.norm_type, how.device, steps, f"measuring {path.name}",
                      release, how.session)
    # Group norms only, not inspect's full report (a row per tensor): that was
    # 0.55 s of 5.2 s over 50 checkpoints (BENCHMARKS.md, "trend").
    grouped = group_sums([how.group_rule(n) for n in loaded.names], sums)
    step = _step_of(loaded.contents.step,
                    None if loaded.checkpoint is None else loaded.checkpoint.root,
                    path, folder_step)
    return Measured(
        total_norm=float(grouped.total.norm[0]),
        nonfinite=nonfinite_counts(grouped.total)[0],
        groups=dict(zip(grouped.names, grouped.groups.norm.tolist())),
        step=step.step,
        what=loaded.selection.what,
        step_note=step.note,
        optimizer=loaded.selection.optimizer,
    )  # fmt: skip


def _logged_observations(path: Path, entries: list) -> list[Observation]:
    return [
        Observation(
            source=str(path), step=entry.step, total_norm=entry.total_norm,
            groups=dict(entry.groups),
            nonfinite=None if entry.nonfinite is None else NonFinite(*entry.nonfinite),
            what=LOGGED_WHAT, nonfinite_origin=entry.nonfinite_origin,
        )  # fmt: skip
        for entry in entries
    ]

