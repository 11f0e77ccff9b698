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

from dataclasses import replace
from pathlib import Path

from .. import options, values
from ..distributed import launcher
from ..errors import UsageError
from ..format.text import visible
from ..progress import Steps, progress_steps
from ..report import parse_group_by
from ..report.outcome import exit_code
from ..report.trend import (
    LOGGED_GROUPS,
    LOGGED_WHAT,
    Observation,
    OneKind,
    build_trend_report,
    found_in_runs,
    logged_observations,
    monitor_clipping_notes,
    one_norm_type,
    one_optimizer,
    one_point_per_step,
    order_by_step,
)
from ..source import run_inputs
from ..source.exclude import Exclusion
from ..source.logs import LogKind, trackers
from ..source.run_folder import RunFolder
from .common import load, speaks, tag_read
from .grouped import (
    MeasureOptions,
    ReadNotes,
    measurable,
    measure_grouped,
    why_not_checkpoint,
)
from .norm_audit import norm_audits
from .output import Output

DEFAULT_GROUP_BY = "layer"


def run(
    *, paths: list[Path], what: str, group_by: str | None, z: float | None, alpha: float | None,
    warmup: int | None, fail_on: str, plot: Path | None, key: str | None,
    norm_type: str | None, device: str, format: str, trust_pickle: bool, verify: bool,
    quiet: bool, output_file: Path | None, progress: bool = True,
    tag: str | None = None, run_name: str | None = None, exclude: tuple[str, ...] = (),
) -> int:
    output = Output.of(format, output_file, quiet=quiet, reads=paths,
                       writes=[plot] if plot is not None else [])
    if plot is not None:  # before any checkpoint is read: a wrong suffix is exit 2
        values.plot_file(str(plot))
    report = build(paths=paths, what=what, group_by=group_by, z=z, alpha=alpha, warmup=warmup,
                   fail_on=fail_on, key=key, norm_type=norm_type, device=device,
                   trust_pickle=trust_pickle, verify=verify,
                   progress=progress and not quiet, output=output,
                   tag=tag, run_name=run_name, exclude=exclude)
    output.emit(report, then=None if plot is None else lambda: _plot(report, plot))
    return exit_code(report)


def _plot(report, plot: Path) -> None:
    from ..format.plot import write_trend_plot

    write_trend_plot(report, plot)


