"""What each spawned rank runs to write a real DCP checkpoint (test_dcp.py spawns two).

FSDP2 ``fully_shard`` on a 1-D CPU mesh over gloo, two AdamW steps of a small
MLP, then ``dcp.save`` of the model and optimizer state from
``get_state_dict`` and the last step's gradients (DTensors, as FSDP2 leaves
them), plus the step count: what a training script with a rollback
checkpoint writes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

STEPS = 2


def sharded_mlp(rank: int, world: int, outdir: str) -> torch.nn.Module:
    """Join the spawned gloo group and build the small MLP, FSDP2-sharded over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.pop("RANK", None)
    dist.init_process_group("gloo", init_method=f"file://{outdir}/store", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    # 3 output rows split 2 + 1: uneven FSDP2 shards.
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def trained(rank: int, world: int, outdir: str, steps: int):
    """``sharded_mlp`` after ``steps`` AdamW steps on this rank's own batches: the model
    and its optimizer."""
    model = sharded_mlp(rank, world, outdir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95),
                                  weight_decay=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        optimizer.step()
    return model, optimizer


def save_rank(rank: int, world: int, outdir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = trained(rank, world, outdir, STEPS)
    grads = {name: p.grad for name, p in model.named_parameters()}
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "grads": grads, "step": STEPS},
             checkpoint_id=os.path.join(outdir, "checkpoint"))
