"""One checkpoint's total and group norms: what ``trend``, ``compare`` and ``autopsy`` take
from each checkpoint they read (``inspect`` reports a row per tensor besides).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import GradclipError, InputError
from ..format.text import visible
from ..progress import Steps
from ..report import NonFinite
from ..report.groups import group_sums, nonfinite_counts
from ..report.trend import LOGGED_WHAT
from ..source.layouts import LAYOUTS, open_checkpoint
from ..source.vocabulary import CheckpointStep, checkpoint_step, last_number
from ..source.what import available
from .common import Loaded, Releasers, load, measure


@dataclass(frozen=True)
class MeasureOptions:
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


def why_not_checkpoint(path: Path, key: str | None, trust_pickle: bool, steps: Steps
                       ) -> str | None:
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


def measurable(paths: list[Path], key: str | None, trust_pickle: bool) -> list[str]:
    """The ``--what`` choices that succeed on every checkpoint of ``paths``
    (``source.what.available``), in the order ``--what`` lists them; none where one
    cannot be opened. Each is opened anew: only a refusal's offer asks for it."""
    common: list[str] | None = None
    for path in paths:
        try:
            found = available(open_checkpoint(path, key=key, trust_pickle=trust_pickle))
        except InputError:
            return []
        common = found if common is None else [w for w in common if w in found]
        if not common:
            return []
    return common or []


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
    # The same parameters' weights, where asked for and all held: (total, groups).
    weights: tuple[float, dict[str, float]] | None = None


class ReadNotes:
    """The notes of the inputs a command has read so far (``Contents.notes``: what
    ``--verify`` could not check), each naming its input, once each, in reading order.

    A failure met while reading them, or after, carries them all (``GradclipError.notes``):
    a run refused at its third checkpoint still says, in every format, that ``--verify``
    checked nothing in the first two, as the report it would have made says.
    """

    def __init__(self) -> None:
        self._notes: dict[str, None] = {}

    @property
    def notes(self) -> list[str]:
        return list(self._notes)

    def add(self, path: Path, notes: Iterable[str]) -> None:
        """``path`` was read: its layout's ``notes``, each named by it (escaped here)."""
        self._notes.update(dict.fromkeys(f"{visible(str(path))}: {note}" for note in notes))

    @contextmanager
    def carried(self, path: Path | None = None) -> Iterator[None]:
        """A ``GradclipError`` raised inside carries every note added so far, then its own:
        with ``path`` (the input being read), those it has of that input (its layout's,
        where opening or selecting failed), named and added as the input's."""
        try:
            yield
        except GradclipError as error:
            own = error.notes
            if path is not None:
                self.add(path, own)
                own = ()
            error.notes = ()
            error.noting((*self._notes, *own))
            raise


def measure_checkpoint(path: Path, how: MeasureOptions, steps: Steps,
                       folder_step: int | None = None, *,
                       read: ReadNotes | None = None) -> Measured:
    """Load (any layout), select ``how.what`` and measure one checkpoint, grouped;
    its pages are released as they are read. ``read``: where its notes go as soon as it
    is loaded, so that a failure measuring it carries them too."""
    loaded = load(path, how.key, how.trust_pickle, how.verify, steps, how.what)
    if read is not None:
        read.add(path, loaded.contents.notes)
    return measure_grouped(loaded, path, how, steps, folder_step)


def measure_grouped(loaded: Loaded, path: Path, how: MeasureOptions, steps: Steps,
                    folder_step: int | None = None, *, weights: bool = False) -> Measured:
    """Measure and group one loaded checkpoint; its pages are released as they are read.
    ``weights``: the same parameters' weights too, grouped alike."""
    measurement = measure(loaded, how.norm_type, how.device, steps, f"measuring {path.name}",
                          Releasers(loaded.contents.files or [path]), how.session,
                          weights=weights)
    members = [how.group_rule(n) for n in loaded.names]
    # Group norms only, not inspect's full report (a row per tensor): that was
    # 0.55 s of 5.2 s over 50 checkpoints (BENCHMARKS.md, "trend"). Groups and the
    # total count each shared element once: the owned sums.
    grouped = group_sums(members, measurement.owned)
    weight_groups = None
    if measurement.weights is not None:
        by_group = group_sums(members, measurement.weights)
        weight_groups = (float(by_group.total.norm[0]),
                         dict(zip(by_group.names, by_group.groups.norm.tolist())))
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
        weights=weight_groups,
    )  # fmt: skip


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
