"""Instructions per training step, counted by valgrind: the same whatever the machine's load.

Times on a shared machine move by 5-10% between runs (BENCHMARKS.md); the
number of instructions a step executes does not. For each contender this
runs ``valgrind --tool=callgrind`` twice over the same process, once doing
``--steps`` calls after the warm-up and once doing none, and prints the
difference per call. Setup, imports and warm-up cancel out.

    .venv/bin/python -m benchmarks.step_instructions                  # 1,000 small tensors
    .venv/bin/python -m benchmarks.step_instructions --shapes gpt2 --steps 3

Contenders: torch's ``clip_grad_norm_`` (the floor of monitor_bench's
tables) and ``GradMonitor.step`` logging every step, with no clipping
(``max_norm`` far above the norm, as in ``benchmarks.monitor_bench``).
Needs valgrind; takes a few minutes (the two runs of a contender go side by side).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

WARM_UP = 8
NO_CLIP = 1e30


def _one_process(contender: str, shapes: str, calls: int) -> None:
    """The measured process: set up, warm up, then ``calls`` calls of ``contender``."""
    import torch

    from gradclip_cli import GradMonitor

    from .inputs import gpt2_shapes, uniform_shapes
    from .monitor_bench import gpt2_sized_model

    torch.set_num_threads(1)
    model = gpt2_sized_model(
        torch.float32, "cpu", gpt2_shapes() if shapes == "gpt2" else uniform_shapes(1000, 4096)
    )
    params = list(model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        monitor = GradMonitor(model, os.path.join(folder, "grads.jsonl"), None)
        run = {
            "torch clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(params, NO_CLIP),
            "GradMonitor.step": monitor.step,
        }[contender]
        for _ in range(WARM_UP + calls):
            run()
        monitor.close()


def _instructions(contender: str, shapes: str, calls: int, folder: str) -> subprocess.Popen:
    out = os.path.join(folder, f"{contender.split()[0]}.{calls}.out")
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
        sys.executable, "-m", "benchmarks.step_instructions", "--one", contender,
        "--shapes", shapes, "--steps", str(calls),
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _collected(process: subprocess.Popen) -> int:
    _, err = process.communicate()
    if process.returncode:
        raise SystemExit(f"step_instructions: valgrind failed:\n{err[-2000:]}")
    match = re.search(r"Collected : (\d+)", err)
    if match is None:
        raise SystemExit(f"step_instructions: no count in valgrind's output:\n{err[-2000:]}")
    return int(match.group(1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="small", choices=["gpt2", "small"])
    parser.add_argument("--steps", type=int, default=20, help="measured calls per contender")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # inside valgrind: one process
    args = parser.parse_args(argv)
    if args.one:
        _one_process(args.one, args.shapes, args.steps)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("step_instructions: needs valgrind on PATH")
    contenders = ["torch clip_grad_norm_", "GradMonitor.step"]
    per_call = {}
    with tempfile.TemporaryDirectory() as folder:
        for contender in contenders:
            pair = [_instructions(contender, args.shapes, n, folder) for n in (0, args.steps)]
            none, some = map(_collected, pair)
            per_call[contender] = (some - none) / args.steps
    title = "GPT-2 124M shapes" if args.shapes == "gpt2" else "1,000 small tensors"
    print(f"{title}, float32 on cpu, 1 thread; instructions per call "
          f"(valgrind callgrind, {args.steps} calls after {WARM_UP} warm-up, minus none)\n")
    print("| per step | instructions | vs torch |\n| --- | ---: | ---: |")
    floor = per_call[contenders[0]]
    for contender, n in per_call.items():
        print(f"| {contender} | {n / 1e6:.1f}M | {n / floor:.2f}x |")


if __name__ == "__main__":
    main()
