"""W&B run files (``wandb/offline-run-*/run-<id>.wandb``, and synced ``run-*/`` folders').

A ``.wandb`` file is W&B's transaction log: LevelDB-log framed records, each
a ``wandb_internal_pb2.Record``; every ``history`` record is one
``run.log`` call, a step (``history.step.num``) and items whose
``value_json`` is the value in JSON (``NaN``, ``Infinity``). They are read
through the wandb package's own reader, ``wandb.sdk.internal.datastore``
(which checks each record's CRC), and its own proto. That reader is
internal to wandb and was removed in wandb 0.30, so the versions it is
used with are pinned (``TESTED``); any other installed version is refused
(exit 3) naming the extra, never guessed at. The file is opened read-only
(the reader's own ``open_for_scan`` opens it for writing too). A run resumed
offline (``wandb.init(id=ID, resume=...)``) is a folder per session, all of one
id: one run, its sessions read in the order they ran.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Sequence
from pathlib import Path

from gradclip_cli.errors import InputError, MissingExtraError
from gradclip_cli.source.logs.tracker import Points, Tracker, TrackerRun
from gradclip_cli.source.untrusted import is_number

NAME = "W&B"
EXTRA = "wandb"
SUFFIX = ".wandb"
RUN_FOLDERS = ("offline-run-", "run-")
# The wandb versions whose datastore reader gradclip is tested with: [low, high).
TESTED = ((0, 22), (0, 30))
REQUIREMENT = "wandb>=0.22,<0.30"


def claims(path: Path, is_dir: bool) -> bool:
    return not is_dir and path.suffix == SUFFIX and path.parent.name.startswith(RUN_FOLDERS)


def _run_id(file: Path) -> str:
    return file.stem.removeprefix("run-")


def _run(file: Path) -> TrackerRun:
    name = _display_name(file) or file.parent.name
    return TrackerRun(NAME, name, _run_id(file), file, lambda: read_scalars(file))


def _started(file: Path) -> str:
    """``YYYYMMDD_HHMMSS`` of the session's folder (an id may hold ``-`` itself)."""
    return file.parent.name.removeprefix("offline-").removeprefix("run-").split("-", 1)[0]


def _sessions(files: list[Path]) -> TrackerRun:
    """One run written by several sessions (``wandb.init(id=ID, resume=...)`` offline:
    a folder each, ``<kind>-<YYYYMMDD_HHMMSS>-<id>``), read in the order they ran, as
    one series: the resumed session's steps supersede the earlier ones from there
    (``in_step_order``), as ``wandb sync`` makes them one run. Its source is the folder
    that holds the sessions' folders."""
    files = sorted(files, key=lambda f: (_started(f), str(f)))
    last = files[-1]
    name = _display_name(last) or last.parent.name

    def scalars() -> dict[str, Points]:
        merged: dict[str, Points] = {}
        for file in files:
            for key, points in read_scalars(file).items():
                merged.setdefault(key, []).extend(points)
        return merged

    source = Path(os.path.commonpath([f.parent for f in files]))
    return TrackerRun(NAME, name, _run_id(last), source, scalars)


# The run record (its name) follows the header; a file whose first records hold
# none keeps its folder's name.
_NAME_RECORDS = 8


def _display_name(file: Path) -> str | None:
    """The run's name as W&B shows it (``wandb.init(name=...)``, the run record's
    ``display_name``); None where it cannot be read here (no wandb, a damaged file:
    reading the run's scalars says why)."""
    try:
        datastore, proto = _modules(file)
        with open(file, "rb") as handle:
            store = _open(datastore, file, handle)
            for _ in range(_NAME_RECORDS):
                data = store.scan_data()
                if data is None:
                    return None
                record = proto.Record()
                record.ParseFromString(data)
                if record.WhichOneof("record_type") == "run":
                    return record.run.display_name or None
    except Exception:  # noqa: BLE001 (a missing extra, the reader's asserts, DecodeError)
        return None
    return None


def runs(claimed: Sequence[Path]) -> list[TrackerRun]:
    by_id: dict[str, list[Path]] = {}
    for file in sorted(claimed):
        by_id.setdefault(_run_id(file), []).append(file)
    return [_run(files[0]) if len(files) == 1 else _sessions(files)
            for files in by_id.values()]


