"""A real torchtitan run on the CPU: its checkpoints, and what torch's own loader reads back.

Run in the frameworks venv (torchtitan 0.3.0, see ``.ci/run``)::

    python tests/frameworks/torchtitan_run.py OUT [WORLD_SIZE]

A tiny Llama 3 (torchtitan's own ``Llama3Model``, fused ``wqkv``, GQA, its
``ScaledDotProductAttention``: the CPU-capable masked backends have no
backward) trains 3 AdamW steps with torchtitan's ``OptimizersContainer`` and
``LRSchedulersContainer``; torchtitan's ``CheckpointManager`` saves
``OUT/run/checkpoint/step-N/`` at steps 1, 2 and 3, the last one a
weights-only export (``last_save_model_only``, as torchtitan's default).
With WORLD_SIZE 2 the ranks (gloo) hold the same replicated model, so DCP
writes one file per rank with the state deduplicated.

Then ``dcp_to_torch_save`` (torch's own reassembly of a DCP folder) turns
each step into one torch file, ``OUT/reference/step-N.pt``: the reference the
tests compute float64 norms from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# torchtitan imports torchao's float8 and MX kernels when torchao imports, and
# falls back without them on an ImportError. The frameworks venv has torchao
# 0.14.1 for torchtune, whose MoE kernels fail to import beside triton 3.9
# (a ValueError from triton's autotuner, not an ImportError): this run uses
# none of them, so torchtitan is given the ImportError it expects.
sys.modules["torchao"] = None


def tiny_llama3(
    dim: int = 32,
    n_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    hidden: int = 64,
    vocab: int = 64,
):
    """torchtitan's Llama 3 at the given sizes (the tests' tiny one by default)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model

    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=n_layers,
        dim=dim,
        n_heads=heads,
        n_kv_heads=kv_heads,
        hidden_dim=hidden,
        attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"),
    )
    for layer in layers:  # flex and varlen have no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init={"weight": torch.nn.init.normal_}
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(
            in_features=dim,
            out_features=vocab,
            param_init={"weight": torch.nn.init.normal_, "bias": torch.nn.init.zeros_},
        ),
        layers=layers,
    )
    torch.manual_seed(0)
    model = config.build()
    return model, vocab


def main(out: Path, *, steps: int = 3, sizes: dict | None = None, reference: bool = True) -> None:
    """Train ``steps`` steps of a Llama 3 of ``sizes`` (``tiny_llama3``'s arguments), saving each;
    with ``reference``, the last save is the weights-only export and each step is converted."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    model, vocab = tiny_llama3(**(sizes or {}))
    config = default_adamw(lr=1e-2)
    config.implementation = "for-loop"  # fused AdamW is CUDA only
    optimizers = config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
        optimizers=optimizers, training_steps=steps
    )
    train_state = train_state_factory()
    manager = CheckpointManager(
        CheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=1,
            keep_latest_k=0,
            last_save_model_only=reference,
        ),
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=os.fspath(out / "run"),
    )
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        tokens = torch.randint(0, vocab, (2, 9), generator=g)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.step = step
        train_state.ntokens_seen += tokens.numel()
        manager.save(step, last_step=step == steps)
    manager.close()
    if reference and dist.get_rank() == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        (out / "reference").mkdir(exist_ok=True)
        for step in range(1, steps + 1):
            dcp_to_torch_save(
                out / "run" / "checkpoint" / f"step-{step}", out / "reference" / f"step-{step}.pt"
            )


def train_state_factory():
    """The trainer's own checkpointed state: ``Trainer.state_dict`` (``step``, ``ntokens_seen``)
    on an object holding just those, as ``Trainer`` registers itself as ``train_state``."""
    from torchtitan.trainer import Trainer

    class TrainState:
        state_dict = Trainer.state_dict
        load_state_dict = Trainer.load_state_dict

    state = TrainState()
    state.step, state.ntokens_seen = 0, 0
    return state


if __name__ == "__main__":
    target = Path(sys.argv[1])
    dist.init_process_group("gloo")
    try:
        main(target)
    finally:
        dist.destroy_process_group()
