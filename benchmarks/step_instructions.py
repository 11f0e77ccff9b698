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

Two things to know when reading the counts. Valgrind counts each repetition
of a ``rep movsb`` as one instruction, so glibc's ``memcpy`` of a 16 KB block
counts about 16,000 where the CPU runs one instruction moving tens of bytes
a cycle; with ``callgrind_annotate`` on PATH (it comes with valgrind) the
table says how many of a step's instructions were inside glibc's
``memcpy``/``memmove``, and the count without them. And valgrind's CPU has
no AVX-512: torch runs its AVX2 kernels under it (``kernels.ROW`` is 128
there), whatever the machine.
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


def _instructions(
    contender: str, shapes: str, calls: int, folder: str
) -> tuple[subprocess.Popen, str]:
    out = os.path.join(folder, f"{contender.split()[0]}.{calls}.out")
    command = [
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
        sys.executable, "-m", "benchmarks.step_instructions", "--one", contender,
        "--shapes", shapes, "--steps", str(calls),
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return process, out


def _collected(started: tuple[subprocess.Popen, str]) -> tuple[int, int | None]:
    """The process's instructions, and those inside glibc's memcpy/memmove (None
    without ``callgrind_annotate``)."""
    process, out = started
    _, err = process.communicate()
    if process.returncode:
        raise SystemExit(f"step_instructions: valgrind failed:\n{err[-2000:]}")
    match = re.search(r"Collected : (\d+)", err)
    if match is None:
        raise SystemExit(f"step_instructions: no count in valgrind's output:\n{err[-2000:]}")
    return int(match.group(1)), _in_copies(out)


# glibc's copy routines (memcpy, mempcpy, memmove, in each CPU's variant), as
# callgrind_annotate names them: "N (p%)  file:__memcpy_avx_unaligned_erms [lib]".
_COPY = re.compile(r"^\s*([\d,]+)\s.*:__mem(?:p?cpy|move)_\w+ \[")


def _in_copies(out: str) -> int | None:
    """Instructions counted inside glibc's copy routines (their own, not callees')."""
    annotate = shutil.which("callgrind_annotate")
    if annotate is None:
        return None
    listing = subprocess.run([annotate, "--threshold=100", out], capture_output=True,
                             text=True, check=True).stdout
    return sum(int(m.group(1).replace(",", "")) for m in map(_COPY.match, listing.splitlines())
               if m)


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
    per_call, copies = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for contender in contenders:
            pair = [_instructions(contender, args.shapes, n, folder) for n in (0, args.steps)]
            (none, none_copies), (some, some_copies) = map(_collected, pair)
            per_call[contender] = (some - none) / args.steps
            if none_copies is not None:
                copies[contender] = (some_copies - none_copies) / args.steps
    title = "GPT-2 124M shapes" if args.shapes == "gpt2" else "1,000 small tensors"
    print(f"{title}, float32 on cpu, 1 thread; instructions per call "
          f"(valgrind callgrind, {args.steps} calls after {WARM_UP} warm-up, minus none)\n")
    floor = per_call[contenders[0]]
    if not copies:
        print("| per step | instructions | vs torch |\n| --- | ---: | ---: |")
        for contender, n in per_call.items():
            print(f"| {contender} | {n / 1e6:.1f}M | {n / floor:.2f}x |")
        return
    rest_floor = floor - copies[contenders[0]]
    print("| per step | instructions | vs torch | in memcpy/memmove | the rest | vs torch |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    for contender, n in per_call.items():
        rest = n - copies[contender]
        print(f"| {contender} | {n / 1e6:.1f}M | {n / floor:.2f}x "
              f"| {copies[contender] / 1e6:.1f}M | {rest / 1e6:.1f}M | {rest / rest_floor:.2f}x |")
    print("\nvalgrind counts a `rep movsb` one instruction per byte moved: the copies' count "
          "is bytes more than work.")


if __name__ == "__main__":
    main()
