"""GradMonitor's and the drop-ins' cost per step, against torch's ``clip_grad_norm_``.

One process, one set of parameters with GPT-2 124M's shapes (or 1,000 small
tensors, ``--shapes small``) and seeded gradients (benchmarks/inputs.py).
Most contenders clip with a ``max_norm`` far above the norm: the coefficient
is then exactly 1, so the gradients stay the same between repetitions. torch
still multiplies by it; gradclip on the CPU skips that multiply (see the
clipping pair below for a step that clips). Contenders alternate within each
repetition (timing.interleaved); medians are reported.

    .venv/bin/python -m benchmarks.monitor_bench            # GPT-2 124M, float32
    .venv/bin/python -m benchmarks.monitor_bench --shapes small   # 1,000 x 4,096
    .venv/bin/python -m benchmarks.monitor_bench --dtype bfloat16 --repeats 9
    python -m benchmarks.monitor_bench --device cuda    # on a GPU machine
    .venv/bin/python -m benchmarks.monitor_bench --clock cpu   # CPU time, on a loaded machine

On CUDA every contender is followed by ``torch.cuda.synchronize()``, so each
time includes the work it queued; the monitor's logged steps also
synchronise inside (to read the norms back), the others do not.

Contenders, per training step:
- ``torch``: ``torch.nn.utils.clip_grad_norm_``, the floor;
- ``gradclip``: the drop-in ``gradclip_cli.clip_grad_norm_`` (no log);
- ``monitor``: ``GradMonitor.clip_grad_norm_`` logging every step (a JSON
  line per step to a temporary file, per-layer groups, the spike rule);
- ``monitor, step not logged``: a step that ``every=N`` skips (the drop-in
  plus a step counter). With ``every=N`` a step costs on average
  ``(logged + (N - 1) * not_logged) / N``; the report prints it for N = 10;
- ``gradclip get_total_norm`` and ``GradMonitor.step`` (measure and log, no
  clipping), against the same floor;
- the ``clipping`` pair: torch's and gradclip's ``clip_grad_norm_`` with a
  ``max_norm`` just below the current norm (tracked as the gradients shrink
  by ~1e-4 a call), so the coefficient is below 1 and both multiply. With a
  coefficient of exactly 1, gradclip on the CPU skips the multiply (it knows
  the coefficient without a sync, and multiplying by 1 changes no bit).

Each contender's relative error against the float64 norm of the gradients
is printed beside its time.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time

import torch

from gradclip_cli import GradMonitor
from gradclip_cli import clip_grad_norm_ as gradclip_clip_grad_norm_
from gradclip_cli import get_total_norm as gradclip_get_total_norm

from .inputs import gpt2_shapes, gradients, numel, uniform_shapes
from .timing import interleaved

NO_CLIP = 1e30  # far above any total here: coefficient 1, gradients unchanged


def gpt2_sized_model(dtype: torch.dtype, device: str, shapes=None) -> torch.nn.Module:
    """A module with GPT-2 124M's parameter names and shapes (or ``shapes``), gradients set."""
    model = torch.nn.Module()
    shapes = gpt2_shapes() if shapes is None else shapes
    for (name, shape), grad in zip(shapes, gradients(shapes, dtype, seed=0)):
        owner = model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        param.grad = grad.to(device)
        owner.register_parameter(leaf, param)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="gpt2", choices=["gpt2", "small"],
                        help="GPT-2 124M's 148 tensors, or 1,000 tensors of 4,096 elements")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall time (default), or this process's CPU time, which the "
                             "load of other processes on a shared machine does not inflate")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    shapes = gpt2_shapes() if args.shapes == "gpt2" else uniform_shapes(1000, 4096)
    model = gpt2_sized_model(dtype, args.device, shapes)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    reference = _float64_norm(grads)
    # The clipping pair clips to just below the norm each call: both multiply.
    state = {"norm": reference}

    def clipping(clip):
        def run():
            max_norm = state["norm"] * (1 - 1e-4)
            total = clip(params, max_norm)
            state["norm"] *= min(1.0, max_norm / (state["norm"] + 1e-6))
            return total

        return run

    errors = {}

    def checked(name, run):
        def timed():
            # The reference is taken once per contender, on its first (untimed) call.
            before = _float64_norm(grads) if name not in errors else None
            out = run()
            if name not in errors and out is not None:
                value = out["total_norm"] if isinstance(out, dict) else float(out)
                errors[name] = abs(value - before) / before
            return out

        return timed

    with tempfile.TemporaryDirectory() as folder:
        every_step = GradMonitor(model, os.path.join(folder, "a.jsonl"), None)
        # Logs its step 0 (the warm-up repetition), then none of the timed ones.
        rarely = GradMonitor(model, os.path.join(folder, "b.jsonl"), None, every=10**9)

        measuring = GradMonitor(model, os.path.join(folder, "c.jsonl"), None)
        contenders = {
            "torch": lambda: torch.nn.utils.clip_grad_norm_(params, NO_CLIP),
            "gradclip": lambda: gradclip_clip_grad_norm_(params, NO_CLIP),
            "gradclip get_total_norm": lambda: gradclip_get_total_norm(grads),
            "GradMonitor.step": lambda: measuring.step(),
            "monitor": lambda: every_step.clip_grad_norm_(NO_CLIP),
            "monitor, step not logged": lambda: rarely.clip_grad_norm_(NO_CLIP),
            "torch, clipping": clipping(torch.nn.utils.clip_grad_norm_),
            "gradclip, clipping": clipping(gradclip_clip_grad_norm_),
        }
        contenders = {name: checked(name, run) for name, run in contenders.items()}
        if torch.device(args.device).type == "cuda":
            contenders = {name: _synchronised(run) for name, run in contenders.items()}
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        results = interleaved(contenders, repeats=args.repeats, clock=clock)
        lines = sum(1 for _ in open(os.path.join(folder, "a.jsonl")))
        every_step.close()
        rarely.close()
        measuring.close()

    per_step = {name: r.median for name, r in results.items()}
    per_step["monitor every=10 (average)"] = (
        per_step["monitor"] + 9 * per_step["monitor, step not logged"]
    ) / 10
    floor = per_step["torch"]
    title = "GPT-2 124M shapes" if args.shapes == "gpt2" else "1,000 small tensors"
    print(f"{title}: {len(params)} tensors, {numel(shapes):,} elements, "
          f"{args.dtype} on {args.device}; {args.repeats} repetitions (+1 warm-up), medians"
          f"{', CPU time' if args.clock == 'cpu' else ''}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load average "
          f"{os.getloadavg()[0]:.2f}; the every-step monitor wrote {lines} lines")
    print()
    print("| per step | median ms | time vs torch | speed vs torch | rel. error vs float64 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seconds in per_step.items():
        error = f"{errors[name]:.1e}" if name in errors else ""
        baseline = per_step["torch, clipping"] if name == "gradclip, clipping" else floor
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / baseline:.2f}x "
              f"| {baseline / seconds:.2f}x | {error} |")
    print()
    print('"speed vs torch" is torch\'s time over the contender\'s (above 1: faster); '
          '"gradclip, clipping" is against "torch, clipping", every other row against "torch".')


def _float64_norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _synchronised(run):
    def timed():
        run()
        torch.cuda.synchronize()

    return timed


if __name__ == "__main__":
    main()
