"""Save with litgpt's pretraining ``save_checkpoint`` after 2 AdamW steps of a tiny litgpt GPT.

Run in the frameworks venv: ``python litgpt_run.py OUT``. litgpt's
``pretrain.save_checkpoint`` is ``fabric.save`` of its training state (model,
optimizer, ``iter_num``, ``step_count``) to
``OUT/out/pretrain/step-00000004/lit_model.pth``, with the model's config and
the hyperparameters beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning
import torch
from litgpt.model import GPT, Config
from litgpt.pretrain import save_checkpoint


def main(out: Path) -> None:
    torch.manual_seed(0)
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    model = GPT(
        Config(block_size=8, vocab_size=32, padded_vocab_size=32, n_layer=2, n_head=2, n_embd=8)
    )
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for i in range(2):
        x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(i))
        fabric.backward(model(x).logsumexp(-1).mean())
        opt.step()
        opt.zero_grad()
    path = out / "out" / "pretrain" / "step-00000004" / "lit_model.pth"
    state = {"model": model, "optimizer": opt, "iter_num": 4, "step_count": 2}
    save_checkpoint(fabric, state, None, path)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
