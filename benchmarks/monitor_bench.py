"""GradMonitor's cost per training step, against ``torch.nn.utils.clip_grad_norm_``.

One process, one set of parameters with GPT-2 124M's shapes and seeded
gradients (benchmarks/inputs.py). Every contender clips the same gradients
with a ``max_norm`` far above their norm: the coefficient is then exactly 1,
so the gradients stay the same between repetitions while every contender
still does the full work (the norm, and the in-place multiply by the clamped
coefficient, which is not skipped when it is 1). Contenders alternate within
each repetition (timing.interleaved); medians are reported.

    .venv/bin/python -m benchmarks.monitor_bench            # GPT-2 124M, float32
    .venv/bin/python -m benchmarks.monitor_bench --dtype bfloat16 --repeats 9
    python -m benchmarks.monitor_bench --device cuda    # on a GPU machine

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
  ``(logged + (N - 1) * not_logged) / N``; the report prints it for N = 10.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile

import torch

from gradclip_cli import GradMonitor
from gradclip_cli import clip_grad_norm_ as gradclip_clip_grad_norm_

from .inputs import gpt2_shapes, gradients, numel
from .timing import interleaved

NO_CLIP = 1e30  # far above any total here: coefficient 1, gradients unchanged


def gpt2_sized_model(dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A module with GPT-2 124M's parameter names and shapes, gradients set."""
    model = torch.nn.Module()
    shapes = gpt2_shapes()
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
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    model = gpt2_sized_model(dtype, args.device)
    params = list(model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        every_step = GradMonitor(model, os.path.join(folder, "a.jsonl"), None)
        # Logs its step 0 (the warm-up repetition), then none of the timed ones.
        rarely = GradMonitor(model, os.path.join(folder, "b.jsonl"), None, every=10**9)

        contenders = {
            "torch": lambda: torch.nn.utils.clip_grad_norm_(params, NO_CLIP),
            "gradclip": lambda: gradclip_clip_grad_norm_(params, NO_CLIP),
            "monitor": lambda: every_step.clip_grad_norm_(NO_CLIP),
            "monitor, step not logged": lambda: rarely.clip_grad_norm_(NO_CLIP),
        }
        if torch.device(args.device).type == "cuda":
            contenders = {name: _synchronised(run) for name, run in contenders.items()}
        results = interleaved(contenders, repeats=args.repeats)
        lines = sum(1 for _ in open(os.path.join(folder, "a.jsonl")))
        every_step.close()
        rarely.close()

    per_step = {name: r.median for name, r in results.items()}
    per_step["monitor every=10 (average)"] = (
        per_step["monitor"] + 9 * per_step["monitor, step not logged"]
    ) / 10
    floor = per_step["torch"]
    print(f"GPT-2 124M shapes: {len(params)} tensors, {numel(gpt2_shapes()):,} elements, "
          f"{args.dtype} on {args.device}; {args.repeats} repetitions (+1 warm-up), medians")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load average "
          f"{os.getloadavg()[0]:.2f}; the every-step monitor wrote {lines} lines")
    print()
    print("| per step | median ms | vs torch |")
    print("| --- | ---: | ---: |")
    for name, seconds in per_step.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / floor:.2f}x |")


def _synchronised(run):
    def timed():
        run()
        torch.cuda.synchronize()

    return timed


if __name__ == "__main__":
    main()
