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

The report data is ``report/autopsy.py``; the gradient of a step comes from
``gradients_at``, the one place that knows which inputs hold one: a monitor
dump of that step, else the two checkpoints of that step and the one before,
whose Adam states determine it (``source/previous.py``, as ``inspect --previous``).

Under ``torchrun`` each checkpoint's norms are split across ranks as
``trend`` splits them (``measure_loaded`` with the session); the outlier
count reads two checkpoints whole on every rank (it is elementwise over one
gradient, a small part of the work) and rank 0 alone reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import options, values
from ..core.outliers import adam_outliers
from ..core.spikes import DEFAULT_ALPHA, DEFAULT_WARMUP, DEFAULT_Z
from ..distributed import launcher
from ..errors import InputError, UsageError
from ..format.text import visible
from ..progress import progress_steps
from ..report import parse_group_by
from ..report.autopsy import (
    CHECKPOINTS,
    DUMPS,
    EXPLAINED,
    LOG,
    InputUsed,
    Outliers,
    QuantitySeries,
    build_autopsy_report,
    finest,
    flagged_steps,
    judge,
)
from ..report.groups import group_sums
from ..report.trend import Observation, one_point_per_step
from ..source import run_folder
from ..source.exclude import Exclusion
from ..source.layouts import accelerate_fsdp, open_checkpoint
from ..source.logs import monitor_log, trackers
from ..source.logs.recognise import log_kind
from ..source.previous import gradients_between
from ..source.what import available, select
from . import trend
from .common import Loaded, emit, load, measure_weights, output_format, speaks

DEFAULT_WINDOW = 50
DEFAULT_OUTLIER_K = 6.0
GROUP_BY = "layer"  # as GradMonitor groups by default, so checkpoints' groups meet the log's
# A dump and the log line of its step measure the same gradients (the monitor's
# float64-accurate norms, written as JSON floats): beyond this they are two runs.
SAME_GRADIENTS = 1e-4


