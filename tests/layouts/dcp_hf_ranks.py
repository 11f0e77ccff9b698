"""What each spawned rank runs to write DCP's Hugging Face layout (test_dcp_hf.py spawns two).

FSDP2 ``fully_shard`` of a small MLP on a 1-D CPU mesh over gloo, one AdamW
step, then ``dcp.save`` of the model's state dict with
``HuggingFaceStorageWriter(save_distributed=True)``: each rank writes its
own shards as a safetensors file with ``DCP_SHARDING_INFO``. Rank 0 also
saves every parameter whole (``full_tensor()``) for the test's reference.

The same step's gradients are saved the same way into ``grads/`` (what
``clip`` changes): FSDP2's sharded DTensor gradients, and ``2.bias``'s
redistributed as ``Replicate()`` (a replicated gradient, as tensor
parallelism leaves a bias's). DCP's planner writes a replicated tensor from
one rank only; a planner that keeps every rank's copy (``KeepReplicas``)
makes both files hold it, at the same place with the same bytes, which the
layout reads as one piece stored twice. ``counts``, an int64 tensor sharded
alike, is not a gradient. ``grads_reference.pt`` holds every gradient whole.
"""

from __future__ import annotations

import os

import torch

from .dcp_ranks import sharded_mlp

REPLICATED = "2.bias"
COUNTS = "counts"


def save_rank(rank: int, world: int, outdir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.default_planner import (
        DefaultSavePlanner,
        create_default_global_save_plan,
    )
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    class KeepReplicas(DefaultSavePlanner):
        # DCP's own planner drops all but one rank's copy of a replicated
        # tensor, then checks that no two ranks write the same place.
        def _create_global_plan(self, all_plans):
            return create_default_global_save_plan(all_plans)

    model = sharded_mlp(rank, world, outdir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    optimizer.step()
    state = model.state_dict()
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        path=os.path.join(outdir, "checkpoint"), save_distributed=True))
    grads = {name: p.grad for name, p in model.named_parameters()}
    grads[REPLICATED] = grads[REPLICATED].redistribute(placements=[Replicate()])
    # Not a gradient (an int64 tensor, sharded like them): clip keeps it as it is.
    grads[COUNTS] = distribute_tensor(torch.arange(4, dtype=torch.int64),
                                      grads[REPLICATED].device_mesh, [Shard(0)])
    dcp.save(grads, planner=KeepReplicas(), storage_writer=HuggingFaceStorageWriter(
        path=os.path.join(outdir, "grads"), save_distributed=True))
    whole = {name: t.full_tensor() for name, t in state.items()}
    whole_grads = {name: g.full_tensor() for name, g in grads.items() if name != COUNTS}
    if rank == 0:
        torch.save(whole, os.path.join(outdir, "reference.pt"))
        torch.save(whole_grads, os.path.join(outdir, "grads_reference.pt"))
