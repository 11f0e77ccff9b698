"""torch's CUDA kernels for a total norm and a scale, side by side, on Llama-2-7B bf16 shapes.

    python -m benchmarks.gpu_kernels        # prints Markdown; exits 0 without CUDA

What the drop-ins and ``GradMonitor`` can be built from, timed against the
floor (one read of every byte, or one read and one write, at the copy
bandwidth measured in the same run): the fused ``torch._foreach_norm`` in
each accumulation type, a loop of ``vector_norm`` (one launch per tensor), and
for the scale the fused ``torch._foreach_mul_`` with a coefficient of the
gradients' own dtype (torch's), a float32 device tensor (which torch's fused
kernel does not take: it falls back to one kernel per tensor), a host float
(fused, multiplied in float32), and on float16 copies torch's AMP unscale
kernel with a float32 device tensor (fused, multiplied in float32; torch has
it for float16, not bfloat16). Then the kernels each gradclip call
launches, from torch's profiler. Medians of CUDA-event times over 10
repetitions after a warm-up.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from gradclip_cli import GradMonitor, clip_grad_norm_, get_total_norm  # noqa: E402

from .inputs import llama2_7b_shapes  # noqa: E402


def median_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(fn, rows: int = 6) -> str:
    """The CUDA kernels ``fn`` launches, by total device time."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows,
                                      max_name_column_width=70)
    return table


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()} ; torch {torch.__version__}\n")
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16).mul_(1e-3)
          for _, s in llama2_7b_shapes()]
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    flat = torch.randn(nbytes // 2, generator=g, device="cuda", dtype=torch.bfloat16)
    other = torch.empty_like(flat)
    copy_ms = median_ms(lambda: other.copy_(flat))
    bandwidth = 2 * nbytes / copy_ms / 1e9  # TB/s, bytes read plus written
    read_floor = nbytes / bandwidth / 1e9
    print(f"{len(ts)} tensors, {nbytes / 1e9:.2f} GB; device-to-device copy {bandwidth:.2f} TB/s"
          f" (read and written): one read {read_floor:.2f} ms, read and write "
          f"{2 * read_floor:.2f} ms\n")
    ts16 = [t.half() for t in ts]  # torch's AMP kernel takes float16, not bfloat16
    c32 = torch.tensor(0.999, device="cuda")
    c16 = c32.to(torch.bfloat16)
    norm_cases = {
        "one vector_norm over one flat buffer (float32 acc.)":
            lambda: torch.linalg.vector_norm(flat, dtype=torch.float32),
        "_foreach_norm (bf16 out, torch's get_total_norm)": lambda: torch._foreach_norm(ts, 2),
        "_foreach_norm, dtype float32": lambda: torch._foreach_norm(ts, 2, dtype=torch.float32),
        "_foreach_norm, dtype float64": lambda: torch._foreach_norm(ts, 2, dtype=torch.float64),
        "_foreach_norm, inf": lambda: torch._foreach_norm(ts, float("inf")),
        "vector_norm per tensor, float32":
            lambda: [torch.linalg.vector_norm(t, dtype=torch.float32) for t in ts],
        "vector_norm per tensor, float64":
            lambda: [torch.linalg.vector_norm(t, dtype=torch.float64) for t in ts],
        "_foreach_mul_, bf16 device coefficient (torch's)": lambda: torch._foreach_mul_(ts, c16),
        "_foreach_mul_, float32 device coefficient": lambda: torch._foreach_mul_(ts, c32),
        "_foreach_mul_, host float": lambda: torch._foreach_mul_(ts, 0.999),
        "mul per tensor, float32 1-element device coefficient (computed in float32)":
            lambda: [torch.mul(t, c32.reshape(1), out=t) for t in ts],
        "float16 copies: _foreach_mul_, float32 device coefficient":
            lambda: torch._foreach_mul_(ts16, c32),
        "float16 copies: AMP unscale kernel, float32 device coefficient":
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(
                ts16, torch.zeros(1, device="cuda"), c32),
        "gradclip get_total_norm": lambda: get_total_norm(ts),
    }
    print("| kernel | median ms | vs floor |")
    print("| --- | ---: | ---: |")
    for name, fn in norm_cases.items():
        ms = median_ms(fn)
        floor = 2 * read_floor if "mul_" in name or "AMP" in name else read_floor
        print(f"| {name} | {ms:.2f} | {ms / floor:.2f}x |")
    model = torch.nn.Module()
    for i, t in enumerate(ts):
        p = torch.nn.Parameter(torch.empty_like(t))
        p.grad = t
        model.register_parameter(f"p{i}", p)
    params = list(model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        monitor = GradMonitor(model, f"{folder}/a.jsonl", None)
        print("\ngradclip clip_grad_norm_ (coefficient 1):\n")
        print(kernels(lambda: clip_grad_norm_(params, 1e30)))
        print("\nGradMonitor.clip_grad_norm_, logged (coefficient 1):\n")
        print(kernels(lambda: monitor.clip_grad_norm_(1e30)))
        monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
