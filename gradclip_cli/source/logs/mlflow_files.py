"""MLflow's file store (``mlruns/<experiment>/<run>/``), read as text without mlflow.

A run folder holds ``meta.yaml`` (``run_id``, ``run_name``,
``lifecycle_stage``), ``tags/<key>`` (a file per tag holding its value as
given: ``mlflow.runName`` is the run's name, which meta.yaml keeps as YAML
writes it, quoted, escaped or folded across lines) and ``metrics/<key>``,
one file per metric (a key with ``/`` is a nested path), a line per logged
value: ``<timestamp> <value> <step>``, the value as Python writes a float
(``nan``, ``inf``, ``-inf`` too). Values are float64. A deleted run
(``lifecycle_stage: deleted``) is not a run, nor is an MLflow 3 LoggedModel
(``<experiment>/models/<model_id>/``, its ``meta.yaml`` a ``model_id``, no
``run_id``), whose metrics are its run's, linked to it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.logs import read_text
from gradclip_cli.source.logs.tracker import Points, Tracker, TrackerRun

NAME = "MLflow"
META = "meta.yaml"
METRICS = "metrics"
RUN_NAME_TAG = Path("tags", "mlflow.runName")


def claims(path: Path, is_dir: bool) -> bool:
    return is_dir and os.path.isfile(path / META) and os.path.isdir(path / METRICS)


def _meta(folder: Path) -> dict[str, str]:
    """meta.yaml's top-level ``key: value`` lines (MLflow writes it flat)."""
    fields = {}
    for line in read_text(folder / META, "an MLflow run's meta.yaml").splitlines():
        key, sep, value = line.partition(":")
        if sep and not line.startswith((" ", "-")):
            fields[key.strip()] = value.strip().strip("'\"")
    return fields


def runs(claimed: Sequence[Path]) -> list[TrackerRun]:
    found = []
    for folder in sorted(claimed):
        meta = _meta(folder)
        if meta.get("lifecycle_stage") == "deleted":
            continue
        if "model_id" in meta and "run_id" not in meta:
            continue  # a LoggedModel (models/<model_id>/): its run's metrics, linked
        run_id = meta.get("run_id") or folder.name
        name = _run_name(folder) or meta.get("run_name") or run_id
        found.append(TrackerRun(NAME, name, run_id, folder,
                                lambda folder=folder: read_scalars(folder)))
    return found


def _run_name(folder: Path) -> str | None:
    """The run's name as it was given (its ``mlflow.runName`` tag), where MLflow kept it."""
    tag = folder / RUN_NAME_TAG
    return read_text(tag, "an MLflow run's name") if os.path.isfile(tag) else None


def given(path: Path) -> list[TrackerRun] | None:
    return None  # a run is a folder; one metric file alone is not a run


def read_scalars(folder: Path) -> dict[str, Points]:
    scalars = {}
    root = folder / METRICS
    for parent, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            file = Path(parent) / name
            key = file.relative_to(root).as_posix()
            scalars[key] = _read_metric(file)
    return scalars


def _read_metric(file: Path) -> Points:
    points = []
    for number, line in enumerate(read_text(file, "an MLflow metric").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        fields = line.split()
        # Three fields since MLflow 1.0; a line cut short (a write in progress, a
        # damaged file) is refused, never read as another step.
        if len(fields) != 3:
            raise InputError(f"{where}: not an MLflow metric line "
                             "(<timestamp> <value> <step>)")
        try:
            value = float(fields[1])
            step = int(fields[2])
        except ValueError:
            raise InputError(f"{where}: not an MLflow metric line "
                             "(<timestamp> <value> <step>)") from None
        points.append((step, value))
    return points


TRACKER = Tracker(NAME, None, claims, runs, given, descend=False)
