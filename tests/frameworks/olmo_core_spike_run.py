"""A real OLMo-core run with a spike injected into one known layer at a known step.

Run in the frameworks venv (ai2-olmo-core 3.0.0, see ``.ci/run``)::

    torchrun --nproc-per-node 1 tests/frameworks/olmo_core_spike_run.py OUT SEED [LAYER FACTOR] \
        [--batch N]

OLMo-core's tiny ``olmo2_1M`` transformer (2 layers) in its
``TransformerTrainModule`` (AdamW) trains ``STEPS`` steps on 1 rank, each step
on ``--batch`` sequences (default ``BATCH``) of ``SEQUENCE`` random tokens. The
steps are numbered as OLMo-core's trainer numbers them (``global_step``, from
1: the step's gradient is the one the optimizer takes at that step), and
gradclip's ``GradMonitor`` (this repository, put on ``sys.path``: the
frameworks venv does not install gradclip) watches the model between
``backward`` and the optimizer's step, writing ``OUT/run/grads.jsonl`` and
dumps of the gradients at a spike under ``OUT/run/spikes/``.

With ``LAYER FACTOR``, at ``SPIKE_STEP`` the gradients of every parameter
under ``LAYER`` (a module name, e.g. ``blocks.1``) are multiplied by
``FACTOR`` after ``backward``, before the monitor and the optimizer see them.

After each step in ``saved_at()`` (every ``EVERY`` steps, and the steps
before, at and after the spike) OLMo-core's ``Checkpointer.save`` writes
``OUT/run/stepN/`` (``.metadata.json``, ``train/rank0.pt``,
``model_and_optim/`` in DCP through OLMo-core's own storage writer), as in
``olmo_core_run.py``.

``OUT/reference/spike.pt`` holds the tests' reference, computed here in float64
from the live model and optimizer (never through gradclip): per group of the
monitor's default grouping (``GROUPS``), the gradient norm the optimizer saw at
``SPIKE_STEP`` (after the injection), and the norm of the bias-corrected
``exp_avg`` after steps ``SPIKE_STEP - 1`` and ``SPIKE_STEP``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQUENCE, BATCH = 64, 16, 8
STEPS, SPIKE_STEP, EVERY = 50, 35, 5  # the spike past the monitor's warm-up (25 steps)
GROUPS = ("embeddings", "blocks.0", "blocks.1", "lm_head.norm", "lm_head.w_out")


def group_norms(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """The float64 2-norm of each group's tensors (``name -> tensor``)."""
    sums = dict.fromkeys(GROUPS, 0.0)
    for name, t in tensors.items():
        group = next(g for g in GROUPS if name.startswith(g + "."))
        sums[group] += float(t.detach().double().pow(2).sum())
    return {g: s**0.5 for g, s in sums.items()}


def exp_avg_hat(model, optim) -> dict[str, torch.Tensor]:
    """Each parameter's bias-corrected first moment, ``exp_avg / (1 - beta1**step)``."""
    out = {}
    for group in optim.param_groups:
        beta1 = group["betas"][0]
        for p in group["params"]:
            state = optim.state[p]
            out[p] = state["exp_avg"].double() / (1 - beta1 ** float(state["step"]))
    return {name: out[p] for name, p in model.named_parameters()}


def saved_at() -> set[int]:
    return set(range(EVERY, STEPS + 1, EVERY)) | {SPIKE_STEP - 1, SPIKE_STEP, SPIKE_STEP + 1}


def main(
    out: Path, seed: int, inject: tuple[str, float] | None, batch: int = BATCH
) -> None:
    sys.path.insert(0, str(REPO))
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.train_module import TransformerTrainModule
    from olmo_core.train.trainer import Trainer

    from gradclip_cli import GradMonitor

    torch.manual_seed(seed)
    model = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2).build(init_device="cpu")
    module = TransformerTrainModule(
        model,
        optim=AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
        rank_microbatch_size=batch * SEQUENCE,
        max_sequence_length=SEQUENCE,
        device=torch.device("cpu"),
    )
    run = out / "run"
    checkpointer = Checkpointer(work_dir=out / "work")
    trainer = SimpleNamespace(
        global_step=0,
        global_train_tokens_seen=0,
        global_train_petaflops=0.0,
        max_steps=STEPS,
        epoch=1,
        callbacks={},
        data_loader=SimpleNamespace(
            state_dict=lambda: {"dataset_type": "fsl", "batches_processed": trainer.global_step}
        ),
    )
    g = torch.Generator().manual_seed(1000 + seed)
    saved = saved_at()
    reference: dict = {"exp_avg": {}}
    with GradMonitor(module.model, run / "grads.jsonl", run / "spikes") as monitor:
        for step in range(1, STEPS + 1):
            trainer.global_step = step
            tokens = torch.randint(0, VOCAB, (batch, SEQUENCE + 1), generator=g)
            logits = module.model(tokens[:, :-1])
            logits = getattr(logits, "logits", logits)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
            )
            loss.backward()
            if inject is not None and step == SPIKE_STEP:
                layer, factor = inject
                for name, p in module.model.named_parameters():
                    if p.grad is not None and name.startswith(layer + "."):
                        p.grad.mul_(factor)
            if step == SPIKE_STEP:
                reference["grads"] = group_norms(
                    {n: p.grad for n, p in module.model.named_parameters()}
                )
            monitor.step(step)
            module.optim.step()
            module.optim.zero_grad(set_to_none=True)
            trainer.global_train_tokens_seen += tokens.numel()
            if step in (SPIKE_STEP - 1, SPIKE_STEP):
                moments = exp_avg_hat(module.model, module.optim)
                reference["exp_avg"][step] = group_norms(moments)
            if step in saved:
                checkpointer.save(run / f"step{step}", module, Trainer.state_dict(trainer))
    (out / "reference").mkdir(parents=True, exist_ok=True)
    torch.save(reference, out / "reference" / "spike.pt")
    dist.barrier()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("seed", type=int)
    parser.add_argument("spike", nargs="*", metavar="LAYER FACTOR")
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per step")
    args = parser.parse_args()
    if len(args.spike) not in (0, 2) or args.batch < 1:
        parser.error("give LAYER and FACTOR together, and a --batch of 1 or more")
    injection = (args.spike[0], float(args.spike[1])) if args.spike else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        main(args.out, args.seed, injection, args.batch)
    finally:
        dist.destroy_process_group()
