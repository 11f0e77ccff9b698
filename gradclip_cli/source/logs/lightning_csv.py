"""Lightning's ``CSVLogger`` file (``<save_dir>/<name>/version_N/metrics.csv``).

One header row (``step``, ``epoch`` and every key logged), then a row per
logged step, a cell left empty where that key was not logged; values as
Python writes floats (``nan``, ``inf``). The run is the ``version_N``
folder, named by its path as found (``logs/exp_b/version_0``). Values are
float64 as written (Lightning logs a tensor's value).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.logs import read_text
from gradclip_cli.source.logs.tracker import Points, Tracker, TrackerRun

NAME = "Lightning CSVLogger"
FILE_NAME = "metrics.csv"
STEP = "step"


def claims(path: Path, is_dir: bool) -> bool:
    return not is_dir and path.name == FILE_NAME


def _run(file: Path) -> TrackerRun:
    # Named by its folder as found, as a TensorBoard run is: each experiment
    # (``CSVLogger(name=...)``) numbers its versions from 0, so ``version_0`` alone may
    # be two runs; ``--run version_0`` or ``exp_b/version_0`` picks by the name's tail.
    return TrackerRun(NAME, str(file.parent), "", file, lambda: read_scalars(file))


def runs(claimed: Sequence[Path]) -> list[TrackerRun]:
    return [_run(file) for file in sorted(claimed)]


def given(path: Path) -> list[TrackerRun] | None:
    if path.suffix != ".csv":
        return None
    header = next(_rows(read_text(path, "a CSV file")), [])
    return [_run(path)] if STEP in header else None


def _rows(text: str):
    """The CSV rows of ``text``, read as csv wants its input (``newline=""``): a quoted
    key's line breaks stay in the key (``splitlines`` dropped them, and split on
    U+0085 and U+2028 too)."""
    return csv.reader(io.StringIO(text, newline=""))


def read_scalars(file: Path) -> dict[str, Points]:
    shown = str(file)
    rows = _rows(read_text(file, "a Lightning metrics.csv"))
    header = next(rows, None)
    if not header or STEP not in header:
        raise InputError(f"{shown}: no \"step\" column: not a Lightning CSVLogger file")
    at = header.index(STEP)
    scalars: dict[str, Points] = {}
    for number, row in enumerate(rows, 2):
        if not row:
            continue
        if len(row) != len(header):
            raise InputError(f"{shown}:{number}: {len(row)} cells under a header of "
                             f"{len(header)} (a write in progress, or a damaged file?)")
        try:
            step = int(row[at])
        except ValueError:
            raise InputError(f"{shown}:{number}: step {quoted(row[at])[:40]} is "
                             "not a whole number") from None
        for key, cell in zip(header, row):
            if key == STEP or key == "epoch" or cell == "":
                continue
            try:
                value = float(cell)
            except ValueError:
                continue  # not a number: not a scalar
            scalars.setdefault(key, []).append((step, value))
    return scalars


TRACKER = Tracker(NAME, None, claims, runs, given)
