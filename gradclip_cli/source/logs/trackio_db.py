"""trackio's project database (``<project>.db`` in ``TRACKIO_DIR``), SQLite, read-only.

Table ``metrics`` (``run_name``, ``step``, ``metrics``; ``run_id`` in newer
trackio), a row per ``trackio.log`` call whose ``metrics`` is a JSON object
of key -> value; trackio writes a NaN as ``"NaN"`` and the infinities as
``"Infinity"``/``"-Infinity"`` (``utils.serialize_values``). Values that
are not numbers (media, tables) are not scalars. Values are float64. A row
is at its ``step``, or at its ``train/global_step`` where it logs one (the
Hugging Face Trainer's callback: its ``step`` counts log calls). A run
is its ``run_id`` where the table has one (two runs may share a name), else
its name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.files import sqlite_file
from gradclip_cli.source.logs.tracker import Points, Tracker, TrackerRun
from gradclip_cli.source.untrusted import is_number

NAME = "trackio"
SUFFIXES = (".db",)
_COLUMNS = {"run_name", "step", "metrics"}
_WORDS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# The Hugging Face Trainer's trackio callback logs without ``step=`` (trackio then
# numbers the log calls from 0, evaluations included) and puts the Trainer's own
# step in every row under this key: the row's values sit at that step.
TRAINER_STEP = "train/global_step"


def _has_run_id(tables: dict[str, set[str]]) -> bool:
    return "run_id" in tables.get("metrics", set())


def is_schema(tables: dict[str, set[str]]) -> bool:
    return _COLUMNS <= tables.get("metrics", set()) and "runs" not in tables


def _tables(path: Path) -> dict[str, set[str]] | None:
    if not sqlite_file.is_sqlite(path):
        return None
    with sqlite_file.read_only(path) as connection:
        return sqlite_file.columns(connection)


def claims(path: Path, is_dir: bool) -> bool:
    if is_dir or path.suffix not in SUFFIXES:
        return False
    tables = _tables(path)
    return tables is not None and is_schema(tables)


def runs(claimed: Sequence[Path]) -> list[TrackerRun]:
    found = []
    for db in claimed:
        with sqlite_file.read_only(db) as connection:
            by_id = _has_run_id(sqlite_file.columns(connection))
            rows = connection.execute(
                "SELECT run_name, run_id, MIN(id) FROM metrics GROUP BY run_id, run_name "
                "ORDER BY MIN(id)" if by_id else
                "SELECT run_name, run_name, MIN(rowid) FROM metrics GROUP BY run_name "
                "ORDER BY MIN(rowid)").fetchall()
        for name, run_id, _ in rows:
            found.append(TrackerRun(NAME, str(name), str(run_id) if by_id else "", db,
                                    lambda db=db, name=name, run_id=run_id, by_id=by_id:
                                    read_scalars(db, name, run_id if by_id else None)))
    return found


def given(path: Path) -> list[TrackerRun] | None:
    tables = _tables(path)
    return runs([path]) if tables is not None and is_schema(tables) else None


def _number(value: object) -> float | None:
    if isinstance(value, str):
        return _WORDS.get(value)
    if is_number(value):
        return float(value)
    return None


def read_scalars(db: Path, name: str, run_id: str | None) -> dict[str, Points]:
    scalars: dict[str, Points] = {}
    with sqlite_file.read_only(db) as connection:
        if run_id is None:
            rows = connection.execute(
                "SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY rowid", (name,))
        else:
            rows = connection.execute(
                "SELECT step, metrics FROM metrics WHERE run_id = ? ORDER BY id", (run_id,))
        for step, text in rows:
            try:
                logged = json.loads(text)
            except (TypeError, ValueError):
                logged = None
            if not isinstance(logged, dict):
                raise InputError(f"{db}: run {name}: step "
                                 f"{step}: metrics is not a JSON object")
            trainer_step = logged.get(TRAINER_STEP)
            if type(trainer_step) is int and trainer_step >= 0:
                step = trainer_step
            for key, value in logged.items():
                number = _number(value)
                if number is not None:
                    scalars.setdefault(str(key), []).append((step, number))
    return scalars


TRACKER = Tracker(NAME, None, claims, runs, given)
