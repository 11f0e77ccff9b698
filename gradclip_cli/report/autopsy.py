"""A spike taken apart: where it began, what changed across it, in which layer first.

The command (``commands/autopsy.py``) reads every grain a run's inputs hold
and hands this module one ``QuantitySeries`` per quantity and kind of input:
the monitor log's gradient norms every step, the checkpoints' ``exp_avg``,
``grad_rms``, ``update``, ``weights`` and ``update_to_weights`` every few
steps, the dumps' gradients at the steps they were written. Steps are
already numbered as the finest series numbers them.

``build_autopsy_report`` then:

- takes the explained step: the newest spike or non-finite point of the
  finest series as ``trend`` judges it (``report/trend.py``, the rule of
  ``core/spikes.py``), or the step asked for;
- judges every per-group series as ``trend`` judges it, each group's own
  series on its own, and gives each group its ``onset``: the earliest step
  within ``window`` steps before the explained one at which one of its series
  crossed the rule or went non-finite, and ``lead``, how many steps that is
  before the total's own onset;
- gives each quantity's change across the spike: ``before`` the nearest
  point before the explained step, ``after`` the explained step's own point,
  else the nearest after it, and ``ratio = after / before``;
- ranks the groups, earliest onset first, then largest change (the largest
  ``|log ratio|`` of any quantity), and says it in words, each statement
  naming the inputs it rests on.

Plain data: no files, no printing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.spikes import MIN_HISTORY, SpikeDetector, group_threshold
from .model import INSUFFICIENT_HISTORY
from .tag import TagRead, tag_words
from .trend import (
    FAIL_ON_ANY,
    Observation,
    TrendReport,
    build_trend_report,
    group_thresholds,
)

EXPLAINED, NOTHING, INSUFFICIENT = "explained", "nothing", "insufficient"
# Quantities in the order a report lists them.
QUANTITIES = ("grads", "exp_avg", "grad_rms", "update", "update_to_weights", "weights")
# Kinds of input a series comes from.
LOG, DUMPS, CHECKPOINTS = "log", "dumps", "checkpoints"
# Points shown after the explained step in each group's sparkline.
AFTER_SHOWN = 5


@dataclass(frozen=True)
class QuantitySeries:
    """One quantity over steps, from one kind of input (a log, the checkpoints, the dumps).

    ``observations`` are in step order, one per step, each measuring ``what``
    (``update_to_weights``: each group's update RMS over its weights' RMS).
    ``label`` names the inputs for people: the log's file, or the first and last file;
    raw, as the report's ``finest`` and verdict are (each format escapes them once).
    """

    what: str
    kind: str
    label: str
    observations: tuple[Observation, ...]

    @property
    def steps(self) -> list[int]:
        return [o.step for o in self.observations]

    @property
    def per_group(self) -> bool:
        return any(o.groups for o in self.observations)

    def at(self, step: int) -> Observation | None:
        return next((o for o in self.observations if o.step == step), None)


@dataclass(frozen=True)
class Change:
    """A quantity across the spike: its value before, after, and after / before."""

    before: float | None
    after: float | None
    ratio: float | None
    before_step: int | None
    after_step: int | None
    before_source: str | None
    after_source: str | None


@dataclass(frozen=True)
class Outliers:
    """Elements of a group's gradient beyond ``k * sqrt(v_hat)``: ``count`` of ``elements``;
    the gradient from ``grads_source``, ``v_hat`` from ``moment_source``."""

    count: int
    elements: int
    grads_source: str
    moment_source: str

    @property
    def fraction(self) -> float:
        return self.count / self.elements if self.elements else 0.0


@dataclass(frozen=True)
class Onset:
    """Where a series first crossed the rule (or went non-finite) within the window."""

    step: int
    what: str
    source: str
    nonfinite: bool
    history: float | None  # the value over its running mean there (None: not judged)


@dataclass(frozen=True)
class GroupAutopsy:
    name: str
    rank: int
    onset: Onset | None
    lead: int | None
    changes: dict[str, Change]
    outliers: Outliers | None
    around: tuple[float | None, ...]  # the finest series around the spike (sparkline)


@dataclass(frozen=True)
class InputUsed:
    source: str
    what: str
    steps: tuple[int, ...]


@dataclass(frozen=True)
class AutopsyReport:
    step: int | None
    status: str
    groups: list[GroupAutopsy]
    inputs: list[InputUsed]
    verdict: str
    window: int
    outlier_k: float
    finest: str  # the series the explained step comes from, for people
    total_onset: Onset | None = None
    total_around: tuple[float | None, ...] = ()
    around_steps: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    z_threshold: float = 2.5
    alpha: float = 0.97
    warmup: int = 25
    spikes: tuple[int, ...] = field(default_factory=tuple)  # every flagged step of the finest
    nonfinite: bool = False  # the explained step is non-finite, not a spike
    # The tracker tag --tag named, where the finest series is its values: the verdict
    # names it, not "the total" of gradient norms.
    tag: TagRead | None = None

    def group_thresholds(self) -> list[tuple[int, float]]:
        """The groups' threshold in force (``report.trend.group_thresholds``)."""
        return group_thresholds([len(self.groups)], self.z_threshold)


