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


def save_rank(rank: int, world: int, outdir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
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
