"""Issue 8, item 9: what gradclip costs above ``import torch``, and inspect vs the plain script.

    .venv/bin/python -m benchmarks.startup_bench [--repeats 11] [--gpt2-repeats 5] [--baseline TREE]

Startup: three fresh processes, interleaved, on the small sample file
(sample_checkpoints/healthy.pt, 28 tensors): ``python -c "import torch"``;
the plain script (``torch.load(mmap=True)`` + ``get_total_norm``, as in
cli_bench); ``gradclip inspect FILE --format json``. Medians of wall time
and of CPU time (user + system, from the children's rusage: less sensitive
than wall time to other processes on a shared machine). gradclip's cost
above torch is its median minus ``import torch``'s.

Also the imports alone: the sum of ``-X importtime`` self times of the
modules a JSON run imports that ``import torch`` does not (minimum per
module over the runs), which excludes the work and the interpreter's own
start.

GPT-2 (``--gpt2-repeats``, 0 to skip): cli_bench's section 4 (floor, plain
script, gradclip) on the 498 MB float32 file of benchmarks/inputs.py.

gradclip's modules are byte-compiled first, as an installed package's are
(pip compiles them; an editable checkout under PYTHONDONTWRITEBYTECODE would
otherwise compile them on every run).
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .cli_bench import GRADCLIP, PLAIN_INSPECT, PYTHON

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_checkpoints" / "healthy.pt"


def timed(argv: list[str], path: str | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a child process run to completion, output discarded.

    ``path``: a tree whose gradclip_cli the child imports instead (PYTHONPATH).
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if path is not None:
        env["PYTHONPATH"] = path
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]!r}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def startup(repeats: int, baseline: str | None) -> dict[str, tuple[list[float], list[float]]]:
    path = str(SAMPLE)
    ours = [GRADCLIP, "inspect", path, "--format", "json"]
    contenders = {
        "python -c 'import torch'": ([PYTHON, "-c", "import torch"], None),
        "plain torch script": ([PYTHON, "-c", PLAIN_INSPECT, path], None),
        "gradclip inspect --format json": (ours, None),
    }
    if baseline is not None:
        compileall.compile_dir(Path(baseline) / "gradclip_cli", quiet=1)
        contenders[f"the same, gradclip from {baseline}"] = (ours, baseline)
    names = list(contenders)
    results: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    for r in range(1 + repeats):  # one warm-up round
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = timed(*contenders[name])
            if r:
                results[name][0].append(wall)
                results[name][1].append(cpu)
    return results


def _import_self_times(args: list[str]) -> dict[str, int]:
    proc = subprocess.run([PYTHON, "-X", "importtime", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    times = {}
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            self_us, _, name = line.split(":", 1)[1].split("|")
            times[name.strip()] = int(self_us)
    return times


def imports_above_torch(repeats: int) -> tuple[float, int, dict[str, float]]:
    """(ms, module count, ms by top-level package) of what a JSON run imports beyond torch."""
    torch_alone = set(_import_self_times(["-c", "import torch"]))
    best: dict[str, int] = {}
    for _ in range(repeats):
        run = _import_self_times(["-m", "gradclip_cli", "inspect", str(SAMPLE), "--format", "json"])
        for name, us in run.items():
            if name not in torch_alone:
                best[name] = min(best.get(name, us), us)
    by_package: dict[str, float] = {}
    for name, us in best.items():
        top = ".".join(name.split(".")[:2]) if name.startswith("gradclip_cli.") else \
            name.split(".")[0]
        by_package[top] = by_package.get(top, 0) + us / 1e3
    return sum(best.values()) / 1e3, len(best), by_package


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.0f} ms"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup_bench")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--gpt2-repeats", type=int, default=5)
    parser.add_argument("--baseline", metavar="TREE",
                        help="also time gradclip from another checkout (git archive of a commit)")
    args = parser.parse_args(argv)
    compileall.compile_dir(ROOT / "gradclip_cli", quiet=1)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at start: {load}\n")

    results = startup(args.repeats, args.baseline)
    base_wall, base_cpu = (statistics.median(x) for x in results["python -c 'import torch'"])
    print(f"Startup, `{SAMPLE.name}` ({SAMPLE.stat().st_size / 1e3:.0f} kB), median of "
          f"{args.repeats}, interleaved:\n")
    print("| contender | wall | above import torch | CPU | above import torch |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (wall, cpu) in results.items():
        dw = (statistics.median(wall) - base_wall) * 1e3
        dc = (statistics.median(cpu) - base_cpu) * 1e3
        print(f"| {name} | {_ms(wall)} | {dw:+.0f} ms | {_ms(cpu)} | {dc:+.0f} ms |")
    total, count, by_package = imports_above_torch(max(3, args.repeats // 2))
    print(f"\nImports a JSON run adds to `import torch`: {count} modules, {total:.1f} ms "
          "(sum of `-X importtime` self times, minimum per module): "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])
                      if v >= 0.5))
    print(f"\nload average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

    if args.gpt2_repeats:
        import torch

        from . import inputs
        from .cli_bench import _inspect_section

        gpt2 = inputs.checkpoint_file("gpt2_fp32", inputs.gpt2_shapes(), torch.float32)
        res, text, ours = _inspect_section("GPT-2 124M float32", gpt2, args.gpt2_repeats, 1)
        print("\n" + text)
        print(f"time / plain torch: {ours / res['plain torch script'].median:.2f}x; "
              f"time / floor: {ours / res['floor (import torch, read file)'].median:.2f}x; "
              f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    sys.exit(main())
