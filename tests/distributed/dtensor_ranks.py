"""Checks run on every rank of a spawned gloo group (test_dtensor.py collects them).

Each check builds real DTensor gradients (FSDP2's ``fully_shard``, tensor
parallel's ``parallelize_module``, or placements by hand) and records, per
rank: gradclip's total norm, the float64 norm of every gradient's
``full_tensor()`` (the reference), and what torch's own functions did.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradclip_cli import clip_grad_norm_, get_total_norm
from gradclip_cli.distributed import dtensor


def reference(grads, p: float = 2.0) -> float:
    """float64 p-norm of the whole gradients (scaled so nothing overflows)."""
    full = [g.full_tensor().double() if hasattr(g, "full_tensor") else g.double() for g in grads]
    big = max(float(t.abs().max()) for t in full)
    if math.isinf(p):
        return big
    return big * sum(float((t / big).abs().pow(p).sum()) for t in full) ** (1 / p)


def float64_path(grads, p: float = 2.0) -> float:
    """The accelerators' sync-free path (float64 all-reduce), run here on the CPU."""
    return float(dtensor._total_in_float64(dtensor._local_parts(grads), p))


def _torch_outcome(fn) -> str:
    try:
        value = fn()
    except Exception as error:  # what torch does is the finding here
        return f"raises {type(error).__name__}"
    return f"returns {type(value).__name__}"


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))


def _backward(model: nn.Module, rank: int, scale: float = 1.0) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    (model(x).square().sum() * scale).backward()


