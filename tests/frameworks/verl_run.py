"""A real verl FSDP2 run on the CPU: its checkpoints, and what verl's own loader reads back.

Run in the verl venv (verl 0.9.1 beside torch 2.13, see ``.ci/run``)::

    torchrun --nproc-per-node 2 tests/frameworks/verl_run.py OUT [tied]

A tiny Llama (``transformers``' ``LlamaForCausalLM`` from a config: sizes that
do not divide by 2, so the ranks' shards differ) is wrapped the way verl's
``apply_fsdp2`` wraps an actor (``fully_shard`` on each decoder layer, then on
the model) and trains ``STEPS`` AdamW steps over gloo; with ``tied``, its output
layer is its embedding (``tie_word_embeddings``: one parameter, two names in the
state dict). After each step verl's
own ``FSDPCheckpointManager.save_checkpoint`` writes
``OUT/run/global_step_N/actor/``: ``model_world_size_2_rank_R.pt``,
``optim_world_size_2_rank_R.pt``, ``extra_state_world_size_2_rank_R.pt`` (each
``torch.save`` of the rank's DTensor shards), ``fsdp_config.json`` and
``huggingface/`` (the model's config), as verl's trainer lays them out.

Then a fresh model and optimizer (another seed) load each step with the same
manager's ``load_checkpoint``; their ``full_tensor()`` values are the tests'
reference, ``OUT/reference/global_step_N.pt``: ``weights`` (name -> tensor),
``state`` (name -> ``exp_avg``, ``exp_avg_sq``, ``step``) and ``groups`` (each
group's hyperparameters and its parameters' names).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 2
VOCAB, SEQUENCE = 37, 6


def build(seed: int, tied: bool):
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=12, intermediate_size=20, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                  weight_decay=0.01, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def manager(model, optimizer, scheduler):
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    return FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=scheduler)


def full(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor().detach().clone() if isinstance(value, DTensor) else value


def reference(model, optimizer) -> dict:
    names = [n for n, _ in model.named_parameters()]
    state = optimizer.state_dict()
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        for g in state["param_groups"]
    ]
    return {
        "weights": {n: full(t) for n, t in model.state_dict().items()},
        "state": {names[i]: {k: full(v) for k, v in s.items()} for i, s in state["state"].items()},
        "groups": groups,
    }


def main(out: Path, tied: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer, scheduler = build(0, tied)
    saver = manager(model, optimizer, scheduler)
    generator = torch.Generator().manual_seed(1 + rank)
    folders = []
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (2, SEQUENCE), generator=generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        folder = out / "run" / f"global_step_{step}" / "actor"
        saver.save_checkpoint(str(folder), global_step=step)
        folders.append((step, folder))

    (out / "reference").mkdir(parents=True, exist_ok=True)
    for step, folder in folders:
        model, optimizer, scheduler = build(100 + step, tied)
        manager(model, optimizer, scheduler).load_checkpoint(str(folder))
        loaded = reference(model, optimizer)
        if rank == 0:
            torch.save(loaded, out / "reference" / f"global_step_{step}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] == ["tied"])
