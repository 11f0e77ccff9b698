"""The progress display on stderr: shown only to a person watching a terminal.

Nothing is drawn when stderr is not a terminal (CI logs, pipes) or with
``--quiet``; nor for runs that finish within ``DELAY_S``, so a small file's
output is not preceded by a flicker. The bar is transient: it leaves no trace
in scrollback.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress

DELAY_S = 0.5


class Steps:
    """One bar per step: ``begin(label, total_bytes)`` then ``advance(nbytes)``."""

    def __init__(self, progress: Progress | None):
        self._progress = progress
        self._task = None

    def begin(self, label: str, total: int | None = None) -> None:
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.update(self._task, visible=False)
        self._task = self._progress.add_task(label, total=total)

    def advance(self, nbytes: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, nbytes)


@contextmanager
def progress_steps(quiet: bool) -> Iterator[Steps]:
    if quiet or not sys.stderr.isatty():
        yield Steps(None)
        return
    # rich is imported only here, when a person may watch: pipes and CI never pay for it.
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    timer = threading.Timer(DELAY_S, progress.start)
    timer.daemon = True
    timer.start()
    try:
        yield Steps(progress)
    finally:
        timer.cancel()
        timer.join()
        if progress.live.is_started:
            progress.stop()
