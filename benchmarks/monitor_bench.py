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

Contenders, per training step:
- ``torch``: ``torch.nn.utils.clip_grad_norm_``, the floor;
- ``gradclip``: the drop-in ``gradclip_cli.clip_grad_norm_`` (no log);
- ``monitor``: ``GradMonitor.clip_grad_norm_`` logging every step (a JSON
  line per step to a temporary file, per-layer groups, the spike rule);
- ``monitor every=10``: the same logging one step in ten, per step.
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


def gpt2_sized_model(dtype: torch.dtype) -> torch.nn.Module:
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
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
        param.grad = grad
        owner.register_parameter(leaf, param)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)

    model = gpt2_sized_model(dtype)
    params = list(model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        every_step = GradMonitor(model, os.path.join(folder, "a.jsonl"), None)
        one_in_ten = GradMonitor(model, os.path.join(folder, "b.jsonl"), None, every=10)

        def ten_steps_of_one_in_ten():
            for _ in range(10):
                one_in_ten.clip_grad_norm_(NO_CLIP)

        results = interleaved(
            {
                "torch": lambda: torch.nn.utils.clip_grad_norm_(params, NO_CLIP),
                "gradclip": lambda: gradclip_clip_grad_norm_(params, NO_CLIP),
                "monitor": lambda: every_step.clip_grad_norm_(NO_CLIP),
                "monitor every=10": ten_steps_of_one_in_ten,
            },
            repeats=args.repeats,
        )
        lines = sum(1 for _ in open(os.path.join(folder, "a.jsonl")))
        every_step.close()
        one_in_ten.close()

    per_step = {name: r.median / (10 if "every=10" in name else 1) for name, r in results.items()}
    floor = per_step["torch"]
    print(f"GPT-2 124M shapes: {len(params)} tensors, {numel(gpt2_shapes()):,} elements, "
          f"{args.dtype}; {args.repeats} repetitions (+1 warm-up), medians")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, load average "
          f"{os.getloadavg()[0]:.2f}; the every-step monitor wrote {lines} lines")
    print()
    print("| per step | median ms | vs torch |")
    print("| --- | ---: | ---: |")
    for name, seconds in per_step.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / floor:.2f}x |")


if __name__ == "__main__":
    main()
