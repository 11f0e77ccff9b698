"""torch's FSDP2 clip test (``test_fully_shard_clip_grad_norm_.py``), on gloo ranks.

Rewritten for the CPU from pytorch's ``test/distributed/_composable/fsdp``:
a small transformer is sharded with ``fully_shard`` (1-D mesh, 2 ranks) or
tensor-parallel inside FSDP2 (2 x 2 mesh, 4 ranks); a replicated copy, whose
gradients are averaged over the data-parallel ranks as ``replicate`` does,
is the reference. torch's assertions are kept: the gradients match the
reference, the clipping is not vacuous, gradclip's total (a DTensor, as
torch's) equals torch's total of the reference, and every gradient ends at
most ``max_norm``. torch's count of its own all-reduces is not: it describes
torch's implementation, not the result. Each rank records what failed.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gradclip_cli import clip_grad_norm_, get_total_norm

VOCAB, DIM, SEQ = 64, 16, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _check(failures: list[str], ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)


def clip_like_torch_tests(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard

    # torch's test clips to 1 with its larger model's gradients; these are
    # about 1e3 times smaller, and so is max_norm (scaling the loss instead
    # would put float32 summation differences above torch's atol).
    max_norm = 1e-3
    orders = (2.0, 1.0, float("inf")) if world == 2 else (2.0, 1.0, 3.0, float("inf"))
    failures: list[str] = []
    totals = []
    for norm_type in orders:
        torch.manual_seed(42)
        model = Transformer()
        ref_model = copy.deepcopy(model)
        if world == 2:
            dp_mesh = init_device_mesh("cpu", (world,))
        else:
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            dp_mesh = mesh["dp"]
            for block in model.blocks:
                parallelize_module(block, mesh["tp"],
                                   {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        dp_group, dp_size = dp_mesh.get_group(), dp_mesh.size()
        torch.manual_seed(42 + dp_mesh.get_local_rank() + 1)
        tokens = torch.randint(0, VOCAB, (3, SEQ))
        for step in range(3):
            where = f"p={norm_type} step {step}"
            for m in (ref_model, model):
                m.zero_grad()
                m(tokens).sum().backward()
            for p in ref_model.parameters():  # replicate's average over dp ranks
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp_size
            ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
            local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
            for ref, p in zip(ref_grads, model.parameters()):
                if tuple(p.placements) == (Shard(0), Shard(0)):
                    continue  # torch skips these too (strided sharding)
                full = p.grad.full_tensor()
                _check(failures, torch.allclose(ref, full, rtol=1.3e-6, atol=1e-5),
                       f"{where}: gradients differ by {float((ref - full).abs().max())} "
                       f"(largest {float(ref.abs().max())}, {p.grad.placements})")
            norm = lambda g, p=norm_type: torch.linalg.vector_norm(g, p).item()  # noqa: E731
            _check(failures, all(norm(g) > max_norm for g in ref_grads), f"{where}: vacuous")
            _check(failures, all(norm(g) > max_norm for g in local_grads if g.numel()),
                   f"{where}: vacuous shard")
            ref_total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm,
                                                       norm_type=norm_type)
            total = clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type,
                                    foreach=True)
            _check(failures, torch.allclose(ref_total, total.full_tensor(), rtol=1.3e-6,
                                            atol=1e-5),
                   f"{where}: total {float(total)} vs torch's {float(ref_total)}")
            first_mesh = next(p.grad.device_mesh for p in model.parameters())
            _check(failures, total.device_mesh == first_mesh, f"{where}: not the first mesh")
            _check(failures, all(isinstance(pl, Replicate) for pl in total.placements),
                   f"{where}: placements {total.placements}")
            totals.append(float(total))
            for p, g in zip(ref_model.parameters(), ref_grads):
                _check(failures, norm(p.grad) <= max_norm * (1 + 1e-5), f"{where}: ref above")
                if torch.count_nonzero(g):
                    _check(failures, not torch.equal(p.grad, g), f"{where}: ref unchanged")
            for p, g in zip(model.parameters(), local_grads):
                local = p.grad.to_local()
                _check(failures, norm(local) <= max_norm * (1 + 1e-5), f"{where}: above")
                if torch.count_nonzero(g):
                    _check(failures, not torch.equal(local, g), f"{where}: unchanged")
    return {"failures": failures, "totals": totals}


def several_meshes(rank: int, world: int) -> dict:
    """Gradients on two meshes: the total is replicated on the first gradient's mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat = init_device_mesh("cpu", (world,))
    square = init_device_mesh("cpu", (2, world // 2))
    g = torch.Generator().manual_seed(3)
    grads = [distribute_tensor(torch.randn(6, 4, generator=g), square, [Shard(0), Replicate()]),
             distribute_tensor(torch.randn(8, 2, generator=g), flat, [Shard(0)])]
    total = get_total_norm(grads)
    want = torch.linalg.vector_norm(torch.cat([t.full_tensor().double().view(-1)
                                               for t in grads]))
    return {"mesh_is_first": total.device_mesh == square,
            "replicated": [isinstance(p, Replicate) for p in total.placements],
            "float": float(total), "full_tensor": float(total.full_tensor()),
            "reference": float(want)}


CHECKS = {2: [clip_like_torch_tests], 4: [clip_like_torch_tests, several_meshes]}


def run_rank(rank: int, world: int, outdir: str) -> None:
    os.environ.pop("RANK", None)
    dist.init_process_group("gloo", init_method=f"file://{outdir}/store", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    results = {}
    for check in CHECKS[world]:
        try:
            results[check.__name__] = check(rank, world)
        except Exception as error:  # reported to the test, which fails with it
            results[check.__name__] = {"error": f"{type(error).__name__}: {error}"}
        dist.barrier()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(results))
