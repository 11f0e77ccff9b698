"""Side-by-side timing: contenders alternate within each repetition.

Running A, B, C, A, B, C, ... (rotating who goes first) instead of A x5 then
B x5 spreads the noise of a shared machine (other processes, CPU frequency,
page-cache churn) evenly over the contenders, so their medians can be compared.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# GNU time, to measure a child's peak RSS (see run_process); absent: RSS not reported.
TIME = shutil.which("time", path="/usr/bin:/bin")


@dataclass
class Result:
    """Seconds per repetition, and the peak RSS in bytes when measured (subprocesses)."""

    name: str
    seconds: list[float] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def max_rss(self) -> int:
        return max(self.peak_rss) if self.peak_rss else 0


def interleaved(
    contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Result]:
    """Time each callable ``repeats`` times, alternating them; warm-up runs are not kept.

    The order rotates every repetition, so no contender always runs first
    (right after another one's allocations) or last. ``clock`` is wall time
    unless given (``time.process_time``: the CPU time of this process's
    threads, which other processes' load does not add to).
    """
    names = list(contenders)
    results = {n: Result(n) for n in names}
    for r in range(warmup + repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = clock()
            outcome = contenders[name]()
            elapsed = clock() - start
            if r >= warmup:
                results[name].seconds.append(elapsed)
                if isinstance(outcome, int) and outcome > 0:
                    results[name].peak_rss.append(outcome)
    return results


def run_process(argv: Sequence[str], *, expect: Sequence[int] = (0,)) -> int:
    """Run a command to completion, output discarded; return its peak RSS in bytes.

    The command runs under ``/usr/bin/time``, which forks it from its own
    small process. Measuring our own child directly would be wrong: Linux
    carries a process's RSS high-water mark across ``exec``, and subprocess
    forks (or vforks) from this benchmark process, so every child would
    report at least this process's peak (1.2 GiB after the core benchmark).
    """
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        wrapped = [TIME, "-f", "%M", "-o", rss.name, *argv] if TIME else list(argv)
        proc = subprocess.run(wrapped, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=_quiet_env())
        if proc.returncode not in expect:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: "
                               f"{proc.stderr.decode(errors='replace')[-2000:]}")
        text = rss.read().strip().splitlines()
    return int(text[-1]) * 1024 if text else 0  # kilobytes on Linux


def _quiet_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