def given(path: Path) -> list[TrackerRun] | None:
    return [_run(path)] if path.suffix == SUFFIX else None


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _modules(file: Path):
    needs = (f"{file}: reading a W&B run file needs the wandb package, "
             f"{REQUIREMENT} (its datastore reader): pip install 'gradclip[wandb]'")
    try:
        from importlib.metadata import version

        installed = version("wandb")
    except Exception:  # noqa: BLE001 (PackageNotFoundError, or a broken install)
        raise MissingExtraError(needs) from None
    if not TESTED[0] <= _version(installed) < TESTED[1]:
        raise MissingExtraError(f"{needs}; wandb {installed} is installed, whose reader "
                         "gradclip is not tested with")
    try:
        from wandb.proto import wandb_internal_pb2
        from wandb.sdk.internal import datastore
    except ImportError:
        raise MissingExtraError(needs) from None
    return datastore, wandb_internal_pb2


def _open(datastore, file: Path, handle):
    """wandb's ``DataStore`` set up as ``open_for_scan`` does, on a read-only handle."""
    store = datastore.DataStore()
    store._fname = str(file)
    store._fp = handle
    store._index = 0
    store._size_bytes = os.fstat(handle.fileno()).st_size
    store._opened_for_scan = True
    store._read_header()
    return store


def read_scalars(file: Path) -> dict[str, Points]:
    datastore, proto = _modules(file)
    shown = str(file)
    scalars: dict[str, Points] = {}
    try:
        handle = open(file, "rb")  # noqa: SIM115 (closed below)
    except OSError as error:
        raise InputError(f"{shown}: cannot read: {error.strerror or error}") from None
    with handle:
        try:
            store = _open(datastore, file, handle)
        except Exception:  # noqa: BLE001 (the reader asserts on a bad header)
            raise InputError(f"{shown}: not a W&B run file (its header is not W&B's)") \
                from None
        _scan(store, proto, shown, scalars)
    return scalars


def _scan(store, proto, shown: str, scalars: dict[str, Points]) -> None:
    """Every history record's scalars into ``scalars``; damage is exit 3."""
    steps = _StepMetrics()
    while True:
        offset = store._index
        try:
            data = store.scan_data()
        except Exception:  # noqa: BLE001 (its checks are asserts, struct errors)
            raise InputError(f"{shown}: truncated or damaged at byte {offset} of "
                             f"{store._size_bytes}; the points before it are not taken "
                             "as the whole run") from None
        if data is None:
            break
        record = proto.Record()
        try:
            record.ParseFromString(data)
        except Exception:  # noqa: BLE001 (protobuf's DecodeError)
            raise InputError(f"{shown}: the record at byte {offset} is not a W&B "
                             "record (a damaged file?)") from None
        kind = record.WhichOneof("record_type")
        if kind == "metric":
            steps.define(record.metric)
        elif kind == "history":
            _history(record.history, scalars, steps)


class _StepMetrics:
    """``run.define_metric(name_or_glob, step_metric=X)``: the key whose value is the step
    of ``name``'s points. The Hugging Face Trainer's W&B callback defines ``"*"``
    against ``train/global_step``, so W&B's own ``_step`` (a count of ``log`` calls,
    evaluations included) is not the Trainer's step; the step metric is."""

    def __init__(self):
        self.names: list[str] = []  # every metric record's name, in order
        self.by_name: dict[str, str] = {}
        self.by_glob: list[tuple[str, str]] = []

    def define(self, metric) -> None:
        step = metric.step_metric
        if not step and metric.step_metric_index > 0:  # an earlier record's name, 1-based
            index = metric.step_metric_index - 1
            step = self.names[index] if index < len(self.names) else ""
        self.names.append(metric.name or metric.glob_name)
        if not step:
            return
        if metric.name:
            self.by_name[metric.name] = step
        elif metric.glob_name:
            self.by_glob.append((metric.glob_name, step))

    def of(self, key: str) -> str | None:
        if key in self.by_name:
            return self.by_name[key]
        return next((step for glob, step in self.by_glob
                     if fnmatch.fnmatchcase(key, glob) and key != step), None)


def _history(history, scalars: dict[str, Points], steps: _StepMetrics) -> None:
    items = {}
    for item in history.item:
        key = item.key or ".".join(item.nested_key)
        try:
            items[key] = json.loads(item.value_json)
        except ValueError:
            continue
    own = history.step.num if history.HasField("step") else items.get("_step")
    for key, value in items.items():
        if key.startswith("_"):  # _step, _runtime, _timestamp: W&B's own
            continue
        if not is_number(value):
            continue
        step = own
        metric = steps.of(key)
        if metric is not None and metric != key:
            at = items.get(metric)
            if is_number(at) and float(at).is_integer():
                step = int(at)
        if isinstance(step, int):
            scalars.setdefault(key, []).append((step, float(value)))


TRACKER = Tracker(NAME, EXTRA, claims, runs, given)
