"""A real OLMo-core run on the CPU: its checkpoints, and what OLMo-core's own loader reads back.

Run in the frameworks venv (ai2-olmo-core 3.0.0, see ``.ci/run``)::

    torchrun --nproc-per-node N tests/frameworks/olmo_core_run.py OUT

OLMo-core's tiny ``olmo2_1M`` transformer (2 layers) in its
``TransformerTrainModule`` (AdamW; with 2 ranks, FSDP over gloo) trains 3
steps; after each, the trainer's ``Checkpointer.save`` writes
``OUT/run/stepN/``: ``.metadata.json``, ``train/rankR.pt`` (the trainer's
state: ``global_step``, numpy and torch RNG states, ...) and
``model_and_optim/`` (DCP, through OLMo-core's own storage writer).

The trainer's state is ``Trainer.state_dict`` run on an object holding the
fields it reads; its data loader (not built here: it needs a dataset on
disk) contributes a small dict of its own. Then OLMo-core's
``unshard_checkpoint`` turns each step's ``model_and_optim/`` into
``OUT/reference/stepN/{model,optim}.pt``: the tests' reference.

At step ``DUMP_STEP``, between ``backward`` and the optimizer's step, OLMo-core's
``GradientDumperCallback`` dumps the gradients, once in each of its modes:
``OUT/dump_full/gradient_dumper/stepN/full_gradients/`` (a DCP folder, through
OLMo-core's ``save_state_dict``) and ``OUT/dump_sampled/gradient_dumper/stepN/
sampled_gradients/<name>_first<n>.safetensors`` (the first ``SAMPLED`` rows of each
full gradient, from rank 0). No release ships the callback yet (ai2-olmo-core 3.0.0
is the newest): where ``OLMO_CORE_GRADIENT_DUMPER`` names its source file, taken from
OLMo-core's repository, the callback itself runs; else the two writers it calls,
OLMo-core's ``save_state_dict`` and safetensors' ``save_file``, write the same tree
(the same files and tensors: compared with the callback's on the day it was added).
``OUT/reference/grads_stepN.pt`` holds the full gradients (``get_full_tensor``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

VOCAB, SEQUENCE, STEPS = 64, 8, 3
DUMP_STEP, SAMPLED = 2, 3


def main(out: Path) -> None:
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.train_module import (
        TransformerDataParallelConfig,
        TransformerTrainModule,
    )
    from olmo_core.train.trainer import Trainer

    torch.manual_seed(0)
    model = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2).build(init_device="cpu")
    dp = None
    if dist.get_world_size() > 1:
        dp = TransformerDataParallelConfig(name=DataParallelType.fsdp)
    module = TransformerTrainModule(
        model,
        optim=AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
        rank_microbatch_size=2 * SEQUENCE,
        max_sequence_length=SEQUENCE,
        device=torch.device("cpu"),
        dp_config=dp,
    )
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
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (2, SEQUENCE + 1), generator=g)
        logits = module.model(tokens[:, :-1])
        logits = getattr(logits, "logits", logits)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        if step == DUMP_STEP:
            trainer.global_step = step
            dump_gradients(out, module.model, trainer)
        module.optim.step()
        module.optim.zero_grad(set_to_none=True)
        trainer.global_step = step
        trainer.global_train_tokens_seen += tokens.numel() * dist.get_world_size()
        checkpointer.save(out / "run" / f"step{step}", module, Trainer.state_dict(trainer))
    dist.barrier()


def dump_gradients(out: Path, model, trainer) -> None:
    """The gradient dumper's two modes at ``trainer.global_step``, and the reference."""
    import os

    from olmo_core.distributed.utils import get_full_tensor

    source = os.environ.get("OLMO_CORE_GRADIENT_DUMPER")
    for mode, first_n in (("full", None), ("sampled", SAMPLED)):
        work = out / f"dump_{mode}"
        if source:
            _run_callback(source, work, model, trainer, first_n)
        else:
            _write_as_the_callback(work, model, trainer.global_step, first_n)
    full = {n: get_full_tensor(p.grad.detach()) for n, p in model.named_parameters()
            if p.grad is not None}
    if dist.get_rank() == 0:
        (out / "reference").mkdir(parents=True, exist_ok=True)
        torch.save(full, out / "reference" / f"grads_step{trainer.global_step}.pt")


def _run_callback(source: str, work: Path, model, trainer, first_n) -> None:
    """OLMo-core's ``GradientDumperCallback`` from its source file, on this trainer."""
    import importlib.util

    name = "olmo_core.train.callbacks.gradient_dumper"
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    callback = module.GradientDumperCallback(save_first_n=first_n)
    callback.trainer = SimpleNamespace(
        work_dir=work, global_step=trainer.global_step,
        train_module=SimpleNamespace(model=model),
        persist_working_subdir=lambda rel: work / rel,
    )
    callback.pre_optim_step()


def _write_as_the_callback(work: Path, model, step: int, first_n) -> None:
    """What the callback writes, through the same two writers it calls."""
    from olmo_core.distributed.checkpoint import save_state_dict
    from olmo_core.distributed.utils import get_full_tensor
    from safetensors.torch import save_file

    step_dir = work / "gradient_dumper" / f"step{step}"
    step_dir.mkdir(parents=True, exist_ok=True)
    if first_n is None:
        grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
        save_state_dict(step_dir / "full_gradients", grads, save_overwrite=True)
        return
    sampled = step_dir / "sampled_gradients"
    if dist.get_rank() == 0:
        sampled.mkdir(parents=True, exist_ok=True)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        full = get_full_tensor(p.grad.detach())
        if dist.get_rank() == 0:
            n = min(first_n, full.shape[0])
            save_file({"gradient": full.cpu().narrow(0, 0, n)},
                      str(sampled / f"{name}_first{n}.safetensors"))


def reference(out: Path) -> None:
    """OLMo-core's own unsharding of each step (outside the process group, as it requires)."""
    from olmo_core.distributed.checkpoint import unshard_checkpoint

    for step in range(1, STEPS + 1):
        unshard_checkpoint(
            out / "run" / f"step{step}" / "model_and_optim",
            out / "reference" / f"step{step}",
            optim=True,
            quiet=True,
        )


if __name__ == "__main__":
    target = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        main(target)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        reference(target)
