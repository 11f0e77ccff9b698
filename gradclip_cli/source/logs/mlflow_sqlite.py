"""MLflow's SQLite store (``mlflow.db``, its default since MLflow 3.7), read-only, without mlflow.

Tables ``runs`` (``run_uuid``, ``name``, ``lifecycle_stage``) and
``metrics`` (``key``, ``value``, ``timestamp``, ``step``, ``is_nan``,
``run_uuid``), as MLflow's SQLAlchemy store creates them. That store keeps
a NaN as ``value = 0, is_nan = 1`` and an infinity as float64's largest
finite number with its sign (``sqlalchemy_store``: SQL has no infinities),
so those values read back as NaN and +-inf; a norm of exactly 1.8e308 would
read as inf. Values are float64. Points are taken in the order they were
written (timestamp, then row); deleted runs are not runs.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

from gradclip_cli.source.files import sqlite_file
from gradclip_cli.source.logs.tracker import Points, Tracker, TrackerRun

NAME = "MLflow"
SUFFIXES = (".db", ".sqlite", ".sqlite3")
_TABLES = {"runs": {"run_uuid", "name", "lifecycle_stage"},
           "metrics": {"key", "value", "timestamp", "step", "is_nan", "run_uuid"}}
_STORED_INF = sys.float_info.max


def is_schema(tables: dict[str, set[str]]) -> bool:
    return all(columns <= tables.get(table, set()) for table, columns in _TABLES.items())


def _is_store(path: Path) -> bool:
    if not sqlite_file.is_sqlite(path):
        return False
    with sqlite_file.read_only(path) as connection:
        return is_schema(sqlite_file.columns(connection))


def claims(path: Path, is_dir: bool) -> bool:
    return not is_dir and path.suffix in SUFFIXES and _is_store(path)


def runs(claimed: Sequence[Path]) -> list[TrackerRun]:
    found = []
    for db in claimed:
        with sqlite_file.read_only(db) as connection:
            rows = connection.execute(
                "SELECT run_uuid, name FROM runs WHERE lifecycle_stage != 'deleted' "
                "ORDER BY start_time, run_uuid").fetchall()
        for run_id, name in rows:
            found.append(TrackerRun(NAME, str(name or run_id), str(run_id), db,
                                    lambda db=db, run_id=run_id: read_scalars(db, run_id)))
    return found


def given(path: Path) -> list[TrackerRun] | None:
    return runs([path]) if _is_store(path) else None


def read_scalars(db: Path, run_id: str) -> dict[str, Points]:
    scalars: dict[str, Points] = {}
    with sqlite_file.read_only(db) as connection:
        rows = connection.execute(
            "SELECT key, step, value, is_nan FROM metrics WHERE run_uuid = ? "
            "ORDER BY timestamp, rowid", (run_id,))
        for key, step, value, is_nan in rows:
            if is_nan:
                value = math.nan
            elif isinstance(value, float) and abs(value) == _STORED_INF:
                value = math.copysign(math.inf, value)
            scalars.setdefault(str(key), []).append((step, value))
    return scalars


TRACKER = Tracker(NAME, None, claims, runs, given)
