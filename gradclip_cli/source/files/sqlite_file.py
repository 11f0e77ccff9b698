"""A tracker's SQLite database (MLflow's ``mlflow.db``, a trackio project), opened read-only.

``sqlite3`` opens it through a ``file:`` URI with ``mode=ro`` (SQLite's
read-only open: nothing is written, not even a journal), so reading a run's
database while its tracker writes it changes nothing. A database another
process holds locked is waited for a little, then reported (exit 3), never
read half-way. Errors name the file; nothing of its content is quoted.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.small_file import read_head

HEADER = b"SQLite format 3\x00"
# How long to wait for a writer's lock before reporting it (seconds).
LOCK_WAIT = 2.0


def is_sqlite(path: Path) -> bool:
    """Whether ``path`` is a regular file that starts as an SQLite database does."""
    try:
        return read_head(path, len(HEADER), what="an SQLite database") == HEADER
    except InputError:
        return False


def _failure(path: Path, error: sqlite3.Error) -> InputError:
    text = str(error)
    shown = visible(str(path))
    if "locked" in text or "busy" in text:
        return InputError(f"{shown}: the database is locked (its tracker is writing it?); "
                          "try again when the write ends")
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return InputError(f"{shown}: not a readable SQLite database ({visible(text)[:80]})")
    return InputError(f"{shown}: cannot read the SQLite database ({visible(text)[:80]})")


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection to ``path``; SQLite errors become ``InputError`` naming it."""
    uri = Path(path).absolute().as_uri() + "?mode=ro"
    try:
        connection = sqlite3.connect(uri, uri=True, timeout=LOCK_WAIT)
    except sqlite3.Error as error:
        raise _failure(path, error) from None
    try:
        yield connection
    except sqlite3.Error as error:
        raise _failure(path, error) from None
    finally:
        connection.close()


def columns(connection: sqlite3.Connection) -> dict[str, set[str]]:
    """Each table's name -> its column names."""
    tables = [row[0] for row in connection.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {t: {row[1] for row in connection.execute(
        "SELECT * FROM pragma_table_info(?)", (t,))} for t in tables}
