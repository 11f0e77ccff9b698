"""What each spawned rank runs to write DCP's Hugging Face layout (test_dcp_hf.py spawns two).

FSDP2 ``fully_shard`` of a small MLP on a 1-D CPU mesh over gloo, one AdamW
step, then ``dcp.save`` of the model's state dict with
``HuggingFaceStorageWriter(save_distributed=True)``: each rank writes its
own shards as a safetensors file with ``DCP_SHARDING_INFO``. Rank 0 also
saves every parameter whole (``full_tensor()``) for the test's reference.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .dcp_ranks import sharded_mlp


def save_rank(rank: int, world: int, outdir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model = sharded_mlp(rank, world, outdir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    optimizer.step()
    state = model.state_dict()
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        path=os.path.join(outdir, "checkpoint"), save_distributed=True))
    whole = {name: t.full_tensor() for name, t in state.items()}
    if rank == 0:
        torch.save(whole, os.path.join(outdir, "reference.pt"))
    dist.destroy_process_group()
