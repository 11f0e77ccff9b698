"""Which series of a trend's inputs the norm audit holds against each other (``report/norm_audit``).

A framework's own total: each ``trainer_state.json`` read (a run folder's,
or given) with a ``grad_norm``. gradclip's: the monitor log beside it in the
same run folder, or among the inputs given; else the ``gradclip/total_norm``
its Trainer callback put in that same ``log_history``. A reader of another
framework total a tracker logged in the run folder (TensorBoard, MLflow,
W&B, trackio, Lightning's CSV: its ``grad_norm`` tag, ``trackers.framework_totals``)
is audited the same way, and so is every run of a store that holds several (a
Lightning fit resumed into a new logger version), which trend judges none of
without ``--run``.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import GradclipError
from ..report.norm_audit import NormAudit, NormSeries, audit_norms
from ..source import run_folder
from ..source.logs import monitor_log, trackers, trainer_state
from ..source.run_folder import RunFolder

TRAINER_GRAD_NORM = "Trainer grad_norm"
MONITOR_LOG = "gradclip monitor log"
LOGGED_TAGS = "gradclip/total_norm in log_history"


def norm_audits(runs: list[RunFolder], logs: list[tuple[Path, object, list]]) -> list[NormAudit]:
    """Every audit the inputs allow: per run folder, and over the logs given directly
    (``(path, kind, entries)`` each); an audit per framework series that shares steps
    with a gradclip series."""
    groups: list[tuple[list[Path], list[NormSeries]]] = []
    audits, done = [], set()
    for run in runs:
        states = [s.paths[0] for s in run.series if s.kind == run_folder.TRAINER_STATE]
        monitors = [_monitor(s.paths[0], s.entries) for s in run.series
                    if s.kind == run_folder.MONITOR]
        groups.append((states, monitors))
        if not monitors:
            continue
        tracked = [s.tracker.run for s in run.series
                   if s.kind == run_folder.TRACKER and s.tracker is not None]
        for tracker_run in tracked + list(run.audited_runs):
            try:
                totals = trackers.framework_totals(tracker_run)
            except GradclipError:
                # A run not read as a series (its note says why) that cannot be read.
                if tracker_run not in run.audited_runs:
                    raise
                continue
            for tag, norms in totals:
                framework = NormSeries(str(tracker_run.source), f"{tracker_run.tracker} "
                                       f"{tag}", norms)
                for gradclip in monitors:
                    audit = audit_norms(framework, gradclip)
                    if audit is not None:
                        audits.append(audit)
    states = [path for path, kind, _ in logs if kind is trainer_state.KIND]
    monitors = [_monitor(path, entries) for path, kind, entries in logs
                if kind is monitor_log.KIND]
    groups.append((states, monitors))
    for states, monitors in groups:
        for path in states:
            for framework in framework_series(path):
                gradclip = monitors or _in_file(path)
                for series in gradclip:
                    key = (framework.source, framework.kind, series.source, series.kind)
                    audit = None if key in done else audit_norms(framework, series)
                    done.add(key)
                    if audit is not None:
                        audits.append(audit)
    return audits


def framework_series(path: Path) -> list[NormSeries]:
    """The framework's own totals a file holds (a Trainer's ``grad_norm``)."""
    norms = trainer_state.framework_totals(path)
    return [NormSeries(str(path), TRAINER_GRAD_NORM, norms)] if norms else []


def _monitor(path: Path, entries) -> NormSeries:
    # A later line of a step (a resumed run's) replaces the earlier one, in both maps.
    norms, scaled = {}, {}
    for e in entries:
        if e.step is None:
            continue
        norms[e.step] = e.total_norm
        scaled.pop(e.step, None)
        if e.clip_coef is not None:
            scaled[e.step] = e.total_norm * e.clip_coef
    return NormSeries(str(path), MONITOR_LOG, norms, scaled)


def _in_file(path: Path) -> list[NormSeries]:
    norms = trainer_state.gradclip_totals(path)
    return [NormSeries(str(path), LOGGED_TAGS, norms)] if norms else []
