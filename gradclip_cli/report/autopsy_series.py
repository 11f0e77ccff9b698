"""The autopsy's series: norm logs and measured checkpoints placed at their steps.

A monitor log and its dumps number steps as the training loop called the
monitor, and so does every other norm log (the monitor's TensorBoard scalars,
its tags in a framework's loggers, a Trainer's ``trainer_state.json``, whose
steps are the callback's): logs are placed at their own steps, as ``trend``
places them. A checkpoint records the optimizer steps taken, so it holds the
state after the gradient of the step the log numbers ``N`` when the log
counts from 1, ``N - 1`` when it counts from 0 (``_offset``; a tracker's series
too: Lightning's loggers count from 0). Inputs of two
runs are refused: other parameters, other groups, or a dump whose norm is
not its step's logged one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, UsageError
from ..escaping import visible
from ..source.logs import monitor_log, trackers
from .autopsy import CHECKPOINTS, DUMPS, LOG, InputUsed, QuantitySeries, flagged_steps, judge
from .model import NonFinite
from .trend import Observation, one_point_per_step

# A dump and the log line of its step measure the same gradients (the monitor's
# float64-accurate norms, written as JSON floats): beyond this they are two runs.
SAME_GRADIENTS = 1e-4


@dataclass
class CheckpointPoint:
    """One checkpoint read: every quantity it determines, grouped, and its parameters'
    shapes."""

    path: Path
    step: int | None
    gradients: bool  # holds saved gradients: a dump, numbered as the monitor numbers steps
    measured: dict[str, tuple[float, dict[str, float]]]  # what -> (total, groups)
    shapes: dict[str, tuple[int, ...]]  # parameter -> shape, for the same-run check
    layout: str | None = None  # its layout's kind (``Contents.kind``: "lightning", ...)
    # Why a quantity its optimizer's rule gives is not measured here (a param group's
    # stored lr 0), one note each, escaped and naming the checkpoint: said where the
    # explained step's changes would have read it (``undetermined_notes``).
    undetermined: tuple[str, ...] = ()


# -- placing steps and making series --------------------------------------------------------


# How the loggers of the framework whose checkpoints these are count steps: Lightning's
# (and gradclip's Lightning callback) number a step's values by ``global_step`` before its
# update, from 0; the Trainer's (and its callback) by ``global_step`` after it, from 1.
COUNTS_FROM = {"lightning": ("Lightning", 0), "hf-trainer": ("the Trainer", 1)}


def _offset(logs, points: Sequence[CheckpointPoint] = ()) -> tuple[int, str | None]:
    """How many steps a checkpoint's count of optimizer steps is ahead of the log's numbers:
    1 when the log counts from 0, else 0; and the note that says so. A monitor log
    decides where there is one; else the first other log (a tracker's series: Lightning's
    loggers number a step's values from 0, the Trainer's integrations from 1).

    A log whose first step says nothing of how it counts (a run resumed from a
    checkpoint: Lightning's from ``step=5.ckpt`` logs 5, 6, ...; the Trainer's from
    ``checkpoint-5`` logs 6, 7, ...) counts as the framework whose checkpoints
    ``points`` are (``COUNTS_FROM``), where they are all one framework's.
    """
    ordered = sorted(logs, key=lambda log: log[2] is not monitor_log.KIND)
    for path, entries, _ in ordered:
        if entries:
            first = entries[0].step
            every = _spacing([e.step for e in entries])
            # Logged every d steps: a loop counting from 1 logs d, 2d, ... (the Trainer's
            # logging_steps); one counting from 0 logs d-1, 2d-1, ... (Lightning's
            # log_every_n_steps logs the step N with N + 1 a multiple of it).
            if first == 0 or (every > 1 and first % every == every - 1):
                how = "its first step" if first == 0 else f"its first step, one every {every}"
                return 1, (f"steps: {visible(str(path))} counts from 0 ({how}), so a "
                           "checkpoint of step N (the state after N optimizer steps) is placed "
                           "at step N-1, the step whose gradient it took in last")
            if first == 1 or (every > 1 and first % every == 0):
                how = "its first step" if first == 1 else f"its first step, one every {every}"
                return 0, (f"steps: {visible(str(path))} counts from 1 ({how}), so "
                           "a checkpoint of step N (the state after N optimizer steps) is "
                           "placed at step N")
            says_nothing = (f"steps: {visible(str(path))} starts at step {first}, which says "
                            "nothing of how it counts")
            framework = {COUNTS_FROM.get(p.layout) for p in points if not p.gradients}
            if len(framework) == 1 and None not in framework:
                (name, start), = framework
                placed = "N-1, the step whose gradient it took in last" if start == 0 else "N"
                return 1 - start, (f"{says_nothing} (a run resumed from a checkpoint?); the "
                                   f"checkpoints are {name}'s, whose loggers count from "
                                   f"{start}, so a checkpoint of step N (the state after N "
                                   f"optimizer steps) is placed at step {placed}")
            return 0, (f"{says_nothing} (a monitor attached mid-run?): checkpoints "
                       "are placed at their own step numbers")
    return 0, None


def _spacing(steps: list) -> int:
    """The steps' common spacing (the gcd of their differences); 1 where unknown."""
    found = [s for s in steps if s is not None]
    every = 0
    for a, b in zip(found, found[1:]):
        every = math.gcd(every, b - a)
    return every if every > 0 else 1


