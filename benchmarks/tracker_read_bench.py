"""Issue 38: a 1,000,000-point TensorBoard scalar series, gradclip's read against tensorboard's.

One event file holds a ``train/grad_norm`` scalar at each of 1,000,000
steps (``simple_value``, as torch's ``SummaryWriter`` writes it; written here
with tensorboard's own ``EventFileWriter``, which is faster at making the
file). Timed side by side in one process, alternating (``timing.interleaved``),
in CPU seconds of this process (``time.process_time``: the shared machines
these were measured on run other work too):

* ``tensorboard``: tensorboard's reader alone: ``LegacyEventFileLoader``
  iterated to the end, every ``Event`` parsed, each scalar's value taken (the
  ratio is against this one);
* ``tensorboard compat``: ``EventFileLoader``, the loader TensorBoard's own
  backend uses: the same, plus its compat layers (for scale);
* ``gradclip read``: what ``trend`` does with the file before judging it:
  the same records, the check that they account for every byte, the tag
  chosen by name, every point checked (step, sign) and made a point.

And once, end to end, ``gradclip trend FILE --format json`` in a fresh
process (start-up, reading, judging, the JSON of a million points).

    .venv/bin/python -m benchmarks.tracker_read_bench [--points N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .timing import interleaved

TAG = "train/grad_norm"


def write_series(folder: Path, points: int) -> Path:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(folder), max_queue_size=4096, flush_secs=3600)
    for step in range(points):
        value = 1.0 + (step % 97) / 100.0
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=TAG,
                                                                       simple_value=value)])
        writer.add_event(event_pb2.Event(step=step, wall_time=1.0, summary=summary))
    writer.close()
    (file,) = folder.glob("events.out.tfevents.*")
    return file


def tensorboard_events(path: Path) -> int:
    """tensorboard's event reader: ``LegacyEventFileLoader``, each record parsed as an
    ``Event``, each scalar's value taken."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    count = 0
    for event in LegacyEventFileLoader(str(path)).Load():
        for value in event.summary.value:
            _ = value.simple_value
            count += 1
    return count


def tensorboard_compat(path: Path) -> int:
    """What TensorBoard's own backend reads with: ``EventFileLoader``, the same events
    passed through its compat layers (a simple_value becomes a tensor summary)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    count = 0
    for event in EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            _ = value.tensor.float_val[0]
            count += 1
    return count


def gradclip_read(path: Path) -> int:
    from gradclip_cli.source.logs import trackers

    (run,) = trackers.given_runs(path)
    return len(trackers.norm_series(run, trackers.Choice()).entries)


def _counted(read, points: int) -> None:
    count = read()
    assert count == points, (count, points)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=0,
                        help="untimed rounds first (the file is in the page cache already)")
    parser.add_argument("--compat", action="store_true",
                        help="also time EventFileLoader (3-4x the others)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = write_series(Path(tmp), args.points)
        print(f"wrote {args.points:,} points, {os.path.getsize(path) / 1e6:.1f} MB in "
              f"{time.perf_counter() - start:.1f} s: {path.name}", file=sys.stderr)
        contenders = {"tensorboard": lambda: tensorboard_events(path),
                      "gradclip read": lambda: gradclip_read(path)}
        if args.compat:
            contenders["tensorboard compat"] = lambda: tensorboard_compat(path)
        counts = interleaved({n: lambda f=f: _counted(f, args.points)
                              for n, f in contenders.items()}, 1, warmup=0)
        del counts  # each contender read every point once (checked), untimed here
        # CPU time of this process: on a shared machine, other processes' load
        # does not add to it (wall time there measured the queue, not the reader).
        results = interleaved(contenders, args.repeats, warmup=args.warmup,
                              clock=time.process_time)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-m", "gradclip_cli", "trend", str(path),
                               "--format", "json"], capture_output=True, timeout=3600)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        end_to_end = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    tb, gc = results["tensorboard"].median, results["gradclip read"].median
    print(f"{args.points:,} points, CPU seconds, median of {args.repeats} (interleaved), "
          f"Python {platform.python_version()}")
    print(f"  tensorboard LegacyEventFileLoader:  {tb:.2f} s")
    if args.compat:
        compat = results["tensorboard compat"].median
        print(f"  tensorboard EventFileLoader:        {compat:.2f} s  ({compat / tb:.2f}x)")
    print(f"  gradclip read (to points):          {gc:.2f} s  ({gc / tb:.2f}x)")
    print(f"  gradclip trend FILE --format json:  {end_to_end:.2f} s end to end (a fresh "
          f"process: start-up, read, judge, JSON; one run, exit {done.returncode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
