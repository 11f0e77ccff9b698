"""Real DeepSpeed ZeRO checkpoints, written by DeepSpeed's own CPU training.

``python -m tests.layouts.deepspeed_runs OUT`` starts 2 processes (gloo, the
CPU accelerator) that train a tiny MLP with ZeRO stages 1, 2 and 3 in turn,
2 AdamW steps each, and save ``OUT/zeroN/`` with ``engine.save_checkpoint``
(``latest`` plus ``global_step2/``), then ZeRO 2 again with bf16 mixed
precision into ``OUT/zero2_bf16/``, then without ZeRO (stage 0) in fp32, bf16
and fp16 into ``OUT/zero0/``, ``OUT/zero0_bf16/`` and ``OUT/zero0_fp16/``
(their model also holds a buffer, ``scale``; each saves ``global_step1/`` too, a
run folder for ``trend``), then three pipeline-parallel runs (``PIPELINES``). The
model's sizes are chosen so that the flat partitions cut parameters:
``0.weight`` (35 elements) spans both ranks' partitions under ZeRO 1/2, and
every parameter is split under ZeRO 3.
Two param groups (decayed weights, undecayed biases) exercise the group
layout. The last layer (``4.weight``, ``4.bias``) is frozen
(``requires_grad=False``): ZeRO 2 and 3 save it as frozen parameters
(``frozen_param_fragments``; under ZeRO 3 cut over the ranks with padding),
ZeRO 1 in the module's state dict alone.

Beside each checkpoint, ``OUT/zeroN.reference.pt`` holds the tests'
independent reference: the same model trained alongside with plain
``torch.optim.AdamW`` on the same batches, its gradients averaged over the
ranks with ``all_reduce`` (what data parallelism computes), so its
``exp_avg``, ``exp_avg_sq`` and weights are what the ZeRO partitions must
hold, up to float32 rounding in the reduction order.

``python -m tests.layouts.deepspeed_runs OUT --cpu-adam`` builds
``OUT/zero2_cpu_adam/`` alone instead (and its reference): ZeRO 2 with the
optimizer offloaded to the host, where DeepSpeed runs its own
``DeepSpeedCPUAdam``. Its op is compiled on first use (about 4 minutes on a
2-core machine; cached in ``TORCH_EXTENSIONS_DIR`` after), so only the slow
tests (``GRADCLIP_SLOW=1``) build it.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from pathlib import Path

STAGES = (1, 2, 3)
# (folder, ZeRO stage, mixed precision ("bf16", "fp16" or None), optimizer offloaded):
# bf16 runs of ZeRO write bf16_zero_pp_rank_* files.
RUNS = tuple((f"zero{stage}", stage, None, False) for stage in STAGES) + (
    ("zero2_bf16", 2, "bf16", False),
    # Without ZeRO (stage 0): one mp_rank_00_model_states.pt holds the module and the
    # optimizer's state dict, or, under fp16/bf16 mixed precision, DeepSpeed's
    # FP16_UnfusedOptimizer state around it (fp32 master weights in fp32_groups).
    ("zero0", 0, None, False), ("zero0_bf16", 0, "bf16", False),
    ("zero0_fp16", 0, "fp16", False))
# ZeRO-Offload: the optimizer runs on the host as DeepSpeedCPUAdam, a C++ op that
# DeepSpeed JIT-compiles on first use (minutes): built only when asked (--cpu-adam).
CPU_ADAM_RUNS = (("zero2_cpu_adam", 2, None, True),)
WORLD = 2
STEPS = 2
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.8, 0.95), 1e-6, 0.1


def _worker(rank: int, port: int, out: str, runs: tuple = RUNS) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD))
    import copy

    import deepspeed
    import torch
    import torch.distributed as dist

    # DeepSpeed's CPU backend JIT-compiles a shared-memory collective (a C++
    # extension, minutes on a fresh machine) on first use; gloo alone does the job.
    # (``deepspeed.comm.torch`` as an attribute is torch itself: take the module.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's CPU accelerator declines fp16 (its sanity check), though torch computes in
    # float16 on the CPU: allowed, so that DeepSpeed's own fp16 optimizer writes the files.
    get_accelerator().is_fp16_supported = lambda: True
    for folder_name, stage, precision, offload in runs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                    torch.nn.Linear(7, 3), torch.nn.Tanh(),
                                    torch.nn.Linear(3, 3))
        model[4].requires_grad_(False)  # frozen: weights without optimizer state
        if stage == 0:
            # A buffer of a bias's shape in the module's state dict (DeepSpeed lists it in
            # buffer_names): never a parameter, nor mapped to optimizer state.
            model.register_buffer("scale", torch.arange(1.0, 4.0))
        mirror = copy.deepcopy(model)

        def groups(module):
            named = list(module.named_parameters())
            return [{"params": [p for n, p in named if n.endswith("weight")]},
                    {"params": [p for n, p in named if n.endswith("bias")],
                     "weight_decay": 0.0}]

        plain = torch.optim.AdamW(groups(mirror), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {
                "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY,
                "torch_adam": not offload}},
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, **(
                {"offload_optimizer": {"device": "cpu"}} if offload else {})},
            "bf16": {"enabled": precision == "bf16"},
            # A small initial loss scale: no overflow, so no step is skipped.
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups(model),
                                          config=config)
        # Without ZeRO in fp32 the engine steps the optimizer itself; else it wraps it.
        wrapped = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
        assert wrapped == ("DeepSpeedCPUAdam" if offload else "AdamW"), wrapped
        g = torch.Generator().manual_seed(10 * stage + rank)
        for _ in range(STEPS):
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
            engine.backward(torch.nn.functional.mse_loss(engine(x.to(low)), y.to(low)))
            engine.step()
            plain.zero_grad()
            torch.nn.functional.mse_loss(mirror(x), y).backward()
            for p in mirror.parameters():
                if p.grad is None:  # frozen
                    continue
                dist.all_reduce(p.grad)
                p.grad /= WORLD
            plain.step()
            if stage == 0 and engine.global_steps < STEPS:  # a run folder of two steps
                engine.save_checkpoint(os.path.join(out, folder_name))
        assert engine.skipped_steps == 0, folder_name  # fp16: no overflow
        engine.save_checkpoint(os.path.join(out, folder_name))
        reference = {
            name: {"weight": p.detach().clone(), **{
                k: v.clone() for k, v in plain.state[p].items()}}
            for name, p in mirror.named_parameters()
        }
        if rank == 0 and precision is None:  # the fp32 mirror is no reference for bf16/fp16
            torch.save(reference, os.path.join(out, f"{folder_name}.reference.pt"))
        engine.destroy()
    if runs == RUNS:
        _pipelines(out)


# Pipeline parallelism (deepspeed.pipe.PipelineModule): (folder, stages, ZeRO stage).
PIPELINES = (("pipe2_zero1", 2, 1), ("pipe1_zero0", 1, 0), ("pipe2_zero0", 2, 0))


def _pipelines(out: str) -> None:
    """``layer_XX-model_states.pt`` beside the rank files: 2 stages under ZeRO 1 (one
    ``mp_rank_XX`` per stage, ``OUT/pipe2_zero1.reference.pt`` beside: the same layers
    trained with plain AdamW on the same batches), and 1 stage (2 data-parallel ranks)
    and 2 stages without ZeRO (weights in the layer files alone). Beside those,
    ``OUT/pipeN_zero0.reference.pt`` is the engine's own state after the last step,
    gathered from the stages: each parameter under the module's name (``2.weight``), its
    value and ``engine.optimizer.state`` (the torch AdamW DeepSpeed steps without ZeRO)."""
    import copy

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    for folder_name, stages, stage in PIPELINES:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)]
        mirror = torch.nn.Sequential(*copy.deepcopy(layers))
        plain = torch.optim.AdamW(mirror.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY)
        net = PipelineModule(layers=layers, num_stages=stages, loss_fn=torch.nn.MSELoss(),
                             partition_method="uniform")
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {
                      "lr": LR, "betas": list(BETAS), "eps": EPS,
                      "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
                  "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": stage}}
        engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                          config=config)
        g = torch.Generator().manual_seed(7)
        batches = [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g))
                   for _ in range(STEPS)]
        data = iter(batches)
        for x, y in batches:
            engine.train_batch(data_iter=data)
            plain.zero_grad()
            torch.nn.functional.mse_loss(mirror(x), y).backward()
            plain.step()
        engine.save_checkpoint(os.path.join(out, folder_name))
        if stage > 0:
            reference = {name: {"weight": p.detach().clone(), **{
                k: v.clone() for k, v in plain.state[p].items()}}
                for name, p in mirror.named_parameters()}
        else:
            assert type(engine.optimizer).__name__ == "AdamW", type(engine.optimizer)
            own = {name: {"weight": p.detach().clone(), **{
                k: v.clone() for k, v in engine.optimizer.state[p].items()}}
                for name, p in engine.module.named_parameters()}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, own)
            reference = {}
            for held in gathered:  # each stage's parameters in order (data-parallel copies)
                reference.update(held)
        if dist.get_rank() == 0:
            torch.save(reference, os.path.join(out, f"{folder_name}.reference.pt"))
        engine.destroy()


def spawn(worker, out: Path, *args, nprocs: int = WORLD) -> None:
    """``worker(rank, port, out, *args)`` in ``nprocs`` spawned processes, ``port`` a free one
    for their process group (the DeepSpeed run scripts of this folder share it)."""
    from tests import gloo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gloo.spawn(worker, port, os.fspath(out), *args, nprocs=nprocs)


def build(out: Path, runs: tuple = RUNS) -> None:
    spawn(_worker, out, runs)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    build(Path(sys.argv[1]), CPU_ADAM_RUNS if "--cpu-adam" in sys.argv[2:] else RUNS)
