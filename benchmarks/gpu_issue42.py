"""Every GPU figure of issue 42's "Done when", in one run (called by benchmarks/gpu_check.py).

    python -m benchmarks.gpu_check                 # everything, this section included
    python -m benchmarks.gpu_check --only-issue42  # this section alone (about 2 minutes)

On Llama-2-7B's 291 bf16 gradients (13.5 GB), in one process, torch's
baselines rerun beside gradclip's calls:

* the total norm: gradclip's ``get_total_norm`` (the Triton pass where Triton
  is importable) and its ``_foreach`` path (``GRADCLIP_TRITON=0``) against
  torch's ``get_total_norm`` and the copy floor (one read of every byte at the
  device-to-device copy bandwidth measured here). Goals: at most 1.2x the
  floor, and faster than torch.
* the drop-in ``clip_grad_norm_``, ``clip_grads_with_norm_`` and every
  ``GradMonitor`` step that clips, against torch's own calls (goal: at most
  1.0x torch's), with a coefficient below 1, so every gradient is scaled;
  and whether the bf16 scaling equals torch's bit for bit.
* the CLI's core (``tensor_power_sums``, with the max, as ``inspect``
  measures) on CUDA at GPT-2 and 7B sizes against torch's ``get_total_norm``
  (goal: at least torch's speed), and the DTensor path's local sum
  (``_local_power_sum``) against the float64 ``vector_norm`` per tensor it
  replaced.
* accuracy against float64 (goal <= 1e-6) over dtypes, p and magnitudes, and
  whether the drop-ins and the unlogged monitor step run under
  ``torch.cuda.set_sync_debug_mode("error")``.

Medians of wall time over ``reps`` calls, each followed by a synchronisation,
after one warm-up call (which compiles the Triton kernels).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from contextlib import contextmanager

import torch

from gradclip_cli import (
    GradMonitor,
    clip_grad_norm_,
    clip_grads_with_norm_,
    get_total_norm,
)
from gradclip_cli.core import tensor_power_sums
from gradclip_cli.distributed import dtensor

FLOOR_GOAL = 1.2  # get_total_norm, in units of the copy floor
CLIP_GOAL = 1.0  # drop-in and monitor steps, in units of torch's matching call


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: str, reps: int = 7) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@contextmanager
def triton_off():
    """gradclip's ``_foreach`` path, as without Triton (core/triton_norms.usable)."""
    old = os.environ.get("GRADCLIP_TRITON")
    os.environ["GRADCLIP_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GRADCLIP_TRITON", None)
        else:
            os.environ["GRADCLIP_TRITON"] = old


def model_with_grads(shapes, dtype: torch.dtype, device: str, scale: float = 1e-3):
    """Parameters of these shapes (weights uninitialised) with seeded normal gradients."""
    g = torch.Generator(device=device).manual_seed(0)
    model = torch.nn.Module()
    for i, (_, shape) in enumerate(shapes):
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        p.grad = torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(scale)
        model.register_parameter(f"p{i}", p)
    return model


def float64_norm(tensors, p: float = 2.0) -> float:
    """The p-norm in float64, scaled by the largest |x| so it neither overflows nor underflows."""
    top = max(float(t.detach().abs().max()) for t in tensors if t.numel())
    if top == 0 or math.isinf(p):
        return top
    total = sum(float(t.detach().double().div(top).abs().pow(p).sum()) for t in tensors)
    return top * total ** (1 / p)