def series_of(logs: list[tuple], points: list[CheckpointPoint]):
    """The quantity series of norm logs (``(file, entries, LogKind)`` each) and measured
    checkpoints (steps placed), the inputs used, notes, and the checkpoints by placed step
    (for the outlier count)."""
    offset, note = _offset(logs, points)
    notes = [note] if note else []
    inputs: list[InputUsed] = []
    series: list[QuantitySeries] = []
    for path, entries, _ in logs:
        steps_ = [e.step for e in entries]
        if any(s is None for s in steps_):
            raise UsageError(f"{path}: an entry without a step; the autopsy "
                             "places every point at its step")
        inputs.append(InputUsed(str(path), "grads", tuple(steps_)))
    # Every log of one kind is one series (two logs of one run's steps agree; of two runs,
    # one_point_per_step refuses them, naming both). Each tracker's series is one of its
    # own: two trackers of one run (Lightning's TensorBoard and CSV loggers) keep the same
    # values at two precisions (TensorBoard's float32).
    for kind in {k for _, _, k in logs}:
        ours = [(p, entries) for p, entries, k in logs if k is kind]
        for part in [[one] for one in ours] if kind is trackers.KIND else [ours]:
            notes += _log_series(part, series)
    placed: dict[int, list[CheckpointPoint]] = {}
    by_quantity: dict[tuple[str, str], list[Observation]] = {}
    first_shapes: tuple[Path, dict] | None = None
    for point in points:
        if point.step is None:
            raise UsageError(f"{point.path}: no step (none recorded, no number "
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
        label = sources[0] if len(sources) == 1 else \
            f"{sources[0]} .. {sources[-1]} ({len(sources)} {kind})"
        series.append(QuantitySeries(what, kind, label, tuple(observations)))
    _same_gradients(series)
    _same_groups(series)
    return series, inputs, notes, placed


def _log_series(logs: list[tuple], series: list[QuantitySeries]) -> list[str]:
    """One gradient-norm series of ``logs`` (``(file, entries)`` each), appended to
    ``series``; the notes on copies of a step."""
    observations = [Observation(str(p), e.step, e.total_norm, dict(e.groups),
                                None if e.nonfinite is None else _nonfinite(e.nonfinite),
                                nonfinite_origin=getattr(e, "nonfinite_origin", None))
                    for p, entries in logs for e in entries]
    observations, copies = one_point_per_step(sorted(observations, key=lambda o: o.step))
    files = sorted({p for p, _ in logs})
    label = str(files[0]) + (f" and {len(files) - 1} more" if len(files) > 1 else "")
    series.append(QuantitySeries("grads", LOG, label, tuple(observations)))
    return copies


def _nonfinite(counts) -> NonFinite:
    return NonFinite(*counts)


def _same_parameters(point: CheckpointPoint, first: tuple[Path, dict] | None):
    """Every checkpoint holds the same parameters: a name both hold has one shape, and
    they share some. Else exit 3 naming both files: no ranking over two models."""
    if first is None:
        return (point.path, point.shapes)
    path0, shapes0 = first
    shared = shapes0.keys() & point.shapes.keys()
    if not shared:
        raise InputError(f"{point.path}: none of its parameters is one of "
                         f"{path0}'s: not one run's checkpoints")
    for name in sorted(shared):
        if shapes0[name] != point.shapes[name]:
            raise InputError(
                f"{point.path}: parameter {name} has shape "
                f"{list(point.shapes[name])}, but {list(shapes0[name])} in "
                f"{path0}: not one run's checkpoints")
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
                        f"{o.source}: its gradients' norm {o.total_norm:.6g} is not "
                        f"the {logged.total_norm:.6g} that {logged.source} logs at "
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
                             f"({', '.join(sorted(a)[:3])}, ...): not one run's inputs, or "
                             "a log grouped otherwise than by layer (checkpoints and dumps "
                             "are grouped by layer, as GradMonitor's default group_by); "
                             "give the log alone, or leave it out with --exclude")


# -- the step explained ------------------------------------------------------------------


def explained_step(main: QuantitySeries, step: int | None, series, z, alpha, warmup
                   ) -> int | None:
    """The step given (``--step``, checked against the inputs), else the newest flagged
    step of ``main``, the finest series."""
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


def undetermined_notes(explained: int, placed: dict[int, list[CheckpointPoint]]) -> list[str]:
    """The notes of the checkpoints a change across ``explained`` would read (the nearest
    before it, at it, and the nearest after it) on the quantities they do not determine."""
    steps = sorted(placed)
    near = [s for s in steps if s == explained]
    near += [s for s in steps if s < explained][-1:] + [s for s in steps if s > explained][:1]
    return list(dict.fromkeys(n for s in near for point in placed[s] for n in point.undetermined))