def fsdp2(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _backward(model, rank)
    grads = [p.grad for p in model.parameters()]
    out = {"placements": sorted({str(g.placements) for g in grads})}
    for p in (2.0, 1.0, 3.0, math.inf):
        out[f"p={p}"] = [float(get_total_norm(grads, p)), reference(grads, p)]
    out["torch"] = float(torch.nn.utils.get_total_norm(grads).full_tensor())
    # Beyond float32: squares of 1e30 overflow a float32 sum.
    for g in grads:
        g.to_local().mul_(1e30)
    out["huge"] = [float(get_total_norm(grads)), reference(grads)]
    max_norm = out["huge"][1] / 1e31
    before = clip_grad_norm_(model.parameters(), max_norm)
    out["clipped"] = [float(before), reference(grads), max_norm]
    return out


def placements_by_hand(rank: int, world: int) -> dict:
    """Shard, Replicate and Partial on a 1-D mesh, mixed with a plain tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    full = torch.randn(10, 6, generator=g)  # 10 rows: uneven over 4 ranks
    shard = distribute_tensor(full, mesh, [Shard(0)])
    replicate = distribute_tensor(torch.randn(5, generator=g), mesh, [Replicate()])
    local = torch.randn(7, generator=torch.Generator().manual_seed(100 + rank))
    partial = DTensor.from_local(local, mesh, [Partial()])
    half = distribute_tensor(torch.randn(33, generator=g).bfloat16(), mesh, [Shard(0)])
    grads = [shard, replicate, partial, half]
    plain = torch.randn(4, generator=g)
    return {
        "mixed": [float(get_total_norm(grads)), reference(grads)],
        "with_plain": [float(get_total_norm([*grads, plain])), reference([*grads, plain])],
        "partial": [float(get_total_norm([partial], 3.0)), reference([partial], 3.0)],
        "float64_path": [float64_path([*grads, plain]), reference([*grads, plain])],
        "float64_path_inf": [float64_path(grads, math.inf), reference(grads, math.inf)],
    }


def fsdp_tp(rank: int, world: int) -> dict:
    """FSDP2 over tensor parallel on a 2 x 2 mesh, as torchtitan builds it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _mlp()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    _backward(model, rank // 2)
    grads = [p.grad for p in model.parameters()]
    return {
        "placements": sorted({str(g.placements) for g in grads}),
        "p=2": [float(get_total_norm(grads)), reference(grads)],
        "p=inf": [float(get_total_norm(grads, math.inf)), reference(grads, math.inf)],
        "float64_path": [float64_path(grads), reference(grads)],
    }


def two_meshes(rank: int, world: int) -> dict:
    """Gradients on two separate meshes: torch's clip_grad_norm_ cannot stack their norms."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("all",))
    square = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))
    g = torch.Generator().manual_seed(5)
    params = [
        nn.Parameter(distribute_tensor(torch.randn(8, 4, generator=g), flat, [Shard(0)])),
        nn.Parameter(distribute_tensor(torch.randn(6, 6, generator=g), square,
                                       [Shard(0), Replicate()])),
        nn.Parameter(distribute_tensor(torch.randn(4, 8, generator=g), square,
                                       [Replicate(), Shard(1)])),
    ]
    for i, p in enumerate(params):
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g) * (i + 1), p.device_mesh,
                                   p.placements)
    grads = [p.grad for p in params]
    out = {"torch": _torch_outcome(lambda: torch.nn.utils.clip_grad_norm_(
        [nn.Parameter(p.detach().clone()) for p in params] and params, 1e9))}
    ref = reference(grads)
    out["p=2"] = [float(get_total_norm(grads)), ref]
    out["float64_path"] = [float64_path(grads), ref]
    before = clip_grad_norm_(params, ref / 4)
    out["clipped"] = [float(before), reference(grads), ref / 4]
    return out


def monitor_fsdp2(rank: int, world: int, outdir: str) -> dict:
    """GradMonitor over FSDP2 gradients: three logged steps, a NaN injected at the third.

    Records the logged per-layer norms beside float64 references from
    ``full_tensor()``, the clipped total, and what rank 0 dumped.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradclip_cli import GradMonitor

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp(seed=3)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    folder = Path(outdir, "monitor")
    monitor = GradMonitor(model, log=folder / "grads.jsonl", dump_dir=folder / "spikes")
    out: dict = {"steps": []}
    for step in range(3):
        model.zero_grad()
        _backward(model, rank + 10 * step, scale=10.0 ** step)
        names = [n for n, _ in model.named_parameters()]
        grads = [p.grad for p in model.parameters()]
        references = {layer: reference([g for n, g in zip(names, grads)
                                        if n.split(".")[0] == layer])
                      for layer in ("0", "2")}
        total = reference(grads)
        if step == 2:  # one element of one rank's shard: the whole gradient is NaN-tainted
            if rank == 0:
                grads[0].to_local().view(-1)[0] = float("nan")
            record = monitor.step(step)
            out["nan"] = {"nonfinite": record["nonfinite"], "dump": record["dump"]}
            break
        max_norm = total / 2
        before = monitor.clip_grad_norm_(max_norm, step=step)
        out["steps"].append({"groups": monitor_groups(folder, step, rank),
                             "references": references, "total": [float(before), total],
                             "after": [reference(grads), max_norm]})
    monitor.close()
    dumped = folder / "spikes" / "step-2.pt"
    out["dump_exists"] = dumped.exists()
    full = {n: g.full_tensor() for n, g in zip(names, grads)}  # a collective: every rank
    if rank == 0 and dumped.exists():
        saved = torch.load(dumped, weights_only=True)
        out["dump_matches"] = saved["step"] == 2 and all(
            torch.equal(saved["grads"][n], t) or (t.isnan() == saved["grads"][n].isnan()).all()
            and torch.equal(saved["grads"][n].nan_to_num(), t.nan_to_num())
            for n, t in full.items())
    return out


def monitor_groups(folder: Path, step: int, rank: int) -> dict | None:
    """The groups rank 0 logged for ``step`` (other ranks log nothing: None)."""
    log = folder / "grads.jsonl"
    if rank != 0:
        return None
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step:
            return record["groups"]
    return None


CHECKS = {2: [fsdp2, placements_by_hand, monitor_fsdp2],
          4: [placements_by_hand, fsdp_tp, two_meshes]}


def run_rank(rank: int, world: int, outdir: str) -> None:
    """Entry point of each spawned process: run the checks for this world size."""
    os.environ.pop("RANK", None)
    dist.init_process_group("gloo", init_method=f"file://{outdir}/store", rank=rank,
                           world_size=world)
    torch.set_num_threads(1)
    results = {}
    for check in CHECKS[world]:
        try:
            needs_folder = check is monitor_fsdp2
            results[check.__name__] = (check(rank, world, outdir) if needs_folder
                                       else check(rank, world))
        except Exception as error:  # reported to the test, which fails with it
            results[check.__name__] = {"error": f"{type(error).__name__}: {error}"}
        dist.barrier()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(results))