def read_floor_ms(tensors, device: str, reps: int = 7) -> float:
    """One read of every byte of ``tensors`` at the device-to-device copy bandwidth
    (a copy reads and writes each byte), measured on one flat buffer as large."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    other = torch.empty_like(flat)
    buffers = [flat, other]
    del flat, other
    ms = median_ms(lambda: buffers[1].copy_(buffers[0]), device, reps)
    buffers.clear()  # 27 GB on 7B shapes: freed before the next measurement
    return ms / 2


def total_norm_rows(grads, device: str, reps: int = 7) -> list[dict]:
    """The total norm's contenders and the floor, measured one after another."""
    floor = read_floor_ms(grads, device, reps)
    reference = float64_norm(grads)
    rows = [{"name": "copy floor (one read)", "ms": floor, "error": None}]
    calls = {
        "torch get_total_norm": lambda: torch.nn.utils.get_total_norm(grads),
        "gradclip get_total_norm": lambda: get_total_norm(grads),
    }
    for name, call in calls.items():
        rows.append({"name": name, "ms": median_ms(call, device, reps),
                     "error": abs(float(call()) - reference) / reference})
    with triton_off():
        call = calls["gradclip get_total_norm"]
        rows.append({"name": "gradclip get_total_norm, _foreach path (no Triton)",
                     "ms": median_ms(call, device, reps),
                     "error": abs(float(call()) - reference) / reference})
    for r in rows:
        r["vs_floor"] = r["ms"] / floor
    return rows


def clip_rows(model, device: str, reps: int = 7) -> list[dict]:
    """Drop-ins and monitor steps that clip, each beside torch's matching call.

    The coefficient is 0.999...: every gradient is multiplied (as it is on every
    step that clips), and they barely move over the repetitions.
    """
    params = list(model.parameters())
    grads = [p.grad for p in params]
    total = get_total_norm(grads)
    max_norm = float(total) * 0.999
    with tempfile.TemporaryDirectory() as folder:
        logged = GradMonitor(model, os.path.join(folder, "a.jsonl"), None)
        skipped = GradMonitor(model, os.path.join(folder, "b.jsonl"), None, every=10**9)
        skipped.step()  # its step 0 is logged; the timed ones are not
        pairs = [
            ("clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(params, max_norm),
             lambda: clip_grad_norm_(params, max_norm)),
            ("clip_grads_with_norm_",
             lambda: torch.nn.utils.clip_grads_with_norm_(params, max_norm, total),
             lambda: clip_grads_with_norm_(params, max_norm, total)),
            ("GradMonitor.clip_grad_norm_ (not logged)",
             lambda: torch.nn.utils.clip_grad_norm_(params, max_norm),
             lambda: skipped.clip_grad_norm_(max_norm)),
            ("GradMonitor.clip_grad_norm_ (logged)",
             lambda: torch.nn.utils.clip_grad_norm_(params, max_norm),
             lambda: logged.clip_grad_norm_(max_norm)),
        ]
        rows = []
        for name, theirs, ours in pairs:
            t_torch = median_ms(theirs, device, reps)
            t_ours = median_ms(ours, device, reps)
            rows.append({"name": name, "torch_ms": t_torch, "ms": t_ours,
                         "vs_torch": t_ours / t_torch})
        logged.close()
        skipped.close()
    return rows