@dataclass
class _Read:
    """What the inputs hold, before steps are placed."""

    logs: list[tuple] = field(default_factory=list)  # (file, LoggedNorms, LogKind)
    points: list[_CheckpointPoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class _CheckpointPoint:
    path: Path
    step: int | None
    gradients: bool  # holds saved gradients: a dump, numbered as the monitor numbers steps
    measured: dict[str, tuple[float, dict[str, float]]]  # what -> (total, groups)
    shapes: dict[str, tuple[int, ...]]  # parameter -> shape, for the same-run check


def run(
    *, paths: list[Path], step: int | None, window: int | None, outlier_k: float | None,
    plot: Path | None, key: str | None, device: str, format: str, trust_pickle: bool,
    verify: bool, quiet: bool, output_file: Path | None, progress: bool = True,
    z: float | None = None, alpha: float | None = None, warmup: int | None = None,
    tag: str | None = None, run_name: str | None = None, exclude: tuple[str, ...] = (),
) -> int:
    options.report_file(output_file, reads=paths, writes=[plot] if plot is not None else [])
    fmt = output_format(format)
    if not hasattr(fmt, "render_autopsy"):
        raise UsageError(f"--format {format}: autopsy writes table, json, markdown, github "
                         "or junit")
    if plot is not None:
        values.plot_file(str(plot))
    report = build(paths=paths, step=step, window=window, outlier_k=outlier_k, key=key,
                   device=device, trust_pickle=trust_pickle, verify=verify,
                   progress=progress and not quiet, output_file=output_file, z=z,
                   alpha=alpha, warmup=warmup, tag=tag, run_name=run_name, exclude=exclude)
    if plot is not None and speaks():
        from ..format.plot import write_autopsy_plot

        write_autopsy_plot(report, plot)
    if quiet and format == "table":
        from ..format import table

        emit(lambda out: table.print_autopsy_verdict(report, out), output_file)
    else:
        emit(lambda out: fmt.render_autopsy(report, out), output_file)
    return 1 if report.status == EXPLAINED else 0


def build(
    *, paths: list[Path], step: int | None, window: int | None, outlier_k: float | None,
    key: str | None, device: str, trust_pickle: bool, verify: bool, progress: bool,
    output_file: Path | None = None, z: float | None = None, alpha: float | None = None,
    warmup: int | None = None, tag: str | None = None, run_name: str | None = None,
    exclude: tuple[str, ...] = (), launched: bool = True,
):
    """The ``AutopsyReport`` of ``paths`` (``report/autopsy.py``), which every format
    renders. ``launched``: under a launcher (``torchrun``) the ranks share each
    checkpoint's norms, as the command does; the Python API passes False."""
    window = DEFAULT_WINDOW if window is None else values.whole("--window", window, least=1)
    outlier_k = DEFAULT_OUTLIER_K if outlier_k is None else \
        values.threshold("--outlier-k", outlier_k, allow_zero=False)
    if step is not None:
        step = values.whole("--step", step, least=0)
    z = DEFAULT_Z if z is None else z
    alpha = DEFAULT_ALPHA if alpha is None else alpha
    warmup = DEFAULT_WARMUP if warmup is None else warmup
    dev = options.device(device)
    session = launcher.join(dev, device, paths) if launched else None
    if session is not None:
        dev = session.device
    rule = parse_group_by(GROUP_BY)
    how = trend.Measurement(key, 2.0, dev, rule, GROUP_BY, trust_pickle, verify, session)
    with progress_steps(not progress or not speaks()) as steps:
        read = _read_inputs(paths, how, steps, output_file, trackers.Choice(tag, run_name),
                            Exclusion(tuple(exclude)))
        series, inputs, notes, placed = _series(read)
        main = finest(series)
        explained = _explained_step(main, step, series, z, alpha, warmup)
        outliers = {}
        if explained is not None:
            outliers, outlier_notes = _outliers(explained, placed, how, steps, outlier_k, rule)
            notes += outlier_notes
    return build_autopsy_report(
        series, step=explained, window=window, outlier_k=outlier_k,
        z=z, alpha=alpha, warmup=warmup, outliers=outliers, notes=notes, inputs=inputs)


# -- reading ---------------------------------------------------------------------------


def _read_inputs(paths: list[Path], how: trend.Measurement, steps, output_file,
                 choice: trackers.Choice, exclusion: Exclusion) -> _Read:
    read = _Read()
    inputs = trend._once([item for path in trend._kept(paths, exclusion)
                          for item in _expand(path, how, steps, choice, exclusion)])
    read.notes += exclusion.notes()
    for item in inputs:
        if item.kind is not None:
            entries = item.kind.read(item.path) if item.entries is None else list(item.entries)
            read.logs.append((item.path, entries, item.kind))
            continue
        point = _read_checkpoint(item, how, steps)
        options.report_file(output_file, reads=[item.path])
        read.points.append(point)
    if not read.logs and not read.points:
        raise InputError(f"{visible(str(paths[0]))}: no checkpoint or norm log to read")
    return read


def _expand(path: Path, how: trend.Measurement, steps, choice: trackers.Choice,
            exclusion: Exclusion):
    """The inputs ``path`` stands for: every series of a run folder (its numbered
    checkpoints, its logs, its trackers' series, the checkpoint files in its other
    folders, such as the monitor's ``spikes/``), where ``trend`` keeps only the one it
    judges; a tracker's file (``--tag``, ``--run`` as ``trend`` takes them)."""

    def why_not(p: Path) -> str | None:
        return trend._loads(p, how.key, how.trust_pickle, steps)

    if not path.is_dir():
        tracked = run_folder.tracker_file(path, choice)
        if tracked is None:
            yield trend.Input(path, log_kind(path))
        else:
            yield trend.Input(tracked.judged.paths[0], tracked.judged.log, None,
                              tracked.judged.entries)
        return
    if accelerate_fsdp.recognises(path) or why_not(path) is None:
        yield trend.Input(path)
        return
    found_run = run_folder.discover(path, "auto", choice, exclusion)
    for series in () if found_run is None else found_run.series:
        if series.kind == run_folder.TRACKER:
            yield trend.Input(series.paths[0], series.log, None, series.entries)
    numbered = run_folder.numbered_folders(path, exclusion)
    for number, child in numbered:
        yield from trend._expand(child, why_not, number)
    found = False
    for child in exclusion.keep(trend._children(path)):
        if child.is_file():
            kind = log_kind(child)
            if kind is not None or trend._is_checkpoint_file(child):
                found = True
                yield trend.Input(child, kind)
        elif child.is_dir() and child not in {c for _, c in numbered}:
            for inner in exclusion.keep(trend._children(child)):
                if inner.is_file() and (log_kind(inner) is not None
                                        or trend._is_checkpoint_file(inner)):
                    found = True
                    yield trend.Input(inner, log_kind(inner))
    if not numbered and not found:
        raise InputError(f"{visible(str(path))}: neither a checkpoint nor a folder of "
                         "checkpoints, trainer_state.json or gradclip monitor logs")


def _read_checkpoint(item: trend.Input, how: trend.Measurement, steps) -> _CheckpointPoint:
    """Every quantity the checkpoint determines, grouped; its parameters' shapes."""
    contents = open_checkpoint(item.path, key=how.key, trust_pickle=how.trust_pickle,
                               verify=how.verify)
    measured: dict[str, tuple[float, dict[str, float]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    step = None
    quantities = available(contents)
    if not quantities:
        raise InputError(f"{visible(str(item.path))}: holds no gradients, optimizer state or "
                         "weights that gradclip measures")
    for what in quantities:
        selection = select(contents, what)
        loaded = Loaded(contents, selection, selection.elements if what == "grads" else None)
        m = trend.measure_loaded(loaded, item.path, how, steps, item.folder_step)
        step = m.step
        measured[what] = (m.total_norm, m.groups)
        for name, t in zip(selection.names, selection.tensors):
            shapes.setdefault(name, tuple(t.shape))
        if what == "update":
            ratio = _update_to_weights(loaded, how, m)
            if ratio is not None:
                measured["update_to_weights"] = ratio
    return _CheckpointPoint(item.path, step, "grads" in measured, measured, shapes)


def _update_to_weights(loaded: Loaded, how: trend.Measurement, update: trend.Measured):
    """Each group's update RMS over its weights' RMS (the same parameters, so the same
    element count: the ratio of their 2-norms); None where the weights are not all held."""
    sums = measure_weights(loaded, 2.0, how.device, None, how.session)
    if sums is None:
        return None
    grouped = group_sums([how.group_rule(n) for n in loaded.names], sums)
    weights = dict(zip(grouped.names, grouped.groups.norm.tolist()))
    total_w = float(grouped.total.norm[0])
    from ..report.autopsy import ratio

    groups = {g: ratio(weights[g], u) for g, u in update.groups.items() if g in weights}
    return ratio(total_w, update.total_norm), groups


# -- placing steps and making series --------------------------------------------------------


def _offset(logs) -> tuple[int, str | None]:
    """How many steps a checkpoint's count of optimizer steps is ahead of the log's numbers:
    1 when a monitor log counts from 0, else 0; and the note that says so."""
    for path, entries, kind in logs:
        if kind is monitor_log.KIND and entries:
            first = entries[0].step
            if first == 0:
                return 1, (f"steps: {visible(str(path))} counts from 0 (its first step), so a "
                           "checkpoint of step N (the state after N optimizer steps) is placed "
                           "at step N-1, the step whose gradient it took in last")
            if first == 1:
                return 0, (f"steps: {visible(str(path))} counts from 1 (its first step), so "
                           "a checkpoint of step N (the state after N optimizer steps) is "
                           "placed at step N")
            return 0, (f"steps: {visible(str(path))} starts at step {first}, which says "
                       "nothing of how it counts (a monitor attached mid-run?): checkpoints "
                       "are placed at their own step numbers")
    return 0, None


def _series(read: _Read):
    """The quantity series (steps placed), the inputs used, notes, and the checkpoints by
    placed step (for the outlier count)."""
    offset, note = _offset(read.logs)
    notes = [note] if note else []
    inputs: list[InputUsed] = []
    series: list[QuantitySeries] = []
    for path, entries, kind in read.logs:
        steps_ = [e.step for e in entries]
        if any(s is None for s in steps_):
            raise UsageError(f"{visible(str(path))}: an entry without a step; the autopsy "
                             "places every point at its step")
        shift = offset if kind is not monitor_log.KIND else 0
        inputs.append(InputUsed(str(path), "grads", tuple(s - shift for s in steps_)))
    # Every log of one kind is one series (two logs of one run's steps agree; of two runs,
    # one_point_per_step refuses them, naming both).
    for kind in {k for _, _, k in read.logs}:
        observations = [Observation(str(p), e.step - (offset if k is not monitor_log.KIND
                                                      else 0), e.total_norm, dict(e.groups),
                                    None if e.nonfinite is None else _nonfinite(e.nonfinite))
                        for p, entries, k in read.logs if k is kind for e in entries]
        observations, copies = one_point_per_step(sorted(observations, key=lambda o: o.step))
        notes += copies
        files = sorted({p for p, _, k in read.logs if k is kind})
        label = visible(str(files[0])) + (f" and {len(files) - 1} more" if len(files) > 1
                                          else "")
        series.append(QuantitySeries("grads", LOG, label, tuple(observations)))
    placed: dict[int, list[_CheckpointPoint]] = {}
    by_quantity: dict[tuple[str, str], list[Observation]] = {}
    first_shapes: tuple[Path, dict] | None = None
    for point in read.points:
        if point.step is None:
            raise UsageError(f"{visible(str(point.path))}: no step (none recorded, no number "
                             "in its name); the autopsy places every input at its step")
        first_shapes = _same_parameters(point, first_shapes)
        at = point.step if point.gradients else point.step - offset
        placed.setdefault(at, []).append(point)
        kind = DUMPS if point.gradients else CHECKPOINTS
        for what, (total, groups) in point.measured.items():
            by_quantity.setdefault((what, kind), []).append(
                Observation(str(point.path), at, total, dict(groups), None, what))
            inputs.append(InputUsed(str(point.path), what, (at,)))
    for (what, kind), observations in by_quantity.items():
        observations, copies = one_point_per_step(sorted(observations, key=lambda o: o.step))
        notes += copies
        sources = [o.source for o in observations]
        label = visible(sources[0]) if len(sources) == 1 else \
            f"{visible(sources[0])} .. {visible(sources[-1])} ({len(sources)} {kind})"
        series.append(QuantitySeries(what, kind, label, tuple(observations)))
    _same_gradients(series)
    _same_groups(series)
    return series, inputs, notes, placed


def _nonfinite(counts):
    from ..report import NonFinite

    return NonFinite(*counts)


def _same_parameters(point: _CheckpointPoint, first: tuple[Path, dict] | None):
    """Every checkpoint holds the same parameters: a name both hold has one shape, and
    they share some. Else exit 3 naming both files: no ranking over two models."""
    if first is None:
        return (point.path, point.shapes)
    path0, shapes0 = first
    shared = shapes0.keys() & point.shapes.keys()
    if not shared:
        raise InputError(f"{visible(str(point.path))}: none of its parameters is one of "
                         f"{visible(str(path0))}'s: not one run's checkpoints")
    for name in sorted(shared):
        if shapes0[name] != point.shapes[name]:
            raise InputError(
                f"{visible(str(point.path))}: parameter {visible(name)} has shape "
                f"{list(point.shapes[name])}, but {list(shapes0[name])} in "
                f"{visible(str(path0))}: not one run's checkpoints")
    return first


def _same_gradients(series: list[QuantitySeries]) -> None:
    """A dump and the log line of its step hold the same gradients (the monitor wrote
    both); other norms there mean two runs: exit 2 naming the dump."""
    logs = [s for s in series if s.kind == LOG and s.what == "grads" and s.per_group]
    dumps = [s for s in series if s.kind == DUMPS]
    for log in logs:
        for dump in dumps:
            for o in dump.observations:
                logged = log.at(o.step)
                if logged is None:
                    continue
                if not _close(o.total_norm, logged.total_norm):
                    raise UsageError(
                        f"{visible(o.source)}: its gradients' norm {o.total_norm:.6g} is not "
                        f"the {logged.total_norm:.6g} that {visible(logged.source)} logs at "
                        f"step {o.step}: not one run's; give one run's inputs")


def _close(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= SAME_GRADIENTS * max(abs(a), abs(b))


def _same_groups(series: list[QuantitySeries]) -> None:
    """Per-group series of one run share their groups; none in common is two models."""
    grouped = [s for s in series if s.per_group]
    for s in grouped[1:]:
        a = {g for o in grouped[0].observations for g in o.groups}
        b = {g for o in s.observations for g in o.groups}
        if not a & b:
            raise UsageError(f"{s.label}: none of its groups is one of {grouped[0].label}'s "
                             f"({', '.join(sorted(a)[:3])}, ...): not one run's inputs")


# -- the step explained -------------------------------------------------------------------


def _explained_step(main: QuantitySeries, step: int | None, series, z, alpha, warmup
                    ) -> int | None:
    """The step given (checked against the inputs), else the newest flagged step."""
    steps = main.steps
    if step is None:
        flagged = flagged_steps(judge(main, z, alpha, warmup))
        return flagged[-1] if flagged else None
    if step not in steps:
        low = min(s for q in series for s in q.steps)
        high = max(s for q in series for s in q.steps)
        if not low <= step <= high:
            raise UsageError(f"--step {step}: outside the inputs ({main.label} holds steps "
                             f"{steps[0]}-{steps[-1]}; all inputs {low}-{high})")
        raise UsageError(f"--step {step}: not a step of {main.label}, the finest series "
                         f"(steps {steps[0]}-{steps[-1]}), whose steps are explained")
    return step


# -- outliers: the gradient of a step against Adam's second moment of the step before ----


def gradients_at(step: int, placed: dict[int, list], how: trend.Measurement, steps,
                 why_not: list[str] | None = None
                 ) -> tuple[dict[str, torch.Tensor], str] | None:
    """The gradients of ``step`` by parameter name, and the input they come from; None
    when no input holds them (the reasons a pair of states did not go to ``why_not``).

    A monitor dump of that step (``save_grads``'s file), else two checkpoints whose
    Adam-family states are of that step and the one before: they determine the
    gradient the optimizer used (``source/previous.py``, as ``inspect --previous``).
    """
    for point in placed.get(step, []):
        if point.gradients:
            loaded = load(point.path, how.key, how.trust_pickle, how.verify, steps, "grads")
            return ({n: t.read() for n, t in zip(loaded.names, loaded.tensors)},
                    visible(str(point.path)))
    states = [[p for p in placed.get(s, []) if "exp_avg" in p.measured] for s in (step, step - 1)]
    for curr in states[0]:
        for prev in states[1]:
            found = gradients_between(*(
                open_checkpoint(p.path, key=how.key, trust_pickle=how.trust_pickle,
                                verify=how.verify) for p in (curr, prev)))
            if found.gradients is not None:
                return ({n: g for n, g in found.gradients.items()},
                        f"the gradients reconstructed from {visible(str(prev.path))} and "
                        f"{visible(str(curr.path))} (their Adam states, steps apart by one)")
            if why_not is not None:
                why_not.append(found.refusal)
    return None


def second_moment_rms(step: int, placed: dict[int, list], how: trend.Measurement, steps
                      ) -> tuple[dict[str, torch.Tensor], str] | None:
    """``sqrt(v_hat)`` by parameter name from a checkpoint placed at ``step`` (its
    optimizer's own rule: ``grad_rms``), and the checkpoint; None when none holds it."""
    for point in placed.get(step, []):
        if "grad_rms" in point.measured:
            loaded = load(point.path, how.key, how.trust_pickle, how.verify, steps, "grad_rms")
            rms = {}
            for name, d in zip(loaded.names, loaded.selection.derivations):
                rms[name] = d.compute(*[t.read() for t in d.reads])
            return rms, visible(str(point.path))
    return None


def _outliers(step: int, placed, how, steps, k: float, rule):
    refused: list[str] = []
    grads = gradients_at(step, placed, how, steps, refused)
    if grads is None:
        return {}, [f"outliers: no gradient of step {step} among the inputs (a monitor dump "
                    "of that step holds one, or checkpoints of that step and the one before "
                    "with Adam's state)", *(f"outliers: {why}" for why in refused)]
    moment = second_moment_rms(step - 1, placed, how, steps)
    if moment is None:
        return {}, [f"outliers: no optimizer state of step {step - 1} (the step before) "
                    "among the inputs: save a checkpoint there to count them"]
    (g, g_source), (rms, m_source) = grads, moment
    counts: dict[str, list[int]] = {}
    for name, tensor in g.items():
        if name not in rms or tuple(rms[name].shape) != tuple(tensor.shape):
            continue
        c = counts.setdefault(rule(name), [0, 0])
        c[0] += adam_outliers(tensor, rms[name], k)
        c[1] += tensor.numel()
    if not counts:
        return {}, [f"outliers: {g_source} and {m_source} name no parameter alike"]
    return ({group: Outliers(c, n, g_source, m_source) for group, (c, n) in counts.items()},
            [])
