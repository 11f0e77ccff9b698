"""kill -9 during ``clip --in-place`` of a set: what the folder holds after each kill.

Shared by the set tests (HF sharded, DCP, DCP's Hugging Face layout): a
``gradclip clip FOLDER --max-norm 1 --in-place`` process is killed once its
temporary folder appears, once it holds ``half`` files, and not at all
(the end). After each, the folder must be whole: the same file names, and
either every byte as before or a set whose total norm is 1 (never a mix).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.cli.support import rel_err


def digests(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
            for n in sorted(os.listdir(folder))}


def kill_during_clip(folder: Path, total_norm: Callable[[Path], float], *,
                     half: int) -> list[str]:
    """``"<when>: old set|new set, N leftover"`` for each kill, stopping at the first new
    set; ``total_norm(folder)`` reads a changed set back (float64, without gradclip)."""
    parent = folder.parent
    original = digests(folder)
    seen = []
    for when in ["temp-appears", "temp-half", "end"]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gradclip_cli", "clip", str(folder), "--max-norm", "1",
             "--in-place", "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        start = time.monotonic()
        if when != "end":
            want = 1 if when == "temp-appears" else half
            while proc.poll() is None and time.monotonic() - start < 60:
                temps = list(parent.glob(f".{folder.name}.clipped-*.tmp"))
                with contextlib.suppress(OSError):
                    if temps and len(os.listdir(temps[0])) >= want:
                        break
                time.sleep(0.002)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=600)
        now = digests(folder)
        assert set(now) == set(original)
        if now == original:
            state = "old set"
        else:
            assert rel_err(total_norm(folder), 1.0) <= 1e-3, "a mix of old and new"
            state = "new set"
        leftovers = sorted(p.name for p in parent.iterdir() if p.name.startswith("."))
        seen.append(f"{when}: {state}, {len(leftovers)} leftover")
        for leftover in leftovers:
            shutil.rmtree(parent / leftover)
        if state == "new set":
            break
    print("\n" + "\n".join(seen))
    return seen
