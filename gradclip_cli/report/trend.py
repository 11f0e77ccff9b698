"""A run's gradient norms over time, judged by the spike rule ``trend`` and the monitor share.

Each input (a checkpoint, a line of a monitor log, an entry of a Trainer's
``log_history``) becomes one ``Observation``; ``build_trend_report`` orders
them by step and judges the total and every group with its own
``SpikeDetector`` (``core/spikes.py``: ZClip, Kumar et al. 2025). A point is a
spike when its total or any of its groups is; ``spike_groups`` names the
groups that moved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.spikes import SpikeDetector, group_threshold
from ..errors import InputError, UsageError
from ..escaping import visible
from .model import INSUFFICIENT_HISTORY, NONFINITE, OK, SPIKE, NonFinite
from .norm_audit import NormAudit
from .tag import TagRead

if TYPE_CHECKING:
    from ..source.run_folder import RunFolder

FAIL_ON_NEWEST, FAIL_ON_ANY = "newest", "any"


@dataclass(frozen=True)
class Observation:
    """What one input says of one step, before any judging.

    ``nonfinite`` is None when the input gives no element counts (a Trainer's
    ``log_history`` holds only the total norm). ``what`` is what was measured
    (``grads``, ``exp_avg``, ...; a log's norms are ``grads``).
    """

    source: str
    step: int | None
    total_norm: float
    groups: dict[str, float] = field(default_factory=dict)
    nonfinite: NonFinite | None = None
    what: str = "grads"
    # Where a non-finite value began (forward module, backward parameter), when
    # the monitor located it (GradMonitor(locate_nonfinite=True)).
    nonfinite_origin: tuple[str | None, str | None] | None = None


@dataclass(frozen=True)
class TrendPoint:
    source: str
    step: int | None
    total_norm: float
    groups: dict[str, float]
    nonfinite: NonFinite | None
    z: float | None  # the total's z-score; None when not judged
    spike: bool  # the total or some group spiked
    spike_groups: tuple[str, ...]  # groups whose own series spiked here
    nonfinite_groups: tuple[str, ...]  # groups whose norm is NaN or inf here
    group_z: dict[str, float | None]
    what: str = "grads"
    nonfinite_origin: tuple[str | None, str | None] | None = None  # as Observation's

    @property
    def is_nonfinite(self) -> bool:
        counted = self.nonfinite is not None and self.nonfinite.total > 0
        return counted or not math.isfinite(self.total_norm) or bool(self.nonfinite_groups)

    @property
    def overflowed(self) -> bool:
        """Flagged for a norm beyond float64's range, not for non-finite values: the counts
        say every value is finite (inspect's overflow), yet a norm is inf."""
        return (self.is_nonfinite and self.nonfinite is not None and self.nonfinite.total == 0
                and not any(math.isnan(v) for v in (self.total_norm, *self.groups.values())))

    @property
    def judged(self) -> bool:
        return self.z is not None

    def origin_words(self, show=str) -> str:
        """``"forward output of M"`` or ``"forward clean"``, then ``", first non-finite
        gradient P"``: where the monitor located a non-finite value (``locate_nonfinite``),
        the names through ``show``; "" when it did not locate one here."""
        if self.nonfinite_origin is None or not self.is_nonfinite:
            return ""
        forward, backward = self.nonfinite_origin
        parts = [f"forward output of {show(forward)}" if forward else "forward clean",
                 f"first non-finite gradient {show(backward)}" if backward else ""]
        return ", ".join(part for part in parts if part)


@dataclass(frozen=True)
class SeriesFound:
    """A series of norms found in a run folder: where it came from, and whether it was
    the one judged (a run folder keeps the same steps at several grains)."""

    source: str
    kind: str  # "gradclip-monitor", "trainer-state", "checkpoints" or "tracker"
    points: int
    per_group: bool
    judged: bool
    why_not: str | None = None  # why it was not judged


@dataclass(frozen=True)
class ClippingFound:
    """Whether the Trainer clipped (``max_grad_norm`` > 0 and finite), None when unknown;
    ``monitor``: what gradclip's GradMonitor log records of its own clipping."""

    max_grad_norm: float | None
    source: str | None
    note: str
    clipped: bool | None = None
    monitor: MonitorClipped | None = None


@dataclass(frozen=True)
class MonitorClipped:
    """A GradMonitor log's own clipping: ``clipped`` of ``logged`` steps, to ``limits``."""

    source: str
    logged: int
    clipped: int
    limits: tuple[float, ...]


@dataclass(frozen=True)
class TrendReport:
    what: str
    norm_type: float
    group_by: str
    z_threshold: float
    alpha: float
    warmup: int
    fail_on: str
    points: list[TrendPoint]
    status: str
    # What run folders held and which series was judged; each note one line for
    # people (where each series came from, whether the Trainer clipped).
    series: tuple[SeriesFound, ...] = ()
    clipping: tuple[ClippingFound, ...] = ()
    notes: tuple[str, ...] = ()
    # The optimizer whose rule gave an optimizer quantity ("Adam"), where every
    # checkpoint names the same one; for the verdict's words.
    optimizer: str | None = None
    # A framework's own logged totals held against gradclip's (report/norm_audit.py).
    audits: tuple[NormAudit, ...] = ()
    # The tracker tag --tag named, where the points are its values (the quantity judged).
    tag: TagRead | None = None

    @property
    def disagreeing(self) -> list[NormAudit]:
        """The audits that found steps where the two totals disagree: a finding (exit 1)."""
        return [a for a in self.audits if not a.agrees]

    @property
    def groups(self) -> list[str]:
        """Every group seen, in order of first appearance."""
        return list(dict.fromkeys(g for p in self.points for g in p.groups))

    def group_thresholds(self) -> list[tuple[int, float]]:
        """The groups' thresholds in force over these points (``group_thresholds``)."""
        return group_thresholds((len(p.groups) for p in self.points), self.z_threshold)

    def groups_threshold_at(self, point: TrendPoint) -> float:
        """The z each of ``point``'s groups had to exceed (``group_threshold``): the
        total's ``z_threshold`` for one group, higher for several judged at once."""
        return group_threshold(self.z_threshold, len(point.groups))

    @property
    def failing(self) -> list[TrendPoint]:
        """The points that make the exit code 1 under ``fail_on``."""
        candidates = self.points[-1:] if self.fail_on == FAIL_ON_NEWEST else self.points
        return [p for p in candidates if p.spike or p.is_nonfinite]


def group_thresholds(counts: Iterable[int], z: float) -> list[tuple[int, float]]:
    """``(groups at once, the z each must exceed)`` (``group_threshold``) for the fewest
    and the most groups of ``counts`` above one (one pair where they are the same; none
    where no point holds more than one group): what the reports state of the rule."""
    counts = sorted({c for c in counts if c > 1})
    return [(c, group_threshold(z, c)) for c in dict.fromkeys(counts[:1] + counts[-1:])]


def order_by_step(observations: Sequence[Observation]) -> list[Observation]:
    """By step when every observation has one (a stable sort: ties keep their order);
    else in the order given, since a partial order would be a guess.

    The order given is refused (``UsageError``) where it contradicts the steps
    that are known (a folder lists ``ckpt-10.pt`` before ``ckpt-2.pt``, beside a
    ``final.pt`` with no step): judging the points in an order known to be
    wrong would give wrong z-scores.
    """
    if all(o.step is not None for o in observations):
        return sorted(observations, key=lambda o: o.step)
    known = [o for o in observations if o.step is not None]
    for before, after in zip(known, known[1:]):
        if after.step < before.step:
            unknown = next(o for o in observations if o.step is None)
            raise UsageError(
                f"{unknown.source}: no step (none recorded, no number in its "
                f"name), so the points keep the order given, but {after.source} "
                f"(step {after.step}) comes after {before.source} (step "
                f"{before.step}): give the inputs in step order, or leave out those "
                "without a step")
    return list(observations)


def one_point_per_step(observations: Sequence[Observation]) -> tuple[list[Observation], list[str]]:
    """Each step once: inputs that give the same step with the same norms are copies
    of one checkpoint (Lightning's ``last.ckpt`` beside ``epoch=E-step=N.ckpt``) and
    make one point, under the first name, with a note for each other name.

    Counted twice, a point would be judged against a history that holds itself
    (a spike clipped to the limit), and a copy of the newest checkpoint could
    hide its spike. The same step with other norms is two runs, or one run at
    two grains, not one series: ``UsageError`` naming both.
    """
    first: dict[int, Observation] = {}
    kept, copies = [], {}
    for obs in observations:
        if obs.step is None:
            kept.append(obs)
            continue
        seen = first.setdefault(obs.step, obs)
        if seen is obs:
            kept.append(obs)
        elif _same_norms(seen, obs):
            copies.setdefault((obs.source, seen.source), []).append(obs.step)
        else:
            raise UsageError(
                f"{obs.source} and {seen.source} both give step {obs.step}, "
                f"with other norms ({_apart(obs, seen)}): one trend judges one run's series, "
                "each step once; give one of them, or leave one out with --exclude GLOB")
    notes = []
    for (copy, source), steps in copies.items():
        at = (f"step ({steps[0]})" if len(steps) == 1
              else f"{len(steps)} steps ({min(steps)}-{max(steps)})")
        each = "" if len(steps) == 1 else " each"
        notes.append(f"{visible(copy)}: the same {at} and norms as {visible(source)}: "
                     f"one point{each}")
    return kept, notes


def _apart(a: Observation, b: Observation) -> str:
    """The two totals, with as many digits as it takes to tell them apart (a log's
    float32 norm and a float64 one differ in the 8th digit), or that they differ elsewhere."""
    x, y = a.total_norm, b.total_norm
    if x != y and not (math.isnan(x) and math.isnan(y)):
        digits = next((d for d in range(6, 18) if f"{x:.{d}g}" != f"{y:.{d}g}"), 17)
        return f"{x:.{digits}g} and {y:.{digits}g}"
    return "the same total, other groups or non-finite counts"


def _same_norms(a: Observation, b: Observation) -> bool:
    def same(x: float, y: float) -> bool:
        return x == y or (math.isnan(x) and math.isnan(y))

    # No counts (a log_history entry holds none) is no difference: the counts that
    # one side gives are not contradicted by the other.
    return (same(a.total_norm, b.total_norm) and a.groups.keys() == b.groups.keys()
            and all(same(v, b.groups[k]) for k, v in a.groups.items())
            and (a.nonfinite is None or b.nonfinite is None or a.nonfinite == b.nonfinite))


def build_trend_report(
    observations: Sequence[Observation],
    *,
    what: str,
    norm_type: float,
    group_by: str,
    z: float,
    alpha: float,
    warmup: int,
    fail_on: str,
    series: Sequence[SeriesFound] = (),
    clipping: Sequence[ClippingFound] = (),
    notes: Sequence[str] = (),
    audits: Sequence[NormAudit] = (),
) -> TrendReport:
    """Judge ``observations`` (already in step order) point by point.

    Every observation measures ``what``: a series of one quantity (the
    command refuses a mix before judging, ``commands/trend.OneKind``).
    """
    mixed = sorted({o.what for o in observations} - {what})
    if mixed:
        raise ValueError(f"a trend of {what} given points measuring {', '.join(mixed)}")

    def detector() -> SpikeDetector:
        return SpikeDetector(z=z, alpha=alpha, warmup=warmup)

    total_detector = detector()
    group_detectors: dict[str, SpikeDetector] = {}
    points = []
    for obs in observations:
        total = total_detector.update(obs.total_norm)
        spike_groups, nonfinite_groups, group_z = [], [], {}
        # The groups of one point are judged at once: each against a threshold that
        # keeps the chance of any of them crossing by noise that of one series.
        threshold = group_threshold(z, len(obs.groups))
        for name, norm in obs.groups.items():
            judgement = group_detectors.setdefault(name, detector()).update(norm, threshold)
            group_z[name] = judgement.z
            if judgement.spike:
                spike_groups.append(name)
            if judgement.nonfinite:
                nonfinite_groups.append(name)
        points.append(TrendPoint(
            source=obs.source, step=obs.step, total_norm=obs.total_norm,
            groups=dict(obs.groups), nonfinite=obs.nonfinite, z=total.z,
            spike=total.spike or bool(spike_groups), spike_groups=tuple(spike_groups),
            nonfinite_groups=tuple(nonfinite_groups), group_z=group_z, what=obs.what,
            nonfinite_origin=obs.nonfinite_origin,
        ))  # fmt: skip
    return TrendReport(
        what=what, norm_type=norm_type, group_by=group_by, z_threshold=z, alpha=alpha,
        warmup=warmup, fail_on=fail_on, points=points, status=_status(points, fail_on),
        series=tuple(series), clipping=tuple(clipping), notes=tuple(notes),
        audits=tuple(audits),
    )  # fmt: skip


def _status(points: list[TrendPoint], fail_on: str) -> str:
    """nonfinite beats spike beats insufficient_history, over the points ``fail_on`` covers.

    A point counts as judged when its total or any group was (each series
    needs ``MIN_HISTORY`` earlier points of its own).
    """
    if not points:
        return INSUFFICIENT_HISTORY
    covered = points[-1:] if fail_on == FAIL_ON_NEWEST else points
    if any(p.is_nonfinite for p in covered):
        return NONFINITE
    if any(p.spike for p in covered):
        return SPIKE

    def judged(p: TrendPoint) -> bool:
        return p.z is not None or any(v is not None for v in p.group_z.values())

    if not any(judged(p) for p in covered):
        return INSUFFICIENT_HISTORY
    return OK


# -- what the trend and compare commands gather before the report is built ----------------

# What a norm log (monitor JSON Lines, trainer_state.json) holds.
LOGGED_WHAT = "grads"
# How a log's groups were made: by the writer (GradMonitor's group_by), not by --group-by.
LOGGED_GROUPS = "the log's writer"


def one_optimizer(names: set[str | None]) -> str | None:
    """The optimizer every measured checkpoint names (its quantity's words: "Adam
    exp_avg"); None where they name several, or none."""
    return next(iter(names)) if len(names) == 1 else None


class OneKind:
    """Checks that every point of a trend (or both sides of a compare) measures one ``what``.

    ``requested``: ``--what``; "auto" lets the first point decide. A second
    kind is a ``UsageError`` naming both sources: one series, one quantity.
    ``command`` ("trend" or "compare") words the way out.
    """

    def __init__(self, requested: str, command: str = "trend",
                 common: Callable[[], Sequence[str]] | None = None):
        self.requested = requested
        self.command = command
        # The --what choices every input measures (asked only when two kinds meet).
        self.common = common
        self.first: tuple[str, str] | None = None  # (source, what)
        self.logs = False

    @property
    def what(self) -> str:
        if self.first is not None:
            return self.first[1]
        return LOGGED_WHAT if self.requested == "auto" else self.requested

    def check(self, source: str, what: str, *, logged: bool = False,
              explain: str | None = None) -> None:
        """``explain``: what ``source`` measures, as its selection words it (an adapter's
        weights are not the model's); else the quantity's own wording."""
        if logged and self.requested not in ("auto", what):
            raise UsageError(
                f"--what {self.requested}: {source} logs gradient norms ({what}) "
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
        elif offer := list(self.common() if self.common is not None else ()):
            # Only what every input measures: following the offer succeeds on each.
            flags = " or ".join(f"--what {w}" for w in offer)
            fix = (f"give {flags} to measure both alike" if compare else
                   f"give {flags} to measure every checkpoint alike, or trend them apart")
        else:
            # No --what measures every input: no flag makes them one series.
            fix = "no --what measures both alike" if compare else "trend them apart"
        rule = ("compare needs one quantity on both sides" if compare
                else "one trend judges one quantity")
        from ..source.what import EXPLAIN

        raise UsageError(f"{source} measures {what} ({explain or EXPLAIN[what]}) but "
                         f"{source0} measures {what0}; {rule}: {fix}")


def one_norm_type(requested: float | None, logs: list[tuple[Path, list]]
                  ) -> tuple[float, list[tuple[Path, list]], list[str]]:
    """The p every point uses: ``--norm-type``, else the one the logs state, else 2;
    the logs' entries in that p; notes on the lines left out.

    A log's norms cannot be re-measured, so a log in another p is exit 2. A log
    that holds several p's (a monitor recreated with another ``norm_type``
    appending to it) is exit 3 naming the steps of each, unless ``--norm-type``
    names one of them: its lines alone are read, and a note says which were not.
    """
    logs, notes = _one_norm_type_per_log(requested, logs)
    stated = {(entry.norm_type, path) for path, entries in logs for entry in entries}
    p = requested
    for log_p, path in sorted(stated, key=lambda s: str(s[1])):
        if p is None:
            p = log_p
        elif log_p != p:
            given = "--norm-type" if requested is not None else "another input"
            raise UsageError(f"{path}: logs norms with p={log_p:g}, but {given} uses "
                             f"p={p:g}; trend compares one kind of norm")
    return 2.0 if p is None else p, logs, notes


def _one_norm_type_per_log(requested: float | None, logs: list[tuple[Path, list]]
                           ) -> tuple[list[tuple[Path, list]], list[str]]:
    """Each log's entries in one p (``one_norm_type``), and a note per log cut to it."""
    kept, notes = [], []
    for path, entries in logs:
        stated = list(dict.fromkeys(entry.norm_type for entry in entries))
        if len(stated) < 2:
            kept.append((path, entries))
            continue
        if requested not in stated:
            flags = " or ".join(f"--norm-type {p:g}" for p in stated)
            raise InputError(f"{path}: {mixed_norm_types(entries)}; trend compares one "
                             f"kind of norm: give {flags} to trend that p's lines alone")
        left = [words for p, words in _norm_type_runs(entries) if p != requested]
        out = sum(entry.norm_type != requested for entry in entries)
        notes.append(f"{visible(str(path))}: {out} line(s) in another p left out "
                     f"({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}): "
                     f"--norm-type {requested:g} reads the lines of p={requested:g} alone")
        kept.append((path, [entry for entry in entries if entry.norm_type == requested]))
    return kept, notes


def mixed_norm_types(entries: list) -> str | None:
    """Where a log's entries change p, in words ("logs norms with p=2 at steps 0-7, then
    p=1 at steps 8-11 (a monitor recreated ...)"); None for a log in one p."""
    if len({entry.norm_type for entry in entries}) < 2:
        return None
    runs = [words for _, words in _norm_type_runs(entries)]
    shown = runs[:4] + ([f"and {len(runs) - 4} more changes"] if len(runs) > 4 else [])
    return (f"logs norms with {', then '.join(shown)} (a monitor recreated with another "
            "norm_type appended to it)")


def _norm_type_runs(entries: list) -> list[tuple[float, str]]:
    """Each run of consecutive entries in one p: that p, and the run in words: "p=2 at
    steps 0-7" (by the entries' order where a step is not logged: "p=2 at entries 1-8")."""
    runs: list[list[int]] = []
    for i, entry in enumerate(entries):
        if i and entries[i - 1].norm_type == entry.norm_type:
            runs[-1].append(i)
        else:
            runs.append([i])
    words = []
    for run in runs:
        first, last = entries[run[0]], entries[run[-1]]
        if first.step is not None and last.step is not None:
            where = f"step {first.step}" if len(run) == 1 else \
                f"steps {first.step}-{last.step}"
        else:
            where = f"entry {run[0] + 1}" if len(run) == 1 else \
                f"entries {run[0] + 1}-{run[-1] + 1}"
        words.append((first.norm_type, f"p={first.norm_type:g} at {where}"))
    return words


def found_in_runs(runs: list[RunFolder]) -> dict:
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


def monitor_clipping_notes(logs: list[tuple[Path, list]], runs: list[RunFolder]) -> list[str]:
    """A note for each GradMonitor log trended by itself that records its own clipping
    (a run folder's note says it already, beside the Trainer's)."""
    from ..source.run_folder import MonitorClipping

    covered = {r.monitor_clipping.source for r in runs if r.monitor_clipping is not None}
    notes = []
    for path, entries in logs:
        if path in covered or not any(getattr(e, "clip_coef", None) is not None
                                      for e in entries):
            continue
        notes.append(MonitorClipping.of_log(path, entries).note())
    return notes


def logged_observations(path: Path, entries: list) -> list[Observation]:
    """A norm log's entries as points (gradient norms, as logged)."""
    return [
        Observation(
            source=str(path), step=entry.step, total_norm=entry.total_norm,
            groups=dict(entry.groups),
            nonfinite=None if entry.nonfinite is None else NonFinite(*entry.nonfinite),
            what=LOGGED_WHAT, nonfinite_origin=entry.nonfinite_origin,
        )  # fmt: skip
        for entry in entries
    ]
