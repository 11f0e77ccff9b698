"""Fine-tune a tiny litgpt GPT with ``litgpt finetune_METHOD`` on CPU, offline.

Run in the frameworks venv: ``python litgpt_finetune_run.py OUT METHOD``, METHOD
one of ``lora``, ``adapter``, ``adapter_v2``, ``full``. Everything the command
reads is made here: a SentencePiece tokenizer trained on a generated text, that
text as a local ``JSON`` dataset of instructions, and a randomly initialised
base checkpoint (``OUT/base/``: ``lit_model.pth`` and ``model_config.yaml``, as
litgpt's own checkpoints are). litgpt's CLI then runs 2 optimizer steps of 2
micro-batches each, saving every step (``--train.save_interval 1``), as it does:

* ``lora``: ``OUT/out/step-00000{1,2}/lit_model.pth.lora``: ``{"model": ...}``,
  the LoRA adapter's tensors alone (``lora_A``/``lora_B``), no optimizer, beside
  ``model_config.yaml``, ``hyperparameters.yaml`` and the tokenizer's files;
  ``OUT/out/final/``: the same adapter, and ``lit_model.pth``, the base model
  with the adapter merged in (``merge_lora``);
* ``adapter`` / ``adapter_v2``: the same folders holding
  ``lit_model.pth.adapter`` / ``lit_model.pth.adapter_v2``, the adapter's
  tensors alone (``adapter_filter``: ``adapter_wte``, ``gating_factor``; v2 adds
  ``adapter_bias``, ``adapter_scale`` and the norms); ``final/`` holds the
  adapter alone, nothing merged. Their base model has 3 layers (litgpt's
  adapter starts at layer 2, ``adapter_start_layer``) and ``n_embd`` 16 (litgpt
  0.5.13's adapter attention fails at 8, a 4-wide head);
* ``full``: ``step-00000{1,2}/lit_model.pth``, the training state (model,
  optimizer, scheduler, ``iter_num``, ``step_count``), and ``final/lit_model.pth``,
  ``{"model": ...}``.
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

METHODS = ("lora", "adapter", "adapter_v2", "full")


def _inputs(out: Path, n_layer: int, n_embd: int) -> Path:
    base = out / "base"
    base.mkdir(parents=True, exist_ok=True)  # run_generator may try twice
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
        name="tiny", block_size=64, vocab_size=64, padded_vocab_size=64, n_layer=n_layer, n_head=2,
        n_embd=n_embd,
    )
    save_config(config, base)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), base / "lit_model.pth")
    return base


def main(out: Path, method: str) -> None:
    if method not in METHODS:
        sys.exit(f"METHOD is one of {', '.join(METHODS)}, not {method!r}")
    adapter = method.startswith("adapter")
    base = _inputs(out, 3 if adapter else 2, 16 if adapter else 8)
    command = [
        sys.executable, "-m", "litgpt", f"finetune_{method}", str(base),
        "--out_dir", str(out / "out"),
        "--data", "JSON", "--data.json_path", str(out / "data.json"),
        "--data.val_split_fraction", "0.25", "--data.num_workers", "0",
        "--train.save_interval", "1", "--train.global_batch_size", "2",
        "--train.micro_batch_size", "1", "--train.epochs", "1", "--train.max_steps", "2",
        "--train.max_seq_length", "48", "--train.lr_warmup_steps", "1",
        "--eval.interval", "100", "--eval.final_validation", "false",
        "--eval.max_new_tokens", "2", "--eval.max_iters", "1",
        "--optimizer", "AdamW", "--precision", "32-true",
        "--logger_name", "csv",
    ]
    if method == "lora":
        command += ["--lora_r", "2", "--lora_alpha", "4"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        sys.exit(f"litgpt finetune_{method} failed ({done.returncode}):\n"
                 f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
