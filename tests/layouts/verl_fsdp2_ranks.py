"""What each spawned rank runs to write verl's FSDP file layout with torch alone (two ranks).

verl's ``FSDPCheckpointManager`` saves an FSDP2 model and optimizer as
``torch.save(model.state_dict())`` and ``torch.save(optimizer.state_dict())`` per
rank, named ``model_world_size_W_rank_R.pt`` and ``optim_world_size_W_rank_R.pt``,
with ``fsdp_config.json`` from rank 0. This writes the same with torch's own
``fully_shard`` (the small MLP of ``dcp_ranks.py``), so that the DTensor reader is
tested without verl installed (verl's own files: ``tests/frameworks/test_verl.py``).
Beside them, ``reference.pt`` holds every tensor whole (``full_tensor()``), and
``partial/`` and ``mesh2d/`` hold DTensors the reader refuses: a ``Partial``
placement, and a 2-D device mesh.
"""

from __future__ import annotations

import json
import os

import torch

from .dcp_ranks import trained

STEPS = 2


def save_rank(rank: int, world: int, outdir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    model, optimizer = trained(rank, world, outdir, STEPS)
    actor = os.path.join(outdir, f"global_step_{STEPS}", "actor")
    os.makedirs(actor, exist_ok=True)
    model_state, optim_state = model.state_dict(), optimizer.state_dict()
    torch.save(model_state, os.path.join(actor, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save(optim_state, os.path.join(actor, f"optim_world_size_{world}_rank_{rank}.pt"))
    names = [n for n, _ in model.named_parameters()]
    whole = {
        "weights": {n: t.full_tensor() for n, t in model_state.items()},
        "state": {
            names[i]: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in s.items()}
            for i, s in optim_state["state"].items()
        },
        "groups": [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [names[i] for i in g["params"]]}
            for g in optim_state["param_groups"]
        ],
    }
    mesh = init_device_mesh("cpu", (world,))
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
    mesh2d = init_device_mesh("cpu", (world, 1))
    flat = DTensor.from_local(torch.ones(2, 4), mesh2d, [Shard(0), Replicate()], run_check=False)
    for name, value in (("partial", partial), ("mesh2d", flat)):
        os.makedirs(os.path.join(outdir, name), exist_ok=True)
        file = f"model_world_size_{world}_rank_{rank}.pt"
        torch.save({"w": value}, os.path.join(outdir, name, file))
    if rank == 0:
        torch.save(whole, os.path.join(outdir, "reference.pt"))
        with open(os.path.join(actor, "fsdp_config.json"), "w") as f:
            json.dump({"FSDP_version": 2, "world_size": world}, f)
