"""One prepared device check for issue 10: the process-group path on CUDA (nccl).

    python -m benchmarks.gpu_distributed_check [--gb 14]   # Markdown; exits 0 without CUDA

Meant for a lent device machine, in one call of a few minutes:

1. a ``--gb`` GB bfloat16 checkpoint (16 MiB tensors, benchmarks/inputs.py);
2. ``gradclip inspect --device cuda`` as one process, and under
   ``torchrun --nproc-per-node 1`` (world size 1 still takes the nccl
   process-group path: join, pieces, gather, agreement); the two JSON
   reports must be identical byte for byte; both are timed;
3. with two or more GPUs, the same with one rank per GPU; and on every GPU
   (one rank where there is one) the drop-ins on CUDA DTensors (FSDP2
   ``fully_shard`` on a 1-D mesh, two separate meshes) against the float64
   norm of every ``full_tensor()``, for the sync-free float64 path (bf16,
   p = 2 and inf, under torch's sync debug mode set to raise) and the exact
   gathered path (float64 gradients, p = 8), each total a DTensor replicated
   on the mesh.

Exit 0 when every check passes (or there is no CUDA), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

PYTHON = sys.executable
TENSOR = 8 << 20  # elements: 16 MiB of bfloat16
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}


def _timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=900)
    return time.perf_counter() - start, done


def _torchrun(ranks: int, *args: str) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", *args]


def check_cli(gb: float) -> bool:
    from . import inputs

    count = max(1, round(gb * 1e9 / (TENSOR * 2)))
    path = inputs.checkpoint_file(f"uniform_{gb}GB_bf16", inputs.uniform_shapes(count, TENSOR),
                                  torch.bfloat16)
    inspect = ["-m", "gradclip_cli", "inspect", str(path), "--device", "cuda",
               "--format", "json", "--quiet"]
    runs = {"1 process": [PYTHON, *inspect], "torchrun, 1 rank (nccl)": _torchrun(1, *inspect)}
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        runs[f"torchrun, {min(gpus, 8)} ranks (nccl)"] = _torchrun(min(gpus, 8), *inspect)
    print(f"## inspect --device cuda, {path.stat().st_size / 1e9:.1f} GB bf16, {count} tensors\n")
    print("| run | exit | seconds | report identical to 1 process |")
    print("| --- | --- | --- | --- |")
    ok, reference = True, None
    _timed(runs["1 process"])  # warm the page cache
    for name, command in runs.items():
        seconds, done = _timed(command)
        if reference is None:
            reference = done.stdout
        same = done.stdout == reference and done.returncode == 0
        ok &= same
        print(f"| {name} | {done.returncode} | {seconds:.1f} | {same} |")
        if done.returncode != 0:
            print(f"\n```\n{done.stderr[-3000:]}\n```\n")
    total = json.loads(reference)["total_norm"] if reference else None
    print(f"\ntotal_norm: {total}\n")
    return ok


def _reference(grads, p: float) -> float:
    full = [g.full_tensor().double().cpu() for g in grads]
    big = max(float(t.abs().max()) for t in full)
    if math.isinf(p):
        return big
    return big * sum(float((t / big).abs().pow(p).sum()) for t in full) ** (1 / p)


def dtensor_rank() -> None:
    """Run under torchrun, one rank per GPU: the drop-ins on CUDA DTensors."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from gradclip_cli import get_total_norm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    lines, ok = [], True
    for dtype, p in ((torch.bfloat16, 2.0), (torch.bfloat16, math.inf), (torch.float64, 8.0)):
        mesh = init_device_mesh("cuda", (world,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to(dtype)
        fully_shard(model, mesh=mesh)
        x = torch.randn(8, 1024, device="cuda", dtype=dtype,
                        generator=torch.Generator("cuda").manual_seed(rank))
        model(x).float().square().sum().backward()
        grads = [q.grad for q in model.parameters()]
        torch.cuda.synchronize()
        # The sync-free path (bf16, p <= 6) under torch's sync debug mode, raising on a read.
        torch.cuda.set_sync_debug_mode("error" if dtype == torch.bfloat16 else 0)
        try:
            total = get_total_norm(grads, p)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        # A DTensor total, Replicate on the gradients' mesh, as torch returns one.
        ok &= isinstance(total, DTensor) and list(total.placements) == [Replicate()]
        ours = float(total.full_tensor())
        ref = _reference(grads, p)
        err = abs(ours - ref) / ref
        ok &= err <= 1e-6
        lines.append(f"| FSDP2 {world} GPU(s) | {dtype} | {p} | {err:.1e} |")
    flat = init_device_mesh("cuda", (world,), mesh_dim_names=("all",))
    other = init_device_mesh("cuda", (world,), mesh_dim_names=("other",))
    g = torch.Generator().manual_seed(1)
    grads = [distribute_tensor(torch.randn(64, 64, generator=g).cuda(), flat, [Shard(0)]),
             distribute_tensor(torch.randn(32, 32, generator=g).cuda(), other, [Replicate()])]
    ours, ref = float(get_total_norm(grads)), _reference(grads, 2.0)
    ok &= abs(ours - ref) / ref <= 1e-6
    lines.append(f"| two meshes | float32 | 2 | {abs(ours - ref) / ref:.1e} |")
    if rank == 0:
        print("| check | dtype | p | relative error vs float64 full_tensor() |")
        print("| --- | --- | --- | --- |")
        print("\n".join(lines))
        print(f"\nDTENSOR_OK={ok}")
    dist.destroy_process_group()


def check_dtensor() -> bool:
    gpus = min(torch.cuda.device_count(), 8)
    # One GPU still takes the DTensor path: a mesh of one rank, its gradients DTensors.
    print(f"## DTensor drop-ins on {gpus} GPU(s)\n")
    seconds, done = _timed(_torchrun(gpus, "-m", "benchmarks.gpu_distributed_check",
                                     "--dtensor-rank"))
    print(done.stdout)
    if done.returncode != 0:
        print(f"```\n{done.stderr[-3000:]}\n```")
    return done.returncode == 0 and "DTENSOR_OK=True" in done.stdout


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=14.0)
    parser.add_argument("--dtensor-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtensor_rank:
        dtensor_rank()
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}; "
          f"torch {torch.__version__}\n")
    ok = check_cli(args.gb)
    ok &= check_dtensor()
    print(f"all checks passed: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
