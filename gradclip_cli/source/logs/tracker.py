"""What every tracker reader gives (``source/logs/trackers.py`` lists the readers).

A tracker (TensorBoard, MLflow, trackio, W&B, Lightning's CSV logger) keeps
runs, each a set of scalar series by tag: ``(step, value)`` pairs in the
order they were written. A reader finds the runs in what the walk of a folder
(or a file given by name) turned up, and reads a run's scalars when asked;
which tag is a gradient norm is decided in one place (``trackers.py``), the
same for every tracker.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.untrusted import is_number
from gradclip_cli.source.vocabulary import step_value

# (step, value) in the order the tracker stored them.
Points = list[tuple[int, float]]


@dataclass(frozen=True)
class TrackerRun:
    """One run of a tracker's store: its name and id, the file (or folder) it is read
    from, and its scalar series, read when ``scalars()`` is called."""

    tracker: str  # "TensorBoard", "MLflow", ...
    name: str
    id: str
    source: Path
    scalars: Callable[[], dict[str, Points]]
    # Whether the tracker kept a tag's values as float32 (TensorBoard), asked after
    # ``scalars()`` has read them.
    stores_float32: Callable[[str], bool] = lambda tag: False

    @property
    def label(self) -> str:
        same = not self.id or self.id == self.name
        return self.name if same else f"{self.name} (id {self.id})"


@dataclass(frozen=True)
class Tracker:
    """One tracker's reader.

    ``claims(path, is_dir)``: whether an entry met while walking a folder is
    this tracker's (an event file, an MLflow run folder, a database of its
    schema); ``runs(claimed)``: the runs those entries hold. ``given(path)``:
    the runs of one file named on the command line, None when it is not this
    tracker's (an SQLite file of another schema is an ``InputError`` there).
    ``extra``: the optional dependency it needs, None for the standard library.
    """

    name: str
    extra: str | None
    claims: Callable[[Path, bool], bool]
    runs: Callable[[Sequence[Path]], list[TrackerRun]]
    given: Callable[[Path], list[TrackerRun] | None]
    descend: bool = True  # walk on into a claimed folder (False: the reader reads it whole)


def checked_point(step: object, value: object, where: str) -> tuple[int, float]:
    """A checked point: a step as ``vocabulary.step_value`` reads every step (a whole
    number >= 0, a whole-number float included) and a norm >= 0 or non-finite.

    A negative step is no training step any framework logs (TensorBoard stores
    int64 and accepts one): exit 3 rather than a point placed before the run.
    """
    if type(step) is int and type(value) is float and step >= 0 and not value < 0:
        return step, value  # the common case, at a million points a series
    counted = step_value(step) if is_number(step) else None
    if counted is None:
        if is_number(step) and step < 0:
            raise InputError(f"{where}: step {step:g} is negative; a training step counts from 0")
        raise InputError(f"{where}: step {quoted(step)[:40]} is not a whole number")
    step = counted
    if not is_number(value):
        raise InputError(f"{where}: step {step}: value {quoted(value)[:40]} "
                         "is not a number")
    value = float(value)
    if value < 0 and math.isfinite(value):  # judged, it would pass as a calm step
        raise InputError(f"{where}: step {step}: a norm must be >= 0, got {value:g}")
    return step, value


def in_step_order(points: Points, where: str, warn: bool = True) -> Points:
    """A tag's points as one run: a step at or below one written before it starts the
    run over from there (a run resumed from a checkpoint logs its steps again), so
    the earlier points from that step on are superseded, with a warning, as
    TensorBoard purges "orphaned" events and as the monitor log does
    (``monitor_log._resumed``). Never a mixed series. ``warn`` False: read again
    (another use of a tag already read), without a second warning."""
    kept: Points = []
    for step, value in points:
        if kept and step <= kept[-1][0]:
            last, last_value = kept[-1]
            if step == last and _same(value, last_value):
                continue  # the same point written twice: one point
            before = len(kept)
            kept = [p for p in kept if p[0] < step]
            if warn:
                print(f"gradclip: warning: {visible(where)}: step {step} follows step {last}: "
                      f"a run resumed from an earlier step; the {before - len(kept)} earlier "
                      f"point(s) for steps {step}-{last} are superseded", file=sys.stderr)
        kept.append((step, value))
    return kept


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
