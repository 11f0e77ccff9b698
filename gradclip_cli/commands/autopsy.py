"""``gradclip autopsy``: from "a spike at step S" to "it began in layer L, this way".

The same inputs as ``trend`` (run folders, checkpoints, monitor logs, dumps,
``trainer_state.json``), all of them read at every grain they hold, where
``trend`` judges one series: the monitor log every step per group; each
checkpoint once per quantity its layout determines (the ``--what``
selection of ``source/what.py``: ``grads``, ``exp_avg``, ``grad_rms``,
``update``, ``weights``, measured as ``inspect`` measures them, and
``update_to_weights`` from the update and the same parameters' weights);
the monitor's dumps (gradients saved at a spike). No layout is known here
by name: a checkpoint gives whatever the selection finds in it.

Steps. A monitor log and its dumps number steps as the training loop called
the monitor; a checkpoint records the optimizer steps taken (a Trainer's
``checkpoint-N``, Lightning's ``global_step``), so it holds the state after
the gradient of the step the log numbers ``N`` when the log counts from 1
(the Trainer's callback), ``N - 1`` when it counts from 0 (Lightning's
callback, a loop's ``enumerate``). The log's first step says which; the
report says how each checkpoint was placed.

The report data is ``report/autopsy.py``, its series placed by
``report/autopsy_series.py``; the outlier count reads the gradient of the
step and the moment of the step before (``outliers.py``).

Under ``torchrun`` each checkpoint's norms are split across ranks as
``trend`` splits them (``grouped.measure_grouped`` with the session); the
outlier count reads two checkpoints whole on every rank and rank 0 alone
reports.
"""

from __future__ import annotations

from pathlib import Path

from .. import options, values
from ..distributed import launcher
from ..errors import InputError
from ..format.text import visible
from ..progress import progress_steps
from ..report import parse_group_by
from ..report.autopsy import build_autopsy_report, finest, ratio
from ..report.autopsy_series import (
    CheckpointPoint,
    explained_step,
    series_of,
    undetermined_notes,
)
from ..report.outcome import exit_code
from ..report.tag import TagRead
from ..report.trend import mixed_norm_types
from ..source import run_inputs
from ..source.exclude import Exclusion
from ..source.layouts import open_checkpoint
from ..source.logs import trackers
from ..source.optimizers import QUANTITIES as OPTIMIZER_QUANTITIES
from ..source.what import available, select, undetermined
from .common import Loaded, speaks, tag_read
from .grouped import MeasureOptions, ReadNotes, measure_grouped, why_not_checkpoint
from .outliers import count_outliers
from .output import Output

DEFAULT_WINDOW = 50
DEFAULT_OUTLIER_K = 6.0
GROUP_BY = "layer"  # as GradMonitor groups by default, so checkpoints' groups meet the log's


def run(
    *, paths: list[Path], step: int | None, window: int | None, outlier_k: float | None,
    plot: Path | None, key: str | None, device: str, format: str, trust_pickle: bool,
    verify: bool, quiet: bool, output_file: Path | None, progress: bool = True,
    z: float | None = None, alpha: float | None = None, warmup: int | None = None,
    tag: str | None = None, run_name: str | None = None, exclude: tuple[str, ...] = (),
) -> int:
    output = Output.of(format, output_file, quiet=quiet, reads=paths,
                       writes=[plot] if plot is not None else [])
    if plot is not None:
        values.plot_file(str(plot))
    report = build(paths=paths, step=step, window=window, outlier_k=outlier_k, key=key,
                   device=device, trust_pickle=trust_pickle, verify=verify,
                   progress=progress and not quiet, output=output, z=z,
                   alpha=alpha, warmup=warmup, tag=tag, run_name=run_name, exclude=exclude)
    # The autopsy's verdict is a paragraph: a report file gets no line on stderr.
    output.emit(report, verdict=False,
                then=None if plot is None else lambda: _plot(report, plot))
    return exit_code(report)


def _plot(report, plot: Path) -> None:
    from ..format.plot import write_autopsy_plot

    write_autopsy_plot(report, plot)


