"""A real, short Hugging Face ``Trainer`` run with a gradient spike injected at one step.

A tiny GPT-2 (built from a config in code: nothing is downloaded) trains on
random tokens on the CPU with ``logging_steps=1``, so ``trainer_state.json``
logs ``grad_norm`` at every step. At ``SPIKE_STEP`` the loss is scaled by
``SPIKE_SCALE``, which scales that step's gradients (and their logged
pre-clipping norm) by the same factor; ``max_grad_norm`` keeps the update
itself sane.
"""

from __future__ import annotations

from pathlib import Path

STEPS = 40
SPIKE_STEP = 30  # as the Trainer logs it: global_step after the optimizer step
SPIKE_SCALE = 1000.0


def train_with_spike(output_dir: Path) -> Path:
    """Run the Trainer into ``output_dir``; return its ``trainer_state.json``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (STEPS * 4, 16), generator=generator)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]

    class SpikeTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            # global_step counts finished optimizer steps; this step logs as +1.
            if self.state.global_step + 1 == SPIKE_STEP:
                loss = loss * SPIKE_SCALE
            return loss

    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, data_seed=0, max_grad_norm=1.0, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = SpikeTrainer(model=model, args=args, train_dataset=dataset)
    # One thread: on a shared 2-core machine, intra-op threads over such tiny
    # matrices made the run 15x slower (80 s instead of 6 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
    trainer.save_state()
    return output_dir / "trainer_state.json"
