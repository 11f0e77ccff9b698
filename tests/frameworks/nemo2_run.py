"""A real NeMo 2 run on the CPU, saved by NeMo's own checkpointing, and NeMo's own load of it.

Run in the NeMo venv (nemo-toolkit 2.7.3 beside torch 2.13, see ``.ci/run``)::

    python tests/frameworks/nemo2_run.py OUT

(Not ``nemo_run.py``: NeMo imports its own ``nemo_run`` package, which this script,
its folder first on the path, would shadow.)

NeMo 2's ``llm.GPTModel`` (a 2-layer Megatron-core GPT of NeMo's ``GPTConfig``, no
Transformer Engine: Megatron's local layers) trains 3 Adam steps under NeMo's own
``nl.Trainer`` and ``nl.MegatronStrategy`` (one process, Lightning's CPU accelerator),
its optimizer NeMo's ``MegatronOptimizerModule`` (Megatron-core's ``get_megatron_optimizer``:
the plain ``FP32Optimizer``). NeMo's ``ModelCheckpoint`` saves every step, as NeMo 2 lays a
checkpoint out: ``OUT/run/default/<time>/checkpoints/<name>/`` holding ``weights/`` (written
by NeMo's ``MegatronCheckpointIO`` through Megatron-core's ``dist_checkpointing.save``,
``torch_dist``: ``.metadata``, ``*.distcp``, ``common.pt`` with Lightning's own keys and the
optimizer's param groups, ``metadata.json``) and ``context/`` (NeMo's ``TrainerContext``
``io_dump``: ``io.json``, ``model.yaml``). Each checkpoint folder is copied to
``OUT/run/step_N/`` (its step: ``global_step``), whose name the tests read.

Then NeMo's own loader, the strategy's ``load_checkpoint`` (the model's and the optimizer's
sharded dicts filled by ``dist_checkpointing.load``), reads each back, saved as
``OUT/reference/step_N.pt``: ``weights`` by Megatron's names (a stacked layer's with its
number), the optimizer's ``state`` by the same names (its ids named by Megatron's own
id-to-sharded-tensor map) and its ``groups``.

Shims for the CPU, as Megatron-core's run (``megatron_run.py``) has them: tensors asked for
on ``cuda`` are made on the CPU (``torch.tensor``, ``zeros``... and ``Tensor.cuda``/``.to``),
pinned memory is not asked for, ``torch.cuda.Stream`` is none (NeMo wraps its DDP set-up
in one), ``torch.cuda.current_device`` is the CPU, ``synchronize`` waits for nothing and
Megatron's RNG tracker forks nothing (no dropout). Not shims but NeMo's own settings:
``clip_grad`` 0 (Megatron's grad-norm clipping asserts CUDA tensors), and the data module's
attention mask made by keyword (NeMo 2.7.3's ``MockDataModule.setup`` hands
``create_attention_mask`` to ``_MockGPTDataset``'s ``seed``, and without Transformer Engine
NeMo's forward step needs the mask).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from pathlib import Path

import torch

VOCAB, SEQUENCE, STEPS, LAYERS, HIDDEN, HEADS = 64, 8, 3, 2, 16, 4


def cpu_shims() -> None:
    class NoStream:  # a type, as transformers annotates with ``torch.cuda.Stream | None``
        def __new__(cls, *_, **__):
            return None

    def on_cpu(make):
        def made(*args, device=None, **kwargs):
            kwargs.pop("pin_memory", None)
            return make(*args, device=None if "cuda" in str(device) else device, **kwargs)

        return made

    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and isinstance(args[0], (str, torch.device)) and "cuda" in str(args[0]):
            args = ("cpu", *args[1:])
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        return real_to(self, *args, **kwargs)

    torch.Tensor.to = to
    torch.Tensor.cuda = lambda self, *_, **__: self
    torch.cuda.Stream = NoStream
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *_: None
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *_, **__: contextlib.nullcontext()


def main(out: Path) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
    cpu_shims()
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
    from nemo.collections.llm.gpt.data import mock

    class Data(llm.MockDataModule):
        def setup(self, stage: str = "") -> None:
            def made(name, samples):
                return mock._MockGPTDataset(
                    self.tokenizer, name, samples, self.seq_length, create_attention_mask=True
                )

            self._train_ds = made("train", self.num_train_samples)
            self._validation_ds = made("valid", self.num_val_samples)
            self._test_ds = made("test", self.num_test_samples)

    torch.manual_seed(0)
    config = llm.GPTConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=2 * HIDDEN,
        num_attention_heads=HEADS, seq_length=SEQUENCE, vocab_size=VOCAB,
        make_vocab_size_divisible_by=1, init_method_std=0.02, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, bf16=False,
        params_dtype=torch.float32,
    )
    optim = nl.MegatronOptimizerModule(config=OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=0.0, use_distributed_optimizer=False, bf16=False, fp16=False,
    ))
    model = llm.GPTModel(config, optim=optim)
    data = Data(tokenizer=NullTokenizer(VOCAB), seq_length=SEQUENCE, global_batch_size=2,
                micro_batch_size=2)
    strategy = nl.MegatronStrategy(tensor_model_parallel_size=1, ckpt_async_save=False,
                                   ckpt_parallel_save=False)
    trainer = nl.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, strategy=strategy, log_every_n_steps=1,
        default_root_dir=str(out),  # its CSV logger's lightning_logs/ there, not in the clone
        limit_val_batches=0, val_check_interval=STEPS, enable_progress_bar=False,
        plugins=nl.MegatronMixedPrecision(precision="32"),
    )
    checkpoint = nl.ModelCheckpoint(monitor="reduced_train_loss", every_n_train_steps=1,
                                    save_top_k=-1, save_last=False,
                                    save_optim_on_train_end=True)
    from lightning.pytorch.callbacks import Callback

    class Reference(Callback):
        """Once the last step is saved, still within ``fit`` (the model as NeMo saved it)."""

        def on_train_end(self, trainer, pl_module) -> None:
            references(trainer, out)

    trainer.callbacks.append(Reference())
    nl.NeMoLogger(log_dir=str(out / "nemo"), ckpt=checkpoint).setup(trainer)
    trainer.fit(model, data)


def references(trainer, out: Path) -> None:
    run, reference = out / "run", out / "reference"
    run.mkdir()
    reference.mkdir()
    for folder in sorted((out / "nemo").glob("default/*/checkpoints/*")):
        if not (folder / "weights").is_dir():
            continue
        common = torch.load(folder / "weights" / "common.pt", weights_only=False)
        step = int(common["global_step"])
        shutil.copytree(folder, run / f"step_{step}")
        torch.save(loaded(trainer, run / f"step_{step}"), reference / f"step_{step}.pt")


def loaded(trainer, folder: Path) -> dict:
    """NeMo's own load of ``folder`` (``MegatronStrategy.load_checkpoint``), by name."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    strategy = trainer.strategy
    # The sharded dicts NeMo's strategy saves (its save_checkpoint's), filled by its
    # checkpoint IO's load (MegatronCheckpointIO.load_checkpoint: dist_checkpointing.load)
    wanted = {
        "state_dict": strategy.megatron_parallel.sharded_state_dict(),
        "optimizer": [strategy.optimizer_sharded_state_dict()],
    }
    # Its load then moves CUDA tensors to the current device, asserting CUDA is initialised:
    # on the CPU, none is a CUDA tensor, none is moved.
    initialised, current = torch.cuda.is_initialized, torch.cuda.current_device
    torch.cuda.is_initialized, torch.cuda.current_device = (lambda: True), (lambda: 0)
    try:
        checkpoint = strategy.checkpoint_io.load_checkpoint(folder, sharded_state_dict=wanted)
    finally:
        torch.cuda.is_initialized, torch.cuda.current_device = initialised, current
    model_sd = strategy.megatron_parallel.sharded_state_dict()
    names = {k: _layer_name(v) for k, v in model_sd.items() if isinstance(v, ShardedTensor)}
    weights = {
        names[k]: v.detach().clone() for k, v in checkpoint["state_dict"].items() if k in names
    }
    optimizer = strategy.lightning_module.optimizers(use_pl_optimizer=False)
    optimizer = getattr(optimizer, "mcore_optimizer", optimizer)
    ids = get_param_id_to_sharded_param_map(model_sd, optimizer.get_parameters())
    (optim,) = checkpoint["optimizer"]
    step = optim["state"]["common_step"]
    state = {
        _layer_name(ids[i]): {
            "exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone(), "step": step,
        }
        for i, s in optim["state"].items()
        if i != "common_step"
    }
    groups = [
        {"lr": g["lr"], "betas": tuple(g["betas"]), "eps": g["eps"],
         "params": [_layer_name(ids[i]) for i in g["params"]]}
        for g in optim["param_groups"]
    ]
    return {"weights": weights, "state": state, "groups": groups,
            "global_step": int(checkpoint["global_step"])}


def _layer_name(sharded) -> str:
    """A sharded tensor's key, a stacked layer's with its number (the prepended offset)."""
    name = sharded.key
    if re.match(r"(.*\.)?layers\.(?!\d)", name):
        name = name.replace("layers.", f"layers.{sharded.global_offset[0]}.", 1)
    return name


if __name__ == "__main__":  # Megatron's writer starts a spawned process: guarded
    main(Path(sys.argv[1]))