def build(
    *, paths: list[Path], step: int | None, window: int | None, outlier_k: float | None,
    key: str | None, device: str, trust_pickle: bool, verify: bool, progress: bool,
    output: Output | None = None, z: float | None = None, alpha: float | None = None,
    warmup: int | None = None, tag: str | None = None, run_name: str | None = None,
    exclude: tuple[str, ...] = (), launched: bool = True,
):
    """The ``AutopsyReport`` of ``paths`` (``report/autopsy.py``), which every format
    renders. ``output``: where the report goes, checked against every checkpoint read.
    ``launched``: under a launcher (``torchrun``) the ranks share each checkpoint's
    norms, as the command does; the Python API passes False."""
    window = DEFAULT_WINDOW if window is None else values.whole("--window", window, least=1)
    outlier_k = DEFAULT_OUTLIER_K if outlier_k is None else \
        values.threshold("--outlier-k", outlier_k, allow_zero=False)
    if step is not None:
        step = values.whole("--step", step, least=0)
    z, alpha, warmup = options.spike_rule(z, alpha, warmup)
    dev = options.device(device)
    session = launcher.join(dev, device, paths) if launched else None
    if session is not None:
        dev = session.device
    rule = parse_group_by(GROUP_BY)
    how = MeasureOptions(key, 2.0, dev, rule, GROUP_BY, trust_pickle, verify, session)
    exclusion = Exclusion(tuple(exclude))
    # What --verify could not check in each checkpoint read: a refusal at a later input,
    # or after all were read, says it too.
    read = ReadNotes()
    with progress_steps(not progress or not speaks()) as steps, read.carried():
        logs, points, tagged = _read_inputs(paths, how, steps, output,
                                            trackers.Choice(tag, run_name), exclusion, read)
        # Notes are escaped where made (each name through visible()), as inspect's and
        # trend's are; every format shows them as they are (kept_visible).
        series, inputs, notes, placed = series_of(logs, points)
        notes = read.notes + notes  # --verify's gaps
        notes += exclusion.notes()  # what --exclude left out, as trend says it
        main = finest(series)
        # The values of a tag --tag named, where they are the series explained.
        if tagged is not None and main.label not in tagged.sources:
            tagged = None
        if tagged is not None and tagged.note() is not None:
            notes.append(tagged.note())
        explained = explained_step(main, step, series, z, alpha, warmup)
        outliers = {}
        if explained is not None:
            notes += undetermined_notes(explained, placed)
            outliers, outlier_notes = count_outliers(explained, placed, how, steps, outlier_k,
                                                     rule)
            notes += outlier_notes
    return build_autopsy_report(
        series, step=explained, window=window, outlier_k=outlier_k,
        z=z, alpha=alpha, warmup=warmup, outliers=outliers, notes=notes, inputs=inputs,
        tag=tagged)


# -- reading ---------------------------------------------------------------------------


def _read_inputs(paths: list[Path], how: MeasureOptions, steps, output: Output | None,
                 choice: trackers.Choice, exclusion: Exclusion, read: ReadNotes
                 ) -> tuple[list[tuple], list[CheckpointPoint], TagRead | None]:
    """The norm logs (``(file, entries, LogKind)`` each) and the checkpoints, measured;
    each checkpoint's notes in ``read``; the tag ``--tag`` named, where a log holds its
    values (``tag_read``)."""
    logs, points = [], []
    inputs = run_inputs.once([
        item for path in run_inputs.kept(paths, exclusion)
        for item in run_inputs.expand_every(
            path, lambda p: why_not_checkpoint(p, how.key, how.trust_pickle, steps), choice,
            exclusion)])
    tagged = tag_read(inputs)
    for item in inputs:
        if item.kind is not None:
            entries = item.kind.read(item.path) if item.entries is None else list(item.entries)
            if (mixed := mixed_norm_types(entries)) is not None:
                # The jump where p changes is no spike of the gradients.
                raise InputError(f"{item.path}: {mixed}; autopsy reads one kind of norm: "
                                 "give it the lines of one p in a file of their own")
            logs.append((item.path, entries, item.kind))
            continue
        with read.carried(item.path):
            point = _read_checkpoint(item, how, steps, read)
            if output is not None:
                output.check(reads=[item.path])
        points.append(point)
    if not logs and not points:
        raise InputError(f"{paths[0]}: no checkpoint or norm log to read")
    return logs, points, tagged


def _read_checkpoint(item: run_inputs.Input, how: MeasureOptions, steps, read: ReadNotes
                     ) -> CheckpointPoint:
    """Every quantity the checkpoint determines, grouped; its parameters' shapes. Its
    notes go in ``read`` once it is open."""
    contents = open_checkpoint(item.path, key=how.key, trust_pickle=how.trust_pickle,
                               verify=how.verify)
    read.add(item.path, contents.notes)
    measured: dict[str, tuple[float, dict[str, float]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    step = None
    quantities = available(contents)
    if not quantities:
        raise InputError(f"{item.path}: holds no gradients, optimizer state or "
                         "weights that gradclip measures")
    for what in quantities:
        selection = select(contents, what)
        loaded = Loaded(contents, selection, selection.elements if what == "grads" else None)
        m = measure_grouped(loaded, item.path, how, steps, item.folder_step,
                            weights=what == "update")
        step = m.step
        measured[what] = (m.total_norm, m.groups)
        for name, t in zip(selection.names, selection.tensors):
            shapes.setdefault(name, tuple(t.shape))
        if m.weights is not None:
            # Each group's update RMS over its weights' RMS (the same parameters, so the
            # same element count: the ratio of their 2-norms).
            total_w, weights = m.weights
            measured["update_to_weights"] = (
                ratio(total_w, m.total_norm),
                {g: ratio(weights[g], u) for g, u in m.groups.items() if g in weights})
    # A quantity its optimizer's rule gives that this checkpoint's state does not (a
    # param group's stored lr 0 at a schedule's end): no change is stated across it, and
    # the note says why, where a 0 would have read as "update 0x".
    unmeasured = []
    for what in OPTIMIZER_QUANTITIES:
        if what not in quantities and (why := undetermined(contents, what)) is not None:
            also = " and update_to_weights" if what == "update" else ""
            why = why.removeprefix(f"{item.path}: ")  # the note names its input
            unmeasured.append(visible(f"{item.path}: {what}{also} not measured: {why}"))
    return CheckpointPoint(item.path, step, "grads" in measured, measured, shapes,
                           layout=contents.kind, undetermined=tuple(unmeasured))