def bf16_scaling_equals_torch(shapes, device: str) -> bool:
    """Whether gradclip's ``clip_grads_with_norm_`` on bf16 gradients gives torch's bits."""
    ours = model_with_grads(shapes, torch.bfloat16, device)
    theirs = model_with_grads(shapes, torch.bfloat16, device)
    total = get_total_norm([p.grad for p in ours.parameters()])
    max_norm = float(total) / 3
    clip_grads_with_norm_(ours.parameters(), max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(theirs.parameters(), max_norm, total.clone())
    return all(torch.equal(a.grad, b.grad)
               for a, b in zip(ours.parameters(), theirs.parameters()))


def core_rows(sizes: dict[str, list[torch.Tensor]], device: str, reps: int = 7) -> list[dict]:
    """The CLI's core and the DTensor path's local sum beside torch's total norm."""
    rows = []
    for label, ts in sizes.items():
        t_torch = median_ms(lambda: torch.nn.utils.get_total_norm(ts), device, reps)  # noqa: B023
        t_core = median_ms(lambda: tensor_power_sums(ts, 2.0), device, reps)  # noqa: B023
        rows.append({"name": f"CLI core (tensor_power_sums, with max), {label}",
                     "torch_ms": t_torch, "ms": t_core, "speed_vs_torch": t_torch / t_core})
        first = ts[0].device
        t_local = median_ms(lambda: dtensor._local_power_sum(ts, 2.0, first), device, reps)  # noqa: B023

        def per_tensor():
            return torch.stack([torch.linalg.vector_norm(t, 2.0, dtype=torch.float64)  # noqa: B023
                                for t in ts]).pow(2).sum()  # noqa: B023

        t_old = median_ms(per_tensor, device, reps)
        rows.append({"name": f"DTensor local sum, {label} (vs float64 vector_norm per tensor)",
                     "torch_ms": t_old, "ms": t_local, "speed_vs_torch": t_old / t_local})
    return rows


def accuracy_rows(base: list[torch.Tensor]) -> list[dict]:
    """Relative errors against float64: every dtype, p and a few magnitudes each."""
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        info = torch.finfo(dtype)
        for magnitude in (1.0, info.max / 1e3, info.smallest_normal * 1e2):
            ts = [(t.double() * magnitude).to(dtype) for t in base]
            for p in (1.0, 2.0, 3.5, math.inf):
                want = float64_norm(ts, p)
                got = float(get_total_norm(ts, p))
                core = float(tensor_power_sums(ts, p).total().norm[0])
                error = max(abs(got - want), abs(core - want)) / want if want else 0.0
                rows.append({"dtype": str(dtype).replace("torch.", ""), "magnitude": magnitude,
                             "p": p, "error": error})
    return rows


def sync_free(model, device: str) -> dict[str, str]:
    """Whether each call runs under ``set_sync_debug_mode("error")`` (CUDA only)."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    total = get_total_norm(grads)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        skipped = GradMonitor(model, os.path.join(folder, "c.jsonl"), None, every=10**9)
        skipped.step()
        calls = {
            "get_total_norm": lambda: get_total_norm(grads),
            "clip_grad_norm_": lambda: clip_grad_norm_(params, 1e30),
            "clip_grads_with_norm_": lambda: clip_grads_with_norm_(params, 1e30, total),
            "GradMonitor.clip_grad_norm_ (not logged)": lambda: skipped.clip_grad_norm_(1e30),
        }
        for name, call in calls.items():
            call()  # warm: compiled kernels, cached tables
            _sync(device)
            if torch.device(device).type == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                call()
                results[name] = "sync-free"
            except RuntimeError as e:
                results[name] = f"SYNCHRONISED: {str(e).splitlines()[0][:80]}"
            finally:
                if torch.device(device).type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        skipped.close()
    return results


def goals(total_rows: list[dict], clips: list[dict], cores: list[dict], worst: float,
          syncs: dict[str, str], equal: bool) -> list[str]:
    by_name = {r["name"]: r for r in total_rows}
    ours = by_name["gradclip get_total_norm"]
    theirs = by_name["torch get_total_norm"]
    lines = [
        f"get_total_norm {ours['vs_floor']:.2f}x the copy floor (goal <= {FLOOR_GOAL}x): "
        + ("met" if ours["vs_floor"] <= FLOOR_GOAL else "NOT met"),
        f"get_total_norm {ours['ms']:.2f} ms against torch's {theirs['ms']:.2f} ms "
        "(goal: faster): " + ("met" if ours["ms"] < theirs["ms"] else "NOT met"),
    ]
    for r in clips:
        lines.append(f"{r['name']} {r['vs_torch']:.2f}x torch's (goal <= {CLIP_GOAL:.1f}x): "
                     + ("met" if r["vs_torch"] <= CLIP_GOAL else "NOT met"))
    for r in cores:
        if r["name"].startswith("CLI core"):
            lines.append(f"{r['name']}: {r['speed_vs_torch']:.2f}x torch's speed (goal >= 1x): "
                         + ("met" if r["speed_vs_torch"] >= 1 else "NOT met"))
    lines.append(f"worst relative error {worst:.1e} (goal <= 1e-6): "
                 + ("met" if worst <= 1e-6 else "NOT met"))
    unsynced = all(v == "sync-free" for v in syncs.values())
    lines.append("sync-free under set_sync_debug_mode('error'): "
                 + ("met" if unsynced else "NOT met: " + "; ".join(
                     f"{k}: {v}" for k, v in syncs.items() if v != "sync-free")))
    lines.append("bf16 scaling bit for bit torch's: " + ("yes" if equal else "NO"))
    return lines


def run(big_shapes, small_shapes, device: str = "cuda", reps: int = 7) -> tuple[str, float]:
    """The section as Markdown, and the worst relative error (for the exit status)."""
    out = []
    model = model_with_grads(big_shapes, torch.bfloat16, device)
    grads = [p.grad for p in model.parameters()]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    out.append(f"\n### Issue 42: {len(grads)} bf16 gradients, {nbytes / 1e9:.2f} GB\n")
    totals = total_norm_rows(grads, device, reps)
    out.append("| total norm | median ms | vs copy floor | rel. error vs float64 |")
    out.append("| --- | ---: | ---: | ---: |")
    for r in totals:
        error = "" if r["error"] is None else f"{r['error']:.1e}"
        out.append(f"| {r['name']} | {r['ms']:.2f} | {r['vs_floor']:.2f}x | {error} |")
    clips = clip_rows(model, device, reps)
    out.append("\n| clipping call (bf16) | torch ms | gradclip ms | gradclip / torch |")
    out.append("| --- | ---: | ---: | ---: |")
    for r in clips:
        out.append(f"| {r['name']} | {r['torch_ms']:.2f} | {r['ms']:.2f} | {r['vs_torch']:.2f}x |")
    syncs = sync_free(model, device)
    small = model_with_grads(small_shapes, torch.bfloat16, device)
    sizes = {"GPT-2 bf16": [p.grad for p in small.parameters()], "7B bf16": grads}
    cores = core_rows(sizes, device, reps)
    out.append("\n| | baseline ms | gradclip ms | speed vs baseline |")
    out.append("| --- | ---: | ---: | ---: |")
    for r in cores:
        out.append(f"| {r['name']} | {r['torch_ms']:.2f} | {r['ms']:.2f} "
                   f"| {r['speed_vs_torch']:.2f}x |")
    equal = bf16_scaling_equals_torch(small_shapes, device)
    del model, grads, sizes
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    base = [p.grad.float() for p in list(small.parameters())[:12]]
    accuracy = accuracy_rows(base)
    worst = max(r["error"] for r in accuracy)
    out.append("\n| accuracy: dtype | magnitude | p | rel. error vs float64 |")
    out.append("| --- | ---: | ---: | ---: |")
    for r in accuracy:
        out.append(f"| {r['dtype']} | {r['magnitude']:.3g} | {r['p']:g} | {r['error']:.1e} |")
    out.append("")
    for name, verdict in syncs.items():
        out.append(f"- {name} under set_sync_debug_mode('error'): {verdict}")
    for line in goals(totals, clips, cores, worst, syncs, equal):
        out.append(f"- {line}")
    out.append(f"- Triton pass: {triton_state(device)}")
    return "\n".join(out), worst


def triton_state(device: str) -> str:
    """Whether the figures above came from the Triton pass, and if not, why."""
    if torch.device(device).type != "cuda":
        return "not used (not CUDA)"
    from gradclip_cli.core import triton_norms

    if triton_norms.failure is not None:
        return f"FAILED, the _foreach path was used: {triton_norms.failure}"
    if triton_norms._triton() is None:
        return "not used (Triton cannot be imported)"
    if os.environ.get("GRADCLIP_TRITON") == "0":
        return "turned off (GRADCLIP_TRITON=0)"
    return "used"
