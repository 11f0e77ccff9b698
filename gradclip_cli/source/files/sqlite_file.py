"""A tracker's SQLite database (MLflow's ``mlflow.db``, a trackio project), opened read-only.

``sqlite3`` opens it through a ``file:`` URI with ``mode=ro`` (SQLite's
read-only open: nothing is written, not even a journal), so reading a run's
database while its tracker writes it changes nothing. A database in WAL mode
(trackio's) is the exception: SQLite makes its ``-wal`` and ``-shm`` files
beside it for any reader, read-only or not, and deletes them when the last
connection closes. So where there is no ``-wal`` file (no connection has the
database open: its writer is gone) it is opened ``immutable``, as one whose
pages all lie in the file, and nothing is made beside it; where a writer
has it open, its files are there already and are used as SQLite shares
them. A database another
process holds locked is waited for a little, then reported (exit 3), never
read half-way. Errors name the file; nothing of its content is quoted.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from gradclip_cli.errors import InputError
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
    shown = str(path)  # raw: the message is escaped once, whole, where it is shown
    if "locked" in text or "busy" in text:
        return InputError(f"{shown}: the database is locked (its tracker is writing it?); "
                          "try again when the write ends")
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return InputError(f"{shown}: not a readable SQLite database ({text[:80]})")
    return InputError(f"{shown}: cannot read the SQLite database ({text[:80]})")


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection to ``path``; SQLite errors become ``InputError`` naming it."""
    uri = Path(path).absolute().as_uri() + "?mode=ro"
    if _closed_wal(path):
        uri += "&immutable=1"
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


# The header's file format write and read versions (bytes 18 and 19): 2 in WAL mode
# (https://www.sqlite.org/fileformat2.html, "The Database Header").
_WAL_VERSIONS = (18, 20, b"\x02\x02")


def _closed_wal(path: Path) -> bool:
    """Whether ``path`` is in WAL mode with no ``-wal`` file beside it: no connection
    has it open, every page is in the file."""
    start, end, wal = _WAL_VERSIONS
    try:
        head = read_head(path, end, what="an SQLite database")
    except InputError:
        return False  # the open reports it
    return head[start:end] == wal and not os.path.lexists(f"{path}-wal")


def columns(connection: sqlite3.Connection) -> dict[str, set[str]]:
    """Each table's name -> its column names."""
    tables = [row[0] for row in connection.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")]
    return {t: {row[1] for row in connection.execute(
        "SELECT * FROM pragma_table_info(?)", (t,))} for t in tables}
