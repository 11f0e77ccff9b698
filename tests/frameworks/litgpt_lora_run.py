"""Fine-tune a tiny litgpt GPT with ``litgpt finetune_lora`` on CPU, offline.

Run in the frameworks venv: ``python litgpt_lora_run.py OUT``. Everything the
command reads is made here: a SentencePiece tokenizer trained on a generated
text, that text as a local ``JSON`` dataset of instructions, and a randomly
initialised base checkpoint (``OUT/base/``: ``lit_model.pth`` and
``model_config.yaml``, as litgpt's own checkpoints are). litgpt's CLI then runs
2 optimizer steps of 2 micro-batches each, saving every step
(``--train.save_interval 1``), as it does:

* ``OUT/out/step-00000{1,2}/lit_model.pth.lora``: ``{"model": ...}``, the LoRA
  adapter's tensors alone (``lora_A``/``lora_B``), no optimizer, beside
  ``model_config.yaml``, ``hyperparameters.yaml`` and the tokenizer's files;
* ``OUT/out/final/``: the same adapter, and ``lit_model.pth``, the base model
  with the adapter merged in (``merge_lora``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sentencepiece
import torch
from litgpt.model import GPT, Config
from litgpt.utils import save_config


def _inputs(out: Path) -> Path:
    base = out / "base"
    base.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghij"
    rows, lines = [], []
    for _ in range(8):
        words = [
            "".join(letters[j] for j in torch.randint(0, 10, (int(n),), generator=g))
            for n in torch.randint(2, 5, (4,), generator=g)
        ]
        prompt, answer = " ".join(words[:2]), " ".join(words[2:])
        rows.append({"instruction": prompt, "input": "", "output": answer})
        lines.append(" ".join(words))
    (out / "data.txt").write_text("\n".join(lines) + "\n")
    (out / "data.json").write_text(json.dumps(rows))
    sentencepiece.SentencePieceTrainer.train(
        input=str(out / "data.txt"),
        model_prefix=str(base / "tokenizer"),
        vocab_size=48,
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    (base / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True})
    )
    config = Config(
        name="tiny", block_size=64, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2,
        n_embd=8,
    )
    save_config(config, base)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), base / "lit_model.pth")
    return base


def main(out: Path) -> None:
    base = _inputs(out)
    command = [
        sys.executable, "-m", "litgpt", "finetune_lora", str(base),
        "--out_dir", str(out / "out"),
        "--data", "JSON", "--data.json_path", str(out / "data.json"),
        "--data.val_split_fraction", "0.25", "--data.num_workers", "0",
        "--train.save_interval", "1", "--train.global_batch_size", "2",
        "--train.micro_batch_size", "1", "--train.epochs", "1", "--train.max_steps", "2",
        "--train.max_seq_length", "48", "--train.lr_warmup_steps", "1",
        "--eval.interval", "100", "--eval.final_validation", "false",
        "--eval.max_new_tokens", "2", "--eval.max_iters", "1",
        "--optimizer", "AdamW", "--precision", "32-true",
        "--lora_r", "2", "--lora_alpha", "4", "--logger_name", "csv",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        sys.exit(f"litgpt finetune_lora failed ({done.returncode}):\n"
                 f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