def finest(series: Sequence[QuantitySeries]) -> QuantitySeries:
    """The series a spike is looked for in: gradient norms (a log or dumps) over the
    optimizer's quantities, then the most points, then per group, then a log. The
    monitor's dumps come last: written at its spikes alone, they are no run's series
    beside any other (a run's checkpoints, with no log given)."""
    return max(series, key=lambda s: (s.kind != DUMPS, s.what == "grads",
                                      len(s.observations), s.per_group, s.kind == LOG))


def judge(series: QuantitySeries, z: float, alpha: float, warmup: int) -> TrendReport:
    """The series judged as ``trend`` judges it: total and every group on its own."""
    return build_trend_report(list(series.observations), what=series.what, norm_type=2.0,
                              group_by="", z=z, alpha=alpha, warmup=warmup, fail_on=FAIL_ON_ANY)


def flagged_steps(report: TrendReport) -> list[int]:
    return [p.step for p in report.points if p.spike or p.is_nonfinite]


def build_autopsy_report(
    series: Sequence[QuantitySeries], *, step: int | None, window: int, outlier_k: float,
    z: float, alpha: float, warmup: int, outliers: dict[str, Outliers] | None = None,
    notes: Sequence[str] = (), inputs: Sequence[InputUsed] = (), tag: TagRead | None = None,
) -> AutopsyReport:
    """The autopsy of ``step`` (None: the newest flagged step of the finest series).

    ``outliers``: per group, where the command could count them (a gradient of the
    explained step and the second moment of the step before). ``tag``: the tag
    ``--tag`` named, where ``series``' finest is its values.
    """
    main = finest(series)
    judged = judge(main, z, alpha, warmup)
    spikes = flagged_steps(judged)
    common = dict(window=window, outlier_k=outlier_k, finest=main.label, notes=tuple(notes),
                  inputs=list(inputs), z_threshold=z, alpha=alpha, warmup=warmup,
                  spikes=tuple(spikes), tag=tag)
    # What the finest series is, for the verdict (raw, as the label: formats escape it).
    judged_in = main.label if tag is None else f"{tag_words(tag.name, str)} of {main.label}"
    total_of = f"the total of {main.label}" if tag is None else judged_in
    if step is None:
        if not spikes:
            insufficient = judged.status == INSUFFICIENT_HISTORY
            status = INSUFFICIENT if insufficient else NOTHING
            why = (f"too few points to judge ({len(main.observations)}; the rule needs 5 "
                   "earlier points)" if insufficient else "no spike and no non-finite step")
            return AutopsyReport(step=None, status=status, groups=[],
                                 verdict=f"nothing to explain: {why} in {judged_in}", **common)
        step = spikes[-1]
    point = next(p for p in judged.points if p.step == step)
    flagged = point.spike or point.is_nonfinite
    total_onset = _onset(_series_points(judged, None), step, window, main, None)
    groups = _groups(series, judged, main, step, window, total_onset, z, alpha, warmup,
                     outliers or {})
    low = max(step - window, min(main.steps))
    shown = [p for p in judged.points if low <= p.step <= step + AFTER_SHOWN]
    around_steps = tuple(p.step for p in shown)
    report_groups = [
        GroupAutopsy(g.name, g.rank, g.onset, g.lead, g.changes, g.outliers,
                     tuple(p.groups.get(g.name) for p in shown))
        for g in groups
    ]
    # A step the rule could not judge (fewer than MIN_HISTORY points before it, counted
    # from its series' first nonzero norm) is not a clean one: too few points, as
    # without --step.
    judged_at = point.z is not None or any(z is not None for z in point.group_z.values())
    status = EXPLAINED if flagged else NOTHING if judged_at else INSUFFICIENT
    verdict = _verdict(step, status, report_groups, total_onset, main, outlier_k, point,
                       judged_in, total_of)
    if status == INSUFFICIENT:
        before = sum(p.step < step for p in judged.points)
        verdict = (f"step {step}: nothing to explain: too few points before it to judge "
                   f"({before}; the rule needs {MIN_HISTORY} earlier points, counted from "
                   f"the first nonzero norm) in {judged_in}")
    return AutopsyReport(step=step, status=status, groups=report_groups, verdict=verdict,
                         total_onset=total_onset, total_around=tuple(p.total_norm for p in shown),
                         around_steps=around_steps, nonfinite=point.is_nonfinite, **common)


