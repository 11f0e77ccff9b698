"""What each spawned rank runs to write accelerate's FSDP checkpoints (two ranks).

accelerate turns FSDP off without a GPU (``Accelerator`` falls back to
``MULTI_CPU``), so its ``prepare`` cannot shard the model here. What writes
the checkpoint is still accelerate's own code: FSDP2 ``fully_shard`` of the
small MLP on a gloo mesh (what ``prepare`` does on GPUs), two AdamW steps,
and after each one the calls ``Accelerator.save_state`` and the Trainer
make for an FSDP model with ``state_dict_type="SHARDED_STATE_DICT"``:
``accelerate.utils.save_fsdp_model`` and ``save_fsdp_optimizer``, into
``run/checkpoint-<step>/``, with the Trainer's ``TrainerState`` saved beside
by transformers (``trainer_state.json``).
"""

from __future__ import annotations

import os

import torch

from .dcp_ranks import sharded_mlp

STEPS = 2


def save_rank(rank: int, world: int, outdir: str) -> None:
    model = sharded_mlp(rank, world, outdir)
    # accelerate reads the process layout from the environment and joins the
    # group already made.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    from accelerate import Accelerator
    from accelerate.utils import (
        FullyShardedDataParallelPlugin,
        save_fsdp_model,
        save_fsdp_optimizer,
    )
    from transformers import TrainerState

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world and accelerator.process_index == rank
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                            state_dict_type="SHARDED_STATE_DICT")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95),
                                  weight_decay=0.1)
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        optimizer.step()
        folder = os.path.join(outdir, "run", f"checkpoint-{step}")
        save_fsdp_model(plugin, accelerator, model, folder)
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, folder)
        if accelerator.is_main_process:
            TrainerState(global_step=step, max_steps=STEPS).save_to_json(
                os.path.join(folder, "trainer_state.json"))
