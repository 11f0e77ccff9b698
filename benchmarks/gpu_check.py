"""One prepared device check: CUDA accuracy against CPU float64, and targets 1-3 on the GPU.

    python -m benchmarks.gpu_check          # prints Markdown; exits 0 without CUDA

Meant for a lent device machine: it runs in well under a minute. Inputs are
the seeded shapes of benchmarks/inputs.py, built on the GPU.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from gradclip_cli import get_total_norm  # noqa: E402
from gradclip_cli.core import tensor_power_sums  # noqa: E402

from .inputs import gpt2_shapes  # noqa: E402


def median_ms(fn, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def float64_norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()} ; torch {torch.__version__}\n")
    g = torch.Generator(device="cuda").manual_seed(0)
    gpt2 = [torch.randn(s, generator=g, device="cuda") for _, s in gpt2_shapes()]
    small = [torch.randn(1024, generator=g, device="cuda") for _ in range(20000)]
    print("| input | dtype | magnitude | torch rel. err | gradclip rel. err |")
    print("| --- | --- | --- | --- | --- |")
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for mag in ((1.0, 1e20, 1e-25) if dtype != torch.float16 else (1.0, 1e4, 1e-6)):
            ts = [(t * mag).to(dtype) for t in gpt2[:20]]
            ref = float64_norm(ts)
            ours = float(get_total_norm(ts))
            sums = float(tensor_power_sums(ts, 2.0, device="cuda").total().norm[0])
            theirs = float(torch.nn.utils.get_total_norm(ts))
            err = max(abs(ours - ref), abs(sums - ref)) / ref
            worst = max(worst, err)
            print(f"| GPT-2 (20 tensors) | {dtype} | {mag:g} | {abs(theirs - ref) / ref:.1e} "
                  f"| {err:.1e} |")
    print("\n| target | torch | gradclip | ratio (torch time / gradclip time) |")
    print("| --- | --- | --- | --- |")
    cases = [
        ("1. GPT-2 fp32", gpt2, lambda ts: torch.nn.utils.get_total_norm(ts)),
        ("2a. GPT-2 bf16 vs fp32-accumulating", [t.bfloat16() for t in gpt2],
         lambda ts: torch._foreach_norm(ts, 2, dtype=torch.float32)),
        ("2b. GPT-2 bf16 vs native", [t.bfloat16() for t in gpt2],
         lambda ts: torch.nn.utils.get_total_norm(ts)),
        ("3. 20,000 x 1,024 fp32", small, lambda ts: torch.nn.utils.get_total_norm(ts)),
    ]
    for name, ts, torch_fn in cases:
        t_torch = median_ms(lambda: torch_fn(ts))  # noqa: B023
        t_ours = median_ms(lambda: tensor_power_sums(ts, 2.0))  # noqa: B023
        print(f"| {name} | {t_torch:.2f} ms | {t_ours:.2f} ms | {t_torch / t_ours:.2f}x |")
    print(f"\nworst gradclip relative error: {worst:.1e} (contract: 1e-6)")
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
