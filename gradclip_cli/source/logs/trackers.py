"""The trackers ``trend`` reads, one registry line each, and the one rule for which tag is a norm.

A folder is walked (``MAX_DEPTH`` levels, hidden names and symlinks
skipped, ``--exclude`` applied) and every entry a tracker claims is handed
to it; a file named on the command line is offered to each tracker in turn.
A store that holds several runs is refused with their names unless
``--run`` names one (by name or id).

Which tag is the gradient norm, found by name (``NORM_TAGS``), or given
with ``--tag``. The families, in the order they are preferred:

1. gradclip's own tags (``tracker_tags``): ``gradclip/total_norm`` and a
   ``gradclip/norm/<group>`` per group, with or without a logger's prefix
   (the Trainer's TensorBoard and W&B callbacks write ``train/...``), p from
   ``gradclip/norm_type`` where it is logged (2 where not);
2. Lightning's ``grad_norm`` utility: ``grad_<p>_norm_total`` and
   ``grad_<p>_norm/<parameter>`` (the p-norm, p read from the name);
3. the total alone, as the frameworks log it: ``grad_norm`` (Trainer,
   torchtitan), ``train/grad_norm`` (Trainer through TensorBoard or W&B),
   ``grad_norm/total`` (its ``grad_norm/<group>`` as groups), Megatron's
   ``grad-norm``.

The first family present is read, and the report says which tag, and what
else was there; two of one family (``grad_norm`` and ``train/grad_norm``,
Lightning's 2-norm and inf-norm) are exit 2 naming them and ``--tag``,
never a series mixed of both.

``--tag`` reads any scalar (``train/loss`` too): the series remembers that
``--tag`` named it, and whether its name is a gradient norm's by the rule
above (``named_as_norm``), so that the reports name the tag as the quantity
judged, never "gradient norm" for what may be a loss.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gradclip_cli import tracker_tags
from gradclip_cli.errors import GradclipError, InputError, UsageError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.logs import (
    LoggedNorms,
    LogKind,
    lightning_csv,
    mlflow_files,
    mlflow_sqlite,
    tensorboard,
    trackio_db,
    wandb_offline,
)
from gradclip_cli.source.logs.tracker import Tracker, TrackerRun, checked_point, in_step_order

TRACKERS: tuple[Tracker, ...] = (
    tensorboard.TRACKER,
    mlflow_files.TRACKER,
    mlflow_sqlite.TRACKER,
    trackio_db.TRACKER,
    wandb_offline.TRACKER,
    lightning_csv.TRACKER,
)

# Deep enough for mlruns/<experiment>/<run>/ and <output_dir>/wandb/offline-run-*/ from
# a run's folder; a folder that is no tracker's costs a listing per level.
MAX_DEPTH = 4
DEFAULT_NORM_TYPE = 2.0
NORM_TAGS = ("grad_norm", "grad_norm/total", "grad-norm")
# Lightning's grad_norm writes p as Python writes a float (2.0, inf) and refuses p <= 0.
_LIGHTNING_TOTAL = re.compile(r"^grad_([0-9]+(?:\.[0-9]+)?|inf)_norm_total$")
# A group's norm under a family's group prefix (gradclip/norm/<group>, Lightning's
# grad_<p>_norm/<parameter>, grad_norm/<group>), under any logger's prefix.
_GROUP_NORM = re.compile(r"(?:^|/)(?:gradclip/norm|grad_(?:[0-9]+(?:\.[0-9]+)?|inf)_norm"
                         r"|grad_norm)/.")
_NAMES_SHOWN = 8


class NoSuchTag(UsageError):
    """``--tag`` names no tag of this run (in a folder, another run may log it)."""


@dataclass(frozen=True)
class Choice:
    """``--tag`` and ``--run``: None lets the rule decide (and refuse where it cannot)."""

    tag: str | None = None
    run: str | None = None


@dataclass(frozen=True)
class TrackerSeries:
    """The norms read from one tracker run: ``entries`` one per step of ``tag``."""

    run: TrackerRun
    tag: str
    group_tags: int  # how many per-group tags came with it
    entries: tuple[LoggedNorms, ...]
    choice_note: str  # how the tag was chosen, and what else the run holds
    # The framework totals the run logged (``framework_totals``), read with the series:
    # copies of one logged number, which a run folder's other copies must match.
    totals: tuple[tuple[str, dict[int, float]], ...] = ()
    given: bool = False  # ``--tag`` named the tag (else the rule found it by name)
    named_as_norm: bool = True  # whether the tag's name is a gradient norm's (``named_as_norm``)

    @property
    def per_group(self) -> bool:
        return self.group_tags > 0

    def describe(self) -> str:
        groups = f" and {self.group_tags} per-group tag(s)" if self.group_tags else ""
        float32 = ", stored as float32" if self.run.stores_float32(self.tag) else ""
        return (f"{self.run.tracker} tag {visible(quoted(self.tag))}{groups} of run "
                f"{visible(self.run.label)}{float32}")


def _never(head: str) -> bool:
    return False


def _read_needs_choice(path: Path) -> list[LoggedNorms]:
    raise InputError(f"{path}: a tracker's series is read with its --tag/--run")


# What ``trend`` sees of a tracker series: a log whose entries are read already.
KIND = LogKind("tracker", _never, _read_needs_choice)


def claimed_in(folder: Path, excludes=None) -> dict[Tracker, list[Path]]:
    """Every entry under ``folder`` (``MAX_DEPTH`` levels) that a tracker claims, or
    ``folder`` itself when one claims it (an MLflow run's folder)."""
    found: dict[Tracker, list[Path]] = {}
    whole = next((t for t in TRACKERS if not t.descend and _claims(t, folder, True)), None)
    if whole is not None:
        return {whole: [folder]}

    def walk(path: Path, depth: int) -> None:
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            return  # an unreadable subfolder holds no tracker we could read
        for entry in entries:
            if entry.name.startswith(".") or entry.is_symlink():
                continue
            child = Path(entry.path)
            if excludes is not None and excludes(child):
                continue
            is_dir = entry.is_dir(follow_symlinks=False)
            owner = next((t for t in TRACKERS if _claims(t, child, is_dir)), None)
            if owner is not None:
                found.setdefault(owner, []).append(child)
                if not owner.descend:
                    continue
            if is_dir and depth < MAX_DEPTH:
                walk(child, depth + 1)

    walk(folder, 1)
    return found


def _claims(tracker: Tracker, path: Path, is_dir: bool) -> bool:
    try:
        return tracker.claims(path, is_dir)
    except InputError:
        return False  # a damaged or locked database beside the run: not claimed here


def holds_tracker_files(folder: Path) -> bool:
    """Whether ``folder`` itself holds a tracker's run (a ``version_N/`` of Lightning, a
    W&B run folder, an MLflow experiment): no checkpoint folder does."""
    return bool(claimed_in(folder))


def given_runs(path: Path) -> list[TrackerRun] | None:
    """The runs of one file named on the command line, None when no tracker's."""
    for tracker in TRACKERS:
        found = tracker.given(path)
        if found is not None:
            return found
    return None


def runs_in(folder: Path, excludes=None) -> list[list[TrackerRun]]:
    """The runs under ``folder``, a list per tracker store found."""
    return [tracker.runs(paths) for tracker, paths in claimed_in(folder, excludes).items()]


def choose_runs(stores: list[list[TrackerRun]], choice: Choice, where: str
                ) -> list[TrackerRun]:
    """One run per store: its only one, or the one ``--run`` names."""
    stores = [runs for runs in stores if runs]
    if choice.run is None:
        for runs in stores:
            if len(runs) > 1:
                raise UsageError(f"{where}: {len(runs)} {runs[0].tracker} runs "
                                 f"({_names(r.label for r in runs)}): one trend judges one "
                                 "run; give --run NAME (a run's name or id)")
        return [runs[0] for runs in stores]
    chosen = []
    for runs in stores:
        # A name given whole picks its run, though another's name ends with it.
        matches = ([r for r in runs if choice.run in (r.name, r.id)]
                   or [r for r in runs if r.name.endswith("/" + choice.run)])
        if len(matches) > 1:
            # A TensorBoard run has no id: its name is its folder, whole as listed.
            tell = ("give --run ID" if all(r.id for r in matches) else
                    "give --run with one's whole name, as listed")
            raise UsageError(f"{where}: --run {choice.run} names "
                             f"{len(matches)} {runs[0].tracker} runs "
                             f"({_names(r.label for r in matches)}): {tell}")
        chosen += matches
    if stores and not chosen:
        every = [r.label for runs in stores for r in runs]
        raise UsageError(f"{where}: no run named {choice.run}; its runs: "
                         f"{_names(every)}")
    return chosen


def _names(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _NAMES_SHOWN else "")


@dataclass(frozen=True)
class _Family:
    rank: int
    total: str
    group_prefix: str | None
    norm_type: float
    origin: str


def _families(tags: Iterable[str]) -> list[_Family]:
    families = []
    for tag in tags:
        prefix, base = _split_prefix(tag, tracker_tags.TOTAL_NORM)
        if base is not None:
            families.append(_Family(0, tag, prefix + tracker_tags.GROUP_NORM_PREFIX,
                                    DEFAULT_NORM_TYPE, "gradclip's own tag"))
            continue
        prefix, name = tag.rpartition("/")[0::2] if "/" in tag else ("", tag)
        prefix = prefix + "/" if prefix else ""
        match = _LIGHTNING_TOTAL.match(name)
        if match and "gradclip/" not in prefix and float(match.group(1)) > 0:
            p = float(match.group(1))
            families.append(_Family(1, tag, f"{prefix}grad_{match.group(1)}_norm/", p,
                                    "Lightning's grad_norm"))
            continue
        for norm_tag in NORM_TAGS:
            prefix, base = _split_prefix(tag, norm_tag)
            if base is not None and "gradclip/" not in prefix and "_norm/" not in prefix:
                groups = prefix + "grad_norm/" if norm_tag == "grad_norm/total" else None
                families.append(_Family(2, tag, groups, DEFAULT_NORM_TYPE,
                                        "a framework's total"))
                break
    return families


def _split_prefix(tag: str, name: str) -> tuple[str, str | None]:
    """``(prefix, name)`` when ``tag`` is ``name`` under a logger's ``prefix/``, else
    ``("", None)``."""
    if tag == name:
        return "", name
    if tag.endswith("/" + name):
        return tag[: -len(name)], name
    return "", None


def named_as_norm(tag: str) -> bool:
    """Whether ``tag``'s name is a gradient norm's by the rule that finds them by name: a
    family's total (``gradclip/total_norm``, ``grad_<p>_norm_total``, ``grad_norm``, ...)
    or a group's norm under one (``gradclip/norm/<group>``, ``grad_<p>_norm/<parameter>``,
    ``grad_norm/<group>``), under any logger's prefix. ``train/loss`` is not."""
    return bool(_families([tag])) or _GROUP_NORM.search(tag) is not None


def framework_totals(run: TrackerRun) -> list[tuple[str, dict[int, float]]]:
    """The totals a framework logged itself in ``run`` (``grad_norm``, Lightning's
    ``grad_2.0_norm_total``, Megatron's ``grad-norm``, under any logger's prefix),
    each ``(tag, {step: norm})``: what the norm audit holds against gradclip's own."""
    return _framework_totals(run.scalars(), run)


def _framework_totals(scalars, run: TrackerRun, warn: bool = True
                      ) -> list[tuple[str, dict[int, float]]]:
    found = []
    for family in _families(scalars):
        if family.rank == 0 or family.norm_type != DEFAULT_NORM_TYPE:
            continue  # gradclip's own tag; a total of another p is no 2-norm to compare
        where = f"{run.source}: tag {quoted(family.total)}"
        found.append((family.total, dict(_checked(scalars[family.total], where, warn))))
    return found


def total_name(tag: str) -> str:
    """A framework total's name less the logger's prefix (``train/grad_norm`` ->
    ``grad_norm``): copies of one logged number share it."""
    for name in NORM_TAGS:
        if _split_prefix(tag, name)[1] is not None:
            return name
    return tag.rpartition("/")[2]


def norm_series(run: TrackerRun, choice: Choice) -> TrackerSeries:
    """The run's gradient norms: the tag the rule (or ``--tag``) names, its groups."""
    scalars = run.scalars()
    source = str(run.source)
    families = _families(scalars)
    if choice.tag is not None:
        if choice.tag not in scalars:
            known = [f.total for f in families] or sorted(scalars)
            raise NoSuchTag(f"{source}: no tag {quoted(choice.tag)} in run "
                             f"{run.label}; its {'norm ' if families else ''}tags: "
                             f"{_names(quoted(t) for t in known) or 'none'}")
        family = next((f for f in families if f.total == choice.tag), None)
        if family is None:
            family = _Family(3, choice.tag, None, DEFAULT_NORM_TYPE, "--tag")
        how = "--tag"
    else:
        if not scalars:
            raise InputError(f"{source}: run {run.label} holds no scalars")
        if not families:
            raise InputError(f"{source}: run {run.label} logs no gradient norm under a tag "
                             f"trend knows ({', '.join(NORM_TAGS)}, grad_<p>_norm_total, "
                             f"{tracker_tags.TOTAL_NORM}); its {len(scalars)} tag(s): "
                             f"{_names(quoted(t) for t in sorted(scalars))}; "
                             "give --tag NAME")
        best = min(f.rank for f in families)
        first = [f for f in families if f.rank == best]
        if len(first) > 1:
            raise UsageError(f"{source}: run {run.label} holds {len(first)} gradient-norm "
                             f"tags ({_names(quoted(f.total) for f in first)}); "
                             "give --tag NAME to read one")
        family = first[0]
        others = [f.total for f in families if f is not family]
        how = f"found by name ({family.origin})" + (
            f"; also there, not read: {_names(visible(quoted(t)) for t in others)}"
            if others else "")
    groups = {} if family.group_prefix is None else {
        tag[len(family.group_prefix):]: tag for tag in scalars
        if tag.startswith(family.group_prefix) and tag != family.total
        and len(tag) > len(family.group_prefix)}
    where = f"{source}: tag {quoted(family.total)}"
    total = _checked(scalars[family.total], where)
    by_group = {g: dict(_checked(scalars[t], f"{source}: tag {quoted(t)}"))
                for g, t in groups.items()}
    p = family.norm_type
    stated_p = _stated_norm_types(scalars, family, source)
    entries = tuple(
        LoggedNorms(step, value, stated_p.get(step, p),
                    {g: points[step] for g, points in by_group.items() if step in points})
        for step, value in total) if by_group else tuple(
        LoggedNorms(step, value, stated_p.get(step, p)) for step, value in total)
    if not entries:
        raise InputError(f"{where}: no points")
    note = f"tag {visible(quoted(family.total))} {how}"
    try:
        totals = tuple(_framework_totals(scalars, run, warn=False))
    except GradclipError:
        totals = ()  # a damaged tag beside the one read: no copy to hold others against
    return TrackerSeries(run, family.total, len(groups), entries, note, totals,
                         given=choice.tag is not None,
                         named_as_norm=named_as_norm(family.total))


def _stated_norm_types(scalars, family: _Family, source: str) -> dict[int, float]:
    """p by step where gradclip's writers logged it (``gradclip/norm_type``, under the
    total's prefix: they log it only where p is not 2, ``tracker_scalars``); empty for
    any other family."""
    if family.rank != 0:
        return {}
    tag = family.total[: -len(tracker_tags.TOTAL_NORM)] + tracker_tags.NORM_TYPE
    where = f"{source}: tag {quoted(tag)}"
    stated = dict(_checked(scalars.get(tag, []), where))
    for step, p in stated.items():
        if not p > 0:
            raise InputError(f"{where}: step {step}: a norm type must be > 0, got {p:g}")
    return stated


def _checked(points, where: str, warn: bool = True):
    return in_step_order([checked_point(s, v, where) for s, v in points], where, warn)
