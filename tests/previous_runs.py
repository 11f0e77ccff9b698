"""Real torch.optim loops that save checkpoints one optimizer step apart, for ``--previous``.

Each run trains a small model with a real optimizer, saves ``{"model",
"optimizer"}`` with ``torch.save`` after every step from ``first_saved`` on
(``step-N.pt``, N the optimizer step just taken; ``step-0.pt`` is the model
before any step), and saves the gradients every step used with
``gradclip_cli.save_grads`` just before ``optimizer.step()`` (``grads-N.pt``):
what the optimizer saw, the reference the reconstruction is compared with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gradclip_cli import save_grads


class Net(torch.nn.Module):
    """Two layers; float32 unless a dtype is given."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, hidden: int = 16):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(12, hidden)
        self.b = torch.nn.Linear(hidden, 5)
        self.to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@dataclass(frozen=True)
class Run:
    folder: Path
    steps: int

    def checkpoint(self, step: int) -> Path:
        return self.folder / f"step-{step}.pt"

    def grads(self, step: int) -> dict[str, torch.Tensor]:
        return torch.load(self.folder / f"grads-{step}.pt", weights_only=True)["grads"]


def train(folder: Path, make: Callable[[torch.nn.Module], torch.optim.Optimizer], *,
          steps: int = 5, dtype: torch.dtype = torch.float32, seed: int = 0,
          first_saved: int = 0, before_step: Callable | None = None,
          save: Callable[[torch.nn.Module, torch.optim.Optimizer], dict] | None = None) -> Run:
    """Train ``steps`` optimizer steps; ``before_step(step, optimizer)`` may change a setting
    before step ``step``; ``save`` overrides what a checkpoint holds."""
    folder.mkdir(parents=True, exist_ok=True)
    model = Net(seed, dtype)
    opt = make(model)
    contents = save or (lambda m, o: {"model": m.state_dict(), "optimizer": o.state_dict()})
    generator = torch.Generator().manual_seed(seed + 100)
    if first_saved == 0:
        torch.save(contents(model, opt), folder / "step-0.pt")
    for step in range(1, steps + 1):
        opt.zero_grad()
        x = torch.randn(32, 12, generator=generator).to(dtype)
        # A loss whose gradients differ in scale from layer to layer and step to step.
        loss = model(x).square().mean() * (1 + step % 3)
        loss.backward()
        save_grads(model, folder / f"grads-{step}.pt")
        if before_step is not None:
            before_step(step, opt)
        opt.step()
        if step >= first_saved:
            torch.save(contents(model, opt), folder / f"step-{step}.pt")
    return Run(folder, steps)


def float64_norm(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.double()).item()


# ----------------------------------------------------------------- framework runs

TRAINER_STEPS = 3
TRAINER_MAX_GRAD_NORM = 0.5  # below the run's norms (0.85-0.95): every step is clipped


def train_trainer_pair(output_dir: Path) -> Path:
    """A real Hugging Face ``Trainer`` run (tiny GPT-2 from a config, CPU) that saves
    ``checkpoint-1/`` .. ``checkpoint-3/`` (``save_steps=1``) with clipping on
    (``max_grad_norm=0.5``), its default AdamW with weight decay and its linear
    learning-rate decay, and the gradients each optimizer step used as ``grads-N.pt``:
    saved by a callback's ``on_pre_optimizer_step``, which the Trainer calls after
    clipping, just before ``optimizer.step()``. Its
    ``trainer_state.json`` logs each step's norm before clipping (``grad_norm``)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from tests.trainer_runs import _train_on_one_thread

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (TRAINER_STEPS * 4, 16), generator=generator)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]

    class SaveClippedGrads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            save_grads(kwargs["model"], output_dir / f"grads-{state.global_step + 1}.pt")

    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=TRAINER_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, weight_decay=0.01, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, data_seed=0, max_grad_norm=TRAINER_MAX_GRAD_NORM, disable_tqdm=True,
        dataloader_num_workers=0, save_strategy="steps", save_steps=1,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[SaveClippedGrads()])
    _train_on_one_thread(trainer)
    trainer.save_state()
    return output_dir


LIGHTNING_STEPS = 3


def train_lightning_pair(output_dir: Path) -> Path:
    """A real Lightning run (CPU, Adam with L2 weight decay, no clipping) whose
    ``ModelCheckpoint`` saves a ``.ckpt`` after every optimizer step
    (``step=N.ckpt``), and the gradients each step used as ``grads-N.pt``, saved
    in ``on_before_optimizer_step``."""
    import lightning as L

    output_dir.mkdir(parents=True, exist_ok=True)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(0)

        def training_step(self, batch, _):
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2, weight_decay=0.1)

        def on_before_optimizer_step(self, optimizer):
            save_grads(self, output_dir / f"grads-{self.trainer.global_step + 1}.pt")

    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(LIGHTNING_STEPS * 8, 12,
                                                   generator=torch.Generator().manual_seed(0))),
        batch_size=8)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=output_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(max_steps=LIGHTNING_STEPS, accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[checkpoint], default_root_dir=output_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.fit(Module(), data)
    finally:
        torch.set_num_threads(threads)
    return output_dir