# -- per group -------------------------------------------------------------------------


def _series_points(report: TrendReport, group: str | None
                   ) -> list[tuple[int, bool, bool, float | None]]:
    """(step, crossed the rule, non-finite, z) of the total (``group`` None) or one group."""
    out = []
    for p in report.points:
        if group is None:
            nonfinite = not math.isfinite(p.total_norm) or (
                p.nonfinite is not None and p.nonfinite.total > 0)
            out.append((p.step, p.z is not None and p.z > report.z_threshold, nonfinite, p.z))
        elif group in p.groups:
            out.append((p.step, group in p.spike_groups, group in p.nonfinite_groups,
                        p.group_z.get(group)))
    return out


def _onset(points, step: int, window: int, series: QuantitySeries, group: str | None,
           report: TrendReport | None = None) -> Onset | None:
    """The earliest crossing (or non-finite point) of the episode that reaches ``step``:
    walking back from ``step``, the points that crossed the rule or stayed above the
    series' running mean (z > 0), within ``window`` steps. A crossing the series fell back
    below its mean after, before ``step``, was an earlier, separate event (mini-batch
    noise crosses now and then), not the onset of this one."""
    onset = None
    for s, crossed, nonfinite, z in reversed([p for p in points if p[0] <= step]):
        if s < step - window:
            break
        if crossed or nonfinite:
            onset = (s, nonfinite)
        elif z is None or not z > 0:
            break
    if onset is None:
        return None
    s, nonfinite = onset
    return Onset(s, series.what, series.label, nonfinite, _history(series, group, s, report))


def _history(series: QuantitySeries, group: str | None, step: int,
             report: TrendReport | None) -> float | None:
    """The value at ``step`` over its series' running mean just before (the rule's mean)."""
    detector = SpikeDetector() if report is None else SpikeDetector(
        report.z_threshold, report.alpha, report.warmup)
    for o in series.observations:
        value = o.total_norm if group is None else o.groups.get(group)
        if value is None:
            continue
        if o.step == step:
            mean = detector.mean
            if detector.accepted == 0 or not math.isfinite(value) or mean <= 0:
                return None
            return value / mean
        # A group's point is judged as trend judges it, against its point's groups' threshold.
        detector.update(value, None if group is None else
                        group_threshold(detector.threshold, len(o.groups)))
    return None


@dataclass
class _Group:
    name: str
    onset: Onset | None
    lead: int | None
    changes: dict[str, Change]
    outliers: Outliers | None
    rank: int = 0


def _groups(series, judged_main, main, step, window, total_onset, z, alpha, warmup,
            outliers) -> list[_Group]:
    names = list(dict.fromkeys(g for s in series for o in s.observations for g in o.groups))
    reports = {id(s): (judged_main if s is main else judge(s, z, alpha, warmup))
               for s in series if s.per_group}
    found = []
    for name in names:
        onsets = []
        for s in series:
            if id(s) not in reports:
                continue
            report = reports[id(s)]
            onset = _onset(_series_points(report, name), step, window, s, name, report)
            if onset is not None:
                onsets.append(onset)
        # The earliest; at one step, the finest series' word first (it is the one judged).
        onset = min(onsets, key=lambda o: (o.step, o.source != main.label), default=None)
        lead = None
        if onset is not None and total_onset is not None:
            lead = total_onset.step - onset.step
        changes = {}
        for s in _change_series(series, main):
            change = _change(s, name, step)
            if change is not None:
                changes[s.what] = change
        found.append(_Group(name, onset, lead, changes, outliers.get(name)))
    found.sort(key=lambda g: (g.onset is None, g.onset.step if g.onset else 0,
                              -_largest_change(g.changes)))
    for i, g in enumerate(found, 1):
        g.rank = i
    return found


def _change_series(series: Sequence[QuantitySeries], main: QuantitySeries):
    """One series per quantity for the changes: the finest of each (the judged one for
    its quantity), in the report's order."""
    best: dict[str, QuantitySeries] = {}
    for s in series:
        if not s.per_group:
            continue
        held = best.get(s.what)
        if held is None or s is main or (
                held is not main and len(s.observations) > len(held.observations)):
            best[s.what] = s
    return [best[q] for q in QUANTITIES if q in best]


