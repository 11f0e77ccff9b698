"""The measurements behind BENCHMARKS.md "Findings" 1 and 2.

    .venv/bin/python -m benchmarks.probes       # about a minute

1. Throughput of each torch op the core could use, one thread, on 1 MiB
   pieces of 48M float32 values, and the accuracy of vector_norm's and sum's
   accumulation on rows of equal values.
2. ``tensor_power_sums`` on 12 x 4M float32 under each thread setting, with
   the machine quiet and with one core held by a busy loop.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from gradclip_cli.core import tensor_power_sums  # noqa: E402


def gbps(fn, nbytes: int, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / 1e9 / statistics.median(times)


def ops() -> None:
    torch.set_num_threads(1)
    x = torch.randn(48 << 20, generator=torch.Generator().manual_seed(0))
    pieces = list(x.split(1 << 18))
    buf = torch.empty(1 << 18)
    n = x.numel() * 4
    cases = {
        "aminmax": lambda: [torch.aminmax(c) for c in pieces],
        "mul + sum": lambda: [torch.mul(c, c, out=buf).sum() for c in pieces],
        "vector_norm, rows of 256": lambda: [
            torch.linalg.vector_norm(c.view(-1, 256), 2, dim=1) for c in pieces],
        "vector_norm, whole tensor": lambda: torch.linalg.vector_norm(x),
    }
    print("| op (1 thread, 1 MiB pieces) | GB/s |\n| --- | --- |")
    for name, fn in cases.items():
        print(f"| {name} | {gbps(fn, n):.1f} |")
    print("\n| rows of 60000.0, length | vector_norm rel. err of sum | mul+sum rel. err |")
    print("| --- | --- | --- |")
    for length in (256, 1024, 4096):
        rows = torch.full((64, length), 60000.0)
        want = 60000.0**2 * length
        vn = (torch.linalg.vector_norm(rows, 2, dim=1).double() ** 2 / want - 1).abs().max()
        ms = ((rows * rows).sum(1).double() / want - 1).abs().max()
        print(f"| {length} | {float(vn):.1e} | {float(ms):.1e} |")


def threads() -> None:
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(4 << 20, generator=g) for _ in range(12)]
    n = sum(t.numel() * 4 for t in ts)
    print("\n| load | torch threads | gradclip workers | gradclip GB/s | torch GB/s |")
    print("| --- | --- | --- | --- | --- |")
    for load in ("quiet", "one core busy"):
        busy = None
        if load != "quiet":
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for threads_, workers in ((2, 1), (1, 1), (1, 2)):
                torch.set_num_threads(threads_)
                ours = gbps(lambda: tensor_power_sums(ts, 2.0, workers=workers), n)  # noqa: B023
                theirs = gbps(lambda: torch.nn.utils.get_total_norm(ts), n)
                print(f"| {load} | {threads_} | {workers} | {ours:.1f} | {theirs:.1f} |")
        finally:
            if busy is not None:
                busy.kill()


if __name__ == "__main__":
    ops()
    threads()
