"""Train a tiny Llama 2 with torchtune's own ``full_finetune_single_device`` recipe on CPU.

Run in the frameworks venv, in one process: ``python torchtune_run.py OUT``.
Everything the recipe reads is made here, offline: a SentencePiece tokenizer
trained on a generated text, that text as a local ``text`` dataset, and a
randomly initialised base checkpoint saved as torchtune's checkpointer reads
it. The recipe (torchtune's file, run through ``tune run``) trains 3 epochs
of 2 AdamW steps each and saves with ``FullModelTorchTuneCheckpointer``:

* ``OUT/run/epoch_{0,1,2}/model-00001-of-00001.bin``: the model each epoch;
* ``OUT/run/recipe_state/recipe_state.pt``: the optimizer and the recipe's
  progress, written at every epoch but the last (so it is epoch 1's).

A second run (``OUT/in_bwd``) sets ``optimizer_in_bwd: True``, where the
recipe keeps one optimizer per parameter and saves them keyed by name. A
third (``OUT/hf``, 2 epochs) starts from the same model converted to Hugging
Face's names by torchtune's own ``convert_weights.tune_to_hf`` and saves with
``FullModelHFCheckpointer``: ``epoch_N/`` holds safetensors shards under
Hugging Face names, their index and the copied ``config.json``.

A fourth (``OUT/lora``, 2 epochs) runs ``lora_finetune_single_device``:
``epoch_N/`` also holds ``adapter_model.pt``, and the optimizer was given
every parameter of the LoRA model (state only for the adapter's). Its
``named_parameters()`` order, which gives the optimizer's ids their names, is
written from torchtune's own model as ``OUT/reference/lora_names.json``: the
tests' reference. The other files are read as the recipe wrote them.

A fifth (``OUT/lora_adapter``, 2 epochs) runs the LoRA recipe with
``save_adapter_weights_only: True`` and ``FullModelHFCheckpointer``: each
``epoch_N/`` holds the adapter alone (``adapter_model.pt`` under torchtune's
names, ``adapter_model.safetensors`` under PEFT's, ``adapter_config.json``),
no model shard.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import sentencepiece
import torch
from safetensors.torch import save_file
from torchtune.models import convert_weights
from torchtune.models.llama2 import llama2, lora_llama2

VOCAB = 64
LORA = dict(
    lora_attn_modules=["q_proj", "v_proj"],
    apply_lora_to_mlp=False,
    apply_lora_to_output=False,
    lora_rank=4,
    lora_alpha=8,
)
MODEL = dict(
    vocab_size=VOCAB, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=16, max_seq_len=32
)


def _inputs(out: Path) -> Path:
    """The tokenizer, the text and the base checkpoint, in ``out/base`` (and in Hugging
    Face's names, with its ``config.json``, in ``out/base_hf``)."""
    base = out / "base"
    base.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghij"
    lines = []
    for _ in range(16):
        words = [
            "".join(letters[i] for i in torch.randint(0, 10, (int(n),), generator=g))
            for n in torch.randint(2, 6, (8,), generator=g)
        ]
        lines.append(" ".join(words))
    (out / "data.txt").write_text("\n".join(lines) + "\n")
    sentencepiece.SentencePieceTrainer.train(
        input=str(out / "data.txt"),
        model_prefix=str(base / "tokenizer"),
        vocab_size=VOCAB,
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    torch.manual_seed(0)
    state = llama2(**MODEL).state_dict()
    torch.save(state, base / "model.pt")
    hf = out / "base_hf"
    hf.mkdir()
    shape = dict(
        num_heads=MODEL["num_heads"], num_kv_heads=MODEL["num_kv_heads"], dim=MODEL["embed_dim"]
    )
    converted = convert_weights.tune_to_hf(state, **shape)
    save_file(
        {k: v.contiguous() for k, v in converted.items()},
        hf / "model-00001-of-00001.safetensors",
        metadata={"format": "pt"},
    )
    (hf / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_attention_heads": shape["num_heads"],
                "num_key_value_heads": shape["num_kv_heads"],
                "hidden_size": shape["dim"],
            }
        )
    )
    shutil.copy(base / "tokenizer.model", hf / "tokenizer.model")
    return base


def _config(
    out: Path,
    name: str,
    base: Path,
    in_bwd: bool,
    hf: bool = False,
    lora: bool = False,
    adapter_only: bool = False,
) -> Path:
    model = "\n".join(f"  {k}: {v}" for k, v in MODEL.items())
    builder = "lora_llama2" if lora else "llama2"
    if lora:
        model += "".join(f"\n  {k}: {json.dumps(v)}" for k, v in LORA.items())
    if hf:
        checkpointer = "FullModelHFCheckpointer"
        checkpoint_dir, checkpoint_file = out / "base_hf", "model-00001-of-00001.safetensors"
    else:
        checkpointer = "FullModelTorchTuneCheckpointer"
        checkpoint_dir, checkpoint_file = base, "model.pt"
    text = f"""\
output_dir: {out / name}
tokenizer:
  _component_: torchtune.models.llama2.llama2_tokenizer
  path: {base / "tokenizer.model"}
  max_seq_len: 16
dataset:
  _component_: torchtune.datasets.text_completion_dataset
  source: text
  data_files: {out / "data.txt"}
  column: text
  split: train
seed: 0
shuffle: False
model:
  _component_: torchtune.models.llama2.{builder}
{model}
checkpointer:
  _component_: torchtune.training.{checkpointer}
  checkpoint_dir: {checkpoint_dir}
  checkpoint_files: [{checkpoint_file}]
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: LLAMA2
resume_from_checkpoint: False
batch_size: 2
epochs: {2 if hf or lora else 3}
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 0
  num_cycles: 0.0
save_adapter_weights_only: {adapter_only}
optimizer:
  _component_: torch.optim.AdamW
  lr: 0.001
  weight_decay: 0.01
optimizer_in_bwd: {in_bwd}
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
max_steps_per_epoch: 2
gradient_accumulation_steps: 1
clip_grad_norm: null
compile: False
device: cpu
enable_activation_checkpointing: False
enable_activation_offloading: False
dtype: fp32
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
log_peak_memory_stats: False
"""
    path = out / f"{name}.yaml"
    path.write_text(text)
    return path


def main(out: Path) -> None:
    base = _inputs(out)
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(out / "hf_home")
    )
    runs = (
        ("run", False, False, False),
        ("in_bwd", True, False, False),
        ("hf", False, True, False),
        ("lora", False, False, True),
        ("lora_adapter", False, True, True),
    )
    for name, in_bwd, hf, lora in runs:
        config = _config(out, name, base, in_bwd, hf, lora, adapter_only=name == "lora_adapter")
        recipe = "lora_finetune_single_device" if lora else "full_finetune_single_device"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torchtune._cli.tune",
                "run",
                recipe,
                "--config",
                str(config),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        if done.returncode != 0:
            sys.exit(
                f"tune run {name} failed ({done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
            )
    reference = out / "reference"
    reference.mkdir()
    names = [n for n, _ in lora_llama2(**MODEL, **LORA).named_parameters()]
    (reference / "lora_names.json").write_text(json.dumps(names))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