def _change(series: QuantitySeries, group: str, step: int) -> Change | None:
    points = [o for o in series.observations if group in o.groups]
    before = next((o for o in reversed(points) if o.step < step), None)
    after = next((o for o in points if o.step >= step), None)
    if before is None and after is None:
        return None
    b = None if before is None else before.groups[group]
    a = None if after is None else after.groups[group]
    return Change(b, a, ratio(b, a), None if before is None else before.step,
                  None if after is None else after.step,
                  None if before is None else before.source,
                  None if after is None else after.source)


def ratio(before: float | None, after: float | None) -> float | None:
    """``after / before``: 1 for two zeros, inf for a rise from zero, NaN from a NaN."""
    if before is None or after is None:
        return None
    if math.isnan(before) or math.isnan(after):
        return math.nan
    if before == 0:
        return 1.0 if after == 0 else math.inf
    return after / before


def _largest_change(changes: dict[str, Change]) -> float:
    largest = 0.0
    for c in changes.values():
        r = c.ratio
        if r is None:
            continue
        if not math.isfinite(r) or r <= 0:
            return math.inf
        largest = max(largest, abs(math.log(r)))
    return largest


# -- words ----------------------------------------------------------------------------


def times(r: float | None) -> str:
    if r is None:
        return "-"
    if math.isnan(r):
        return "nan"
    if math.isinf(r):
        return "inf"
    return f"{r:.3g}x"


def _verdict(step: int, status: str, groups: list[GroupAutopsy], total_onset: Onset | None,
             main: QuantitySeries, k: float, point, judged_in: str, total_of: str) -> str:
    """``judged_in``: the finest series for people (its file, or a tag of it);
    ``total_of``: its total (``the total of FILE``)."""
    if status == NOTHING:
        return (f"step {step}: nothing to explain: neither its total nor any group crossed "
                f"the spike rule or went non-finite in {judged_in}")
    what = "non-finite" if point.is_nonfinite else "spike"
    began = [g for g in groups if g.onset is not None]
    if not groups:
        return (f"step {step}: {what} in {total_of}; no input holds per-group "
                "norms, so it cannot be placed in a layer (a GradMonitor log holds every "
                "layer's)")
    if not began:
        hint = "" if main.per_group else (
            f"; {main.label} holds the total only, and a GradMonitor log beside it would "
            "give every layer's norm at every step")
        return (f"step {step}: {what} in {total_of}; no group's own series "
                f"crossed the rule within the window{hint}")
    first = began[0]
    o = first.onset
    how = "went non-finite" if o.nonfinite else (
        f"{_quantity(o.what)} {times(o.history)} its history" if o.history is not None
        else f"{_quantity(o.what)} crossed the rule")
    if total_onset is None:
        lead = "the total did not cross the rule"
    elif first.lead == 0:
        lead = "at the total's own onset"
    else:
        lead = f"{first.lead} steps before the total" if first.lead > 0 else \
            f"{-first.lead} steps after the total"
    # The monitor's own finding (locate_nonfinite), where its log holds one: the groups'
    # onsets cannot order a NaN that reached several groups within one step.
    located = point.origin_words()
    located = f"; located by the monitor: {located}" if located else ""
    parts = [f"step {step}: {what}{located}; began in {first.name} at step {o.step} ({how}, "
             f"{lead}; {o.source})"]
    # A quantity with no point on one side of the spike has no change to state.
    stated = {q: c for q, c in first.changes.items() if c.ratio is not None}
    moved = [f"{_quantity(q)} {times(c.ratio)}" for q, c in stated.items()
             if q != o.what or c.after_step != o.step]
    if moved:
        sources = sorted({c.before_source for c in stated.values() if c.before_source}
                         | {c.after_source for c in stated.values() if c.after_source})
        parts.append(f"across the spike {', '.join(moved)} ({_sources(sources)})")
    if first.outliers is not None:
        out = first.outliers
        parts.append(f"{100 * out.fraction:.3g}% of its gradient's elements beyond "
                     f"{k:g} sqrt(v_hat) ({out.grads_source}; v_hat from {out.moment_source})")
    then = [g.name for g in began[1:4]]
    if then:
        more = len(began) - 1 - len(then)
        parts.append("then " + ", ".join(then) + (f" and {more} more" if more > 0 else ""))
    return "; ".join(parts)


def _quantity(what: str) -> str:
    return {"grads": "gradient norm", "grad_rms": "grad_rms", "update": "update RMS",
            "update_to_weights": "update_to_weights", "weights": "weights",
            "exp_avg": "exp_avg"}.get(what, what)


def _sources(sources: list[str]) -> str:
    if len(sources) <= 3:
        return ", ".join(sources)
    return f"{sources[0]} .. {sources[-1]}, {len(sources)} inputs"
