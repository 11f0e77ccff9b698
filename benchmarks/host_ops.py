"""Host work per call on the accelerator path, counted without an accelerator.

The drop-ins and ``GradMonitor`` run here on ``meta`` tensors: torch's device
without data, which takes the same non-CPU code path as CUDA. A
``TorchDispatchMode`` counts every aten op that reaches the dispatcher (what
the host issues: kernel launches on a GPU, and the CPU bookkeeping of a
few numbers per tensor) and every host read (an
``item()``/``bool()``/``float()`` of a device tensor, or a copy from the
device to the CPU, each a host-device synchronisation on a GPU). A copy of
floating-point values is answered with made-up norms, seeded, between 1 and
2 (a calm run, which never spikes), other reads with zeros, so the code after
them runs on as it would on real gradients.

The monitor's spike rule works differently as its history fills, so a logged
step is counted three times in one run: at step 1 (too short a history to
judge), step 10 (warming up: judged against the first points) and step 30
(past the ``warmup`` of 25: running averages). With its default groups (one
a layer: 15 here) the rule runs on plain floats, which no count here sees
(``benchmarks/spike_series_bench.py`` times them); with one group a tensor
(``group_by="tensor"``: 148, more than ``FEW_SERIES``) it runs in float64
tensor ops on the host, counted in the "by tensor" rows.

Two sets of shapes: GPT-2 124M (148 tensors) and the same tensors 4x wider
(their last dimension times 4). Host work that follows the number of tensors,
not their size, gives the same counts for both; torch's own
``torch.nn.utils.clip_grad_norm_`` is the reference.

    .venv/bin/python -m benchmarks.host_ops

Goals (issue 18): no growth with tensor size; the drop-ins at most 3x
torch's ops and no read; ``GradMonitor.step`` at most 5x torch's ops and at
most one read on a logged step, none on a step it does not log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils import _foreach_utils
from torch.utils._python_dispatch import TorchDispatchMode

from gradclip_cli import (
    GradMonitor,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
)

from .inputs import gpt2_shapes

aten = torch.ops.aten


class HostOpCounter(TorchDispatchMode):
    """Counts aten ops and host reads; answers reads of ``meta`` tensors with zeros."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.device_ops = 0
        self.reads = 0
        self._norms = torch.Generator().manual_seed(0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if _on_device(args):
            self.device_ops += 1
        if func is aten._local_scalar_dense.default and args[0].device.type != "cpu":
            self.reads += 1
            return False if args[0].dtype == torch.bool else 0
        if func is aten._to_copy.default and _to_host(args[0], kwargs.get("device")):
            self.reads += 1
            dtype = kwargs.get("dtype") or args[0].dtype
            if not dtype.is_floating_point:
                return torch.zeros(args[0].shape, dtype=dtype)
            return 1 + torch.rand(args[0].shape, generator=self._norms, dtype=dtype)
        if (
            func is aten.copy_.default
            and args[0].device.type == "cpu"
            and args[1].device.type != "cpu"
        ):
            self.reads += 1
            return args[0].zero_()
        return func(*args, **kwargs)


def _on_device(args) -> bool:
    """Whether an op works on a non-CPU tensor: on a GPU, a kernel launch."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                return True
    return False


def _to_host(source: torch.Tensor, device) -> bool:
    return source.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"


@dataclass(frozen=True)
class Count:
    ops: int  # every aten op: device work and the CPU bookkeeping of a few numbers
    device_ops: int  # ops on device tensors: kernel launches on a GPU
    reads: int


def count(call: Callable[[], object]) -> Count:
    """Ops and reads of one call (after one uncounted call, so that caches are warm)."""
    with HostOpCounter():  # reads of meta tensors need an answer even uncounted
        call()
    with HostOpCounter() as counter:
        call()
    return Count(counter.ops, counter.device_ops, counter.reads)


def wider(shapes, factor: int):
    """The same tensors with their last dimension ``factor`` times longer."""
    return [(name, (*shape[:-1], shape[-1] * factor)) for name, shape in shapes]


def meta_model(shapes) -> torch.nn.Module:
    """A module with these parameter names and shapes on ``meta``, gradients set."""
    model = torch.nn.Module()
    for name, shape in shapes:
        owner = model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        param = torch.nn.Parameter(torch.empty(shape, device="meta"))
        param.grad = torch.empty(shape, device="meta")
        owner.register_parameter(leaf, param)
    return model


# The logged steps counted in one run of the monitor, by what its spike rule does.
LOGGED_STEPS = {1: "step 1, short history", 10: "step 10, warm-up", 30: "step 30, after warm-up"}


def counts(shapes, folder: str) -> dict[str, Count]:
    """Every contender's counts on one model of ``shapes``."""
    model = meta_model(shapes)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    total = torch.zeros((), device="meta")
    skipped = GradMonitor(model, os.path.join(folder, "skipped.jsonl"), None, every=10**9)
    count(skipped.step)  # steps 0 (and 1) are logged here; the counted calls are not
    result = {
        "torch clip_grad_norm_": count(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)),
        "torch clip_grad_value_": count(lambda: torch.nn.utils.clip_grad_value_(params, 1.0)),
        "get_total_norm": count(lambda: get_total_norm(grads)),
        "clip_grads_with_norm_": count(lambda: clip_grads_with_norm_(params, 1.0, total)),
        "clip_grad_norm_": count(lambda: clip_grad_norm_(params, 1.0)),
        "clip_grad_value_": count(lambda: clip_grad_value_(params, 1.0)),
    }
    for method in ("step", "clip_grad_norm_"):
        path = os.path.join(folder, f"logged-{method}.jsonl")
        for step, c in logged_steps(GradMonitor(model, path, None), method).items():
            result[f"GradMonitor.{method}, logged, {LOGGED_STEPS[step]}"] = c
    # One group a tensor: more groups than FEW_SERIES, judged in tensors.
    monitor = GradMonitor(model, os.path.join(folder, "by-tensor.jsonl"), None, group_by="tensor")
    for step, c in logged_steps(monitor, "step").items():
        result[f"GradMonitor.step by tensor, logged, {LOGGED_STEPS[step]}"] = c
    result["GradMonitor.step, not logged"] = count(lambda: skipped.step())
    result["GradMonitor.clip_grad_norm_, not logged"] = count(
        lambda: skipped.clip_grad_norm_(1.0))
    return result


