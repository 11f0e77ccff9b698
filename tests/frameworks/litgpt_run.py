"""Save with litgpt's pretraining ``save_checkpoint`` during 2 AdamW steps of a tiny litgpt GPT.

Run in the frameworks venv: ``python litgpt_run.py OUT``. As litgpt's
``pretrain.fit`` does, each optimizer step accumulates 2 micro-batches
(``iter_num`` counts those, ``step_count`` the optimizer's steps), and each step
is saved by ``save_checkpoint`` (``fabric.save`` of the training state: model,
optimizer, ``iter_num``, ``step_count``) to
``OUT/out/pretrain/step-{step_count:08d}/lit_model.pth``, litgpt's own path,
with the model's config and the hyperparameters beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning
import torch
from litgpt.model import GPT, Config
from litgpt.pretrain import save_checkpoint

ACCUMULATE = 2


def main(out: Path) -> None:
    torch.manual_seed(0)
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    config = Config(
        block_size=8, vocab_size=32, padded_vocab_size=32, n_layer=2, n_head=2, n_embd=8
    )
    model = GPT(config)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    state = {"model": model, "optimizer": opt, "iter_num": 0, "step_count": 0}
    for _ in range(2):
        for _ in range(ACCUMULATE):
            g = torch.Generator().manual_seed(state["iter_num"])
            x = torch.randint(0, 32, (2, 8), generator=g)
            fabric.backward(model(x).logsumexp(-1).mean() / ACCUMULATE)
            state["iter_num"] += 1
        opt.step()
        opt.zero_grad()
        state["step_count"] += 1
        folder = out / "out" / "pretrain" / f"step-{state['step_count']:08d}"
        save_checkpoint(fabric, state, None, folder / "lit_model.pth")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