def build(
    *, paths: list[Path], what: str, group_by: str | None, z: float | None,
    alpha: float | None, warmup: int | None, fail_on: str, key: str | None,
    norm_type: object, device: str, trust_pickle: bool, verify: bool, progress: bool,
    output: Output | None = None, launched: bool = True,
    tag: str | None = None, run_name: str | None = None, exclude: tuple[str, ...] = (),
):
    """The ``TrendReport`` of ``paths`` (``report/trend.py``), which every format renders.

    ``group_by`` None: each log's own groups and ``layer`` for checkpoints.
    ``tag``, ``run_name``, ``exclude``: ``--tag``, ``--run``, ``--exclude``.
    ``output``: where the report goes, checked against every file a layout reads.
    ``launched``: under a launcher (``torchrun``) the ranks share each
    checkpoint, as the command does; the Python API passes False.
    """
    options.what(what)
    fail_on = options.fail_on(fail_on)
    z, alpha, warmup = options.spike_rule(z, alpha, warmup)
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
    exclusion = Exclusion(tuple(exclude))
    # What --verify could not check in each checkpoint read: a refusal at a later input,
    # or after all were read, says it too.
    read = ReadNotes()
    with progress_steps(not progress or not speaks()) as steps, read.carried():
        inputs, runs, logs = _inputs(paths, what, key, trust_pickle, steps, tag, run_name,
                                     exclusion)
        if logs and regroup:
            raise UsageError(
                f"{logs[0][0]}: --group-by groups a checkpoint's tensors; a "
                "norm log holds the norms of the groups it was written with (GradMonitor's "
                "group_by), which cannot be grouped again: leave --group-by out")
        tagged = tag_read(inputs)  # the points are the values of a tag --tag named
        p, logs, cut = one_norm_type(requested_p, logs)
        how = MeasureOptions(key, p, dev, rule, group_by, trust_pickle, verify, session, what)
        checkpoints = [i.path for i in inputs if not isinstance(i.kind, LogKind)]
        kinds = OneKind(what, "trend", lambda: measurable(checkpoints, key, trust_pickle))
        for path, _ in logs:
            kinds.check(str(path), LOGGED_WHAT, logged=True)
        observations: list[Observation] = []
        step_notes: list[str] = []
        optimizers: set[str | None] = set()
        logged = dict(logs)
        for item in inputs:
            if isinstance(item.kind, LogKind):
                observations += logged_observations(item.path, logged[item.path])
                continue
            with read.carried(item.path):
                # One at a time: loading checkpoint i+1 on a thread while i was
                # measured made trend slower, not faster (BENCHMARKS.md, "trend").
                loaded = load(item.path, how.key, how.trust_pickle, how.verify, steps,
                              how.what)
                read.add(item.path, loaded.contents.notes)
                if output is not None:
                    output.check(reads=loaded.contents.files)
                kinds.check(str(item.path), loaded.selection.what,  # before measuring it
                            explain=loaded.selection.explain)
                m = measure_grouped(loaded, item.path, how, steps, item.folder_step)
            del loaded  # its mapping goes before the next checkpoint is opened
            optimizers.add(m.optimizer)
            if m.step_note is not None:
                step_notes.append(f"{visible(str(item.path))}: {m.step_note}")
            observations.append(Observation(
                source=str(item.path), step=m.step, total_norm=m.total_norm,
                groups=m.groups, nonfinite=m.nonfinite, what=m.what))
    with read.carried():  # refused after reading (two runs' norms at one step)
        observations, copies = one_point_per_step(observations)
        found = found_in_runs(runs)
        # Notes are escaped where made (each name through visible()), as inspect's are;
        # every format shows them as they are (kept_visible), adding only its own quoting.
        found["notes"] += [] if tagged is None or tagged.note() is None else [tagged.note()]
        found["notes"] += (cut + read.notes + step_notes + copies + exclusion.notes()
                           + monitor_clipping_notes(logs, runs))
        if logs:
            group_by = (LOGGED_GROUPS if len(logs) == len(inputs)
                        else f"{group_by} (checkpoints), {LOGGED_GROUPS} (logs)")
        audits = norm_audits(runs, [(item.path, item.kind, logged[item.path])
                                    for item in inputs if isinstance(item.kind, LogKind)])
        report = build_trend_report(
            order_by_step(observations), what=kinds.what, norm_type=p, group_by=group_by,
            z=z, alpha=alpha, warmup=warmup, fail_on=fail_on, audits=audits, **found,
        )  # fmt: skip
    return replace(report, optimizer=one_optimizer(optimizers), tag=tagged)


def _inputs(paths: list[Path], what: str, key: str | None, trust_pickle: bool, steps: Steps,
            tag: str | None, run_name: str | None, exclusion: Exclusion
            ) -> tuple[list[run_inputs.Input], list[RunFolder], list[tuple[Path, list]]]:
    """Every checkpoint and log the paths stand for, each once; the run folders found
    (their series, for the report); each log's entries, read."""
    runs: list[RunFolder] = []
    choice = trackers.Choice(tag, run_name)
    inputs = run_inputs.once([
        item for path in run_inputs.kept(paths, exclusion)
        for item in run_inputs.expand(
            path, lambda p: why_not_checkpoint(p, key, trust_pickle, steps), what=what,
            runs=runs, choice=choice, exclusion=exclusion)])
    if (tag is not None or run_name is not None) and not any(
            s.tracker is not None for r in runs for s in r.series):
        flag = "--tag" if tag is not None else "--run"
        raise UsageError(f"{flag} picks from a tracker's files (TensorBoard, MLflow, "
                         "trackio, W&B, metrics.csv); no input is one")
    logs = [(item.path, item.kind.read(item.path) if item.entries is None
             else list(item.entries)) for item in inputs if isinstance(item.kind, LogKind)]
    return inputs, runs, logs