def logged_steps(monitor: GradMonitor, method: str) -> dict[int, Count]:
    """The counts of ``monitor``'s ``method`` (``step``, or ``clip_grad_norm_`` to
    1.0) at the steps of ``LOGGED_STEPS``, every step before them run and logged."""
    call = monitor.step if method == "step" else lambda: monitor.clip_grad_norm_(1.0)
    out = {}
    for step in range(max(LOGGED_STEPS) + 1):
        with HostOpCounter() as counter:
            call()
        if step in LOGGED_STEPS:
            out[step] = Count(counter.ops, counter.device_ops, counter.reads)
    return out


@contextlib.contextmanager
def foreach_on_meta():
    """torch's and gradclip's code as on CUDA: ``meta`` counted among the devices
    with fused ``_foreach`` kernels (torch has meta kernels for them)."""
    original = _foreach_utils._get_foreach_kernels_supported_devices
    _foreach_utils._get_foreach_kernels_supported_devices = lambda: [*original(), "meta"]
    try:
        yield
    finally:
        _foreach_utils._get_foreach_kernels_supported_devices = original


def report(factor: int = 4, fused: bool = False) -> str:
    shapes = gpt2_shapes()
    with (
        tempfile.TemporaryDirectory() as folder,
        foreach_on_meta() if fused else contextlib.nullcontext(),
    ):
        base = counts(shapes, folder)
        wide = counts(wider(shapes, factor), folder)
    floor = base["torch clip_grad_norm_"]
    kernels = (
        "fused `_foreach` kernels, as on CUDA"
        if fused
        else "per-tensor ops, as torch on a device without `_foreach` kernels"
    )
    lines = [
        f"GPT-2 124M shapes, {len(shapes)} tensors, on `meta`, {kernels}; "
        "ops and host reads per call",
        "",
        f"| call | ops (on device) | reads | ops (on device), {factor}x wider "
        f"| reads, {factor}x wider | ops vs torch clip_grad_norm_ | device ops vs torch |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, c in base.items():
        w = wide[name]
        lines.append(
            f"| {name} | {c.ops} ({c.device_ops}) | {c.reads} | {w.ops} ({w.device_ops}) "
            f"| {w.reads} | {c.ops / floor.ops:.2f}x "
            f"| {c.device_ops / floor.device_ops:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=int, default=4, help="how much wider (default 4)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}\n")
    print(report(args.factor, fused=True))
    print()
    print(report(args.factor, fused=False))


if __name__ == "__main__":
    main()
