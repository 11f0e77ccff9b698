"""A real, short Hugging Face ``Trainer`` run with a gradient spike injected at one step.

A tiny GPT-2 (built from a config in code: nothing is downloaded) trains on
random tokens on the CPU with ``logging_steps=1``, so ``trainer_state.json``
logs ``grad_norm`` at every step. At ``SPIKE_STEP`` the loss is scaled by
``SPIKE_SCALE``, which scales that step's gradients (and their logged
pre-clipping norm) by the same factor; ``max_grad_norm`` keeps the update
itself sane.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STEPS = 40
SPIKE_STEP = 30  # as the Trainer logs it: global_step after the optimizer step
SPIKE_SCALE = 1000.0

# The checkpointed run: a checkpoint-N/ folder at every step, no clipping.
CHECKPOINTED_STEPS = 12
CHECKPOINTED_SPIKE_STEP = 10


@dataclass(frozen=True)
class CheckpointedRun:
    """``output_dir`` holds ``checkpoint-1/`` .. ``checkpoint-N/``; ``group_names[g]``
    are the names of the optimizer's param group ``g``'s parameters, in its order
    (taken from the live model, to map ``optimizer.pt``'s ids to names)."""

    output_dir: Path
    steps: int
    spike_step: int
    group_names: list[list[str]]


def train_with_spike(output_dir: Path, report_to: tuple[str, ...] = ()) -> Path:
    """Run the Trainer into ``output_dir``; return its ``trainer_state.json``.
    ``report_to``: the Trainer's own integrations (``("tensorboard",)`` writes
    ``output_dir/runs/``)."""
    state, _ = _train(output_dir, steps=STEPS, spike_step=SPIKE_STEP, save=False,
                      max_grad_norm=1.0, report_to=report_to)
    return state


# The overflowing run: at its last step the loss is scaled so far that every gradient
# stays finite (float32 reaches 3.4e38) while the squares torch's float32 norm sums
# do not: the Trainer logs grad_norm inf for finite gradients.
OVERFLOW_STEPS = 8
OVERFLOW_SCALE = 1e25


def train_overflowing(output_dir: Path, report_to: tuple[str, ...] = ()) -> dict[int, float]:
    """Run the Trainer into ``output_dir`` with its last step's gradients finite but too
    large for torch's float32 norm; return each step's float64 gradient norm (as gradclip
    measures it: finite at the last step too), taken before the Trainer clips."""
    norms: dict[int, float] = {}

    def measure(step, model):
        norms[step] = _float64_norms(model)["total"]

    _train(output_dir, steps=OVERFLOW_STEPS, spike_step=OVERFLOW_STEPS, save=False,
           max_grad_norm=1.0, report_to=report_to, spike_scale=OVERFLOW_SCALE,
           after_backward=measure)
    return norms


OVERFLOW_AUDIT_STEPS = 10
OVERFLOW_AUDIT_STEP = 7


def train_callback_overflowing(output_dir: Path) -> dict[int, float]:
    """gradclip's Trainer callback clipping (``max_norm=1``, the Trainer's off) and logging
    ``output_dir/grads.jsonl``, while the Trainer logs its own ``grad_norm`` (torch's
    float32 norm); at ``OVERFLOW_AUDIT_STEP`` the gradients are finite but their squares
    overflow float32, so the Trainer logs inf. Returns each step's float64 gradient norm,
    taken before either measured it."""
    from gradclip_cli.integrations.transformers import GradMonitorCallback

    norms: dict[int, float] = {}

    def measure(step, model):
        norms[step] = _float64_norms(model)["total"]

    monitor = GradMonitorCallback(output_dir / "grads.jsonl", dump_dir=None, max_norm=1.0)
    _train(output_dir, steps=OVERFLOW_AUDIT_STEPS, spike_step=OVERFLOW_AUDIT_STEP, save=False,
           max_grad_norm=0.0, spike_scale=OVERFLOW_SCALE, after_backward=measure,
           callbacks=(monitor,))
    return norms


EVALUATED_STEPS = 20
EVALUATED_SPIKE_STEP = 15
EVAL_STEPS = 5


def train_evaluated(output_dir: Path, report_to: tuple[str, ...]) -> Path:
    """A 20-step run that also evaluates every ``EVAL_STEPS`` steps (each evaluation is a
    log call of its own), spike at ``EVALUATED_SPIKE_STEP``; returns its
    ``trainer_state.json``."""
    state, _ = _train(output_dir, steps=EVALUATED_STEPS, spike_step=EVALUATED_SPIKE_STEP,
                      save=False, max_grad_norm=1.0, report_to=report_to,
                      eval_steps=EVAL_STEPS)
    return state


def train_resumed_with_spike(output_dir: Path, resumed_at: int) -> CheckpointedRun:
    """The checkpointed run (every step saved, no clipping), stopped after ``resumed_at``
    steps and resumed by a new ``Trainer`` from ``checkpoint-<resumed_at>``
    (``train(resume_from_checkpoint=...)``), logging to TensorBoard (``runs/``: the
    resumed run's event file from step ``resumed_at + 1``)."""
    _, groups = _train(output_dir, steps=CHECKPOINTED_STEPS, spike_step=CHECKPOINTED_SPIKE_STEP,
                       save=True, max_grad_norm=0.0, report_to=("tensorboard",),
                       resumed_at=resumed_at)
    return CheckpointedRun(output_dir, CHECKPOINTED_STEPS, CHECKPOINTED_SPIKE_STEP, groups)


def train_checkpointed_with_spike(output_dir: Path) -> CheckpointedRun:
    """A shorter run that saves a Trainer checkpoint every step, spike at
    ``CHECKPOINTED_SPIKE_STEP``.

    Gradient clipping is off (``max_grad_norm=0``) so that the spike reaches
    Adam: its moments jump at that step, ``exp_avg`` by ``(1 - beta1) * g``
    (a 100-fold jump for a 1000-fold gradient) and ``exp_avg_sq`` by
    ``(1 - beta2) * g**2``, then decay over the following steps. The learning
    rate is constant so that ``update`` moves only with the moments.
    """
    _, groups = _train(output_dir, steps=CHECKPOINTED_STEPS, spike_step=CHECKPOINTED_SPIKE_STEP,
                       save=True, max_grad_norm=0.0)
    return CheckpointedRun(output_dir, CHECKPOINTED_STEPS, CHECKPOINTED_SPIKE_STEP, groups)


def _train(output_dir: Path, *, steps: int, spike_step: int, save: bool,
           max_grad_norm: float, report_to: tuple[str, ...] = (),
           spike_scale: float = SPIKE_SCALE, after_backward=None,
           eval_steps: int | None = None, callbacks: tuple = (),
           resumed_at: int | None = None) -> tuple[Path, list[list[str]]]:
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (steps * 4, 16), generator=generator)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]

    class SpikeTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            # global_step counts finished optimizer steps; this step logs as +1.
            if model.training and self.state.global_step + 1 == spike_step:
                loss = loss * spike_scale
            return loss

        def training_step(self, model, inputs, *args, **kwargs):
            loss = super().training_step(model, inputs, *args, **kwargs)
            if after_backward is not None:  # the gradients as backward left them
                after_backward(self.state.global_step + 1, model)
            return loss

    saving = {"save_strategy": "steps", "save_steps": 1, "lr_scheduler_type": "constant"} \
        if save else {"save_strategy": "no"}
    if eval_steps is not None:
        saving.update(eval_strategy="steps", eval_steps=eval_steps, per_device_eval_batch_size=4)
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=list(report_to), use_cpu=True, seed=0,
        data_seed=0, max_grad_norm=max_grad_norm, disable_tqdm=True,
        dataloader_num_workers=0, **saving,
    )  # fmt: skip
    trainer = SpikeTrainer(model=model, args=args, train_dataset=dataset,
                           eval_dataset=dataset[:8] if eval_steps is not None else None,
                           callbacks=list(callbacks))
    if resumed_at is not None:  # stopped there, then resumed by a Trainer of its own
        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                control.should_training_stop = state.global_step >= resumed_at

        trainer.add_callback(Stop())
        _train_on_one_thread(trainer)
        trainer = SpikeTrainer(model=model, args=args, train_dataset=dataset,
                               callbacks=list(callbacks))
    _train_on_one_thread(trainer, resume=None if resumed_at is None else
                         str(output_dir / f"checkpoint-{resumed_at}"))
    trainer.save_state()
    name_of = {id(p): n for n, p in model.named_parameters()}
    groups = [[name_of[id(p)] for p in g["params"]] for g in trainer.optimizer.param_groups]
    return output_dir / "trainer_state.json", groups


# The run a newcomer brings to `gradclip trend output_dir`: a checkpoint every
# few steps, the Trainer's default clipping, a monitor log beside them, and one
# layer's gradients blown up at one step.
RUN_FOLDER_STEPS = 20
RUN_FOLDER_SAVE_STEPS = 5
RUN_FOLDER_SPIKE_STEP = 12
RUN_FOLDER_SPIKE_LAYER = "transformer.h.1"
RUN_FOLDER_SPIKE_SCALE = 1000.0
RUN_FOLDER_LOG = "grads.jsonl"


@dataclass(frozen=True)
class RunFolder:
    """``output_dir`` holds ``checkpoint-5/`` .. ``checkpoint-20/`` (each with its
    ``trainer_state.json`` and ``training_args.bin``), the run's final
    ``trainer_state.json`` and ``grads.jsonl``, the log of a ``GradMonitor``."""

    output_dir: Path
    steps: int
    save_steps: int
    spike_step: int
    spike_layer: str
    max_grad_norm: float
    # float64 norms of every step's gradients as the monitor saw them (before
    # the Trainer clips): {step: {"total": ..., layer: ...}}, layers named as
    # --group-by layer names them (transformer.h.1, transformer.wte, ...).
    reference: dict[int, dict[str, float]]


def train_run_folder(output_dir: Path) -> RunFolder:
    """A 20-step run with ``TrainingArguments``' default ``max_grad_norm`` (1.0).

    The spike is one layer's: a gradient hook multiplies ``transformer.h.1``'s
    gradients by ``RUN_FOLDER_SPIKE_SCALE`` in the backward pass of step 12, so
    the Trainer's logged (pre-clipping) ``grad_norm`` and the monitor both see
    it; the optimizer, after the Trainer clips to 1.0, does not. The monitor is
    called at the end of ``training_step`` (after backward, before the
    Trainer's clipping), the place ``GradMonitor.step`` asks for.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (RUN_FOLDER_STEPS * 4, 16), generator=generator)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    monitor = GradMonitor(model, output_dir / RUN_FOLDER_LOG, dump_dir=None)
    reference: dict[int, dict[str, float]] = {}

    class MonitoredTrainer(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            loss = super().training_step(model, inputs, *args, **kwargs)
            step = self.state.global_step + 1  # the step log_history gives it
            monitor.step(step)
            reference[step] = _float64_norms(model)
            return loss

    trainer = None

    def blow_up(grad):
        if trainer.state.global_step + 1 == RUN_FOLDER_SPIKE_STEP:
            return grad * RUN_FOLDER_SPIKE_SCALE
        return grad

    for name, parameter in model.named_parameters():
        if name.startswith(RUN_FOLDER_SPIKE_LAYER + "."):
            parameter.register_hook(blow_up)
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=RUN_FOLDER_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0, save_strategy="steps",
        save_steps=RUN_FOLDER_SAVE_STEPS,
    )  # fmt: skip
    trainer = MonitoredTrainer(model=model, args=args, train_dataset=dataset)
    try:
        _train_on_one_thread(trainer)
    finally:
        monitor.close()
    trainer.save_state()
    return RunFolder(output_dir, RUN_FOLDER_STEPS, RUN_FOLDER_SAVE_STEPS, RUN_FOLDER_SPIKE_STEP,
                     RUN_FOLDER_SPIKE_LAYER, args.max_grad_norm, reference)


def _train_on_one_thread(trainer, resume: str | None = None) -> None:
    import torch

    # One thread: on a shared 2-core machine, intra-op threads over such tiny
    # matrices made the run 15x slower (80 s instead of 6 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        torch.set_num_threads(threads)


def _float64_norms(model) -> dict[str, float]:
    """The total and per-layer 2-norms of the model's gradients, in float64."""
    squares: dict[str, float] = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        parts = name.split(".")
        layer = ".".join(parts[:3] if parts[1] == "h" else parts[:2])
        squares[layer] = squares.get(layer, 0.0) + float(parameter.grad.double().square().sum())
    norms = {layer: total ** 0.5 for layer, total in squares.items()}
    norms["total"] = sum(squares.values()) ** 0.5
    return norms


# The run of issue 41: the Trainer's clipping off (max_grad_norm=0) and
# gradclip's callback clipping instead (GradMonitorCallback(max_norm=1.0)),
# a checkpoint every CALLBACK_CLIP_SAVE_STEPS steps, and a spike (loss x1000)
# at a step inside the monitor's warm-up (25), so it is flagged but not dumped.
CALLBACK_CLIP_STEPS = 30
CALLBACK_CLIP_SAVE_STEPS = 15
CALLBACK_CLIP_SPIKE_STEP = 22
CALLBACK_CLIP_MAX_NORM = 1.0


@dataclass(frozen=True)
class CallbackClipRun:
    """``output_dir`` holds ``checkpoint-15/``, ``checkpoint-30/``, ``grads.jsonl`` (the
    callback's log) and ``spikes/``; ``before``/``after``: per step, the float64 total
    norm of the gradients just before and just after the callback."""

    output_dir: Path
    before: dict[int, float]
    after: dict[int, float]


def train_with_callback_clipping(output_dir: Path) -> CallbackClipRun:
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from gradclip_cli.integrations.transformers import GradMonitorCallback

    class Totals(TrainerCallback):
        def __init__(self):
            self.seen: dict[int, float] = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.seen[state.global_step + 1] = _float64_norms(model)["total"]

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (CALLBACK_CLIP_STEPS * 4, 16), generator=generator)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]

    class SpikeTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if self.state.global_step + 1 == CALLBACK_CLIP_SPIKE_STEP:
                loss = loss * SPIKE_SCALE
            return loss

    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=CALLBACK_CLIP_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        data_seed=0, max_grad_norm=0.0, disable_tqdm=True, dataloader_num_workers=0,
        save_strategy="steps", save_steps=CALLBACK_CLIP_SAVE_STEPS,
    )  # fmt: skip
    # Two classes: the Trainer keeps one callback of each class.
    before, after = type("Before", (Totals,), {})(), type("After", (Totals,), {})()
    monitor = GradMonitorCallback(output_dir / "grads.jsonl", output_dir / "spikes",
                                  max_norm=CALLBACK_CLIP_MAX_NORM)
    trainer = SpikeTrainer(model=model, args=args, train_dataset=dataset,
                           callbacks=[before, monitor, after])
    _train_on_one_thread(trainer)
    trainer.save_state()
    return CallbackClipRun(output_dir, before.seen, after.seen)


# The run of gradclip's own Trainer callback: its norms in the Trainer's logs,
# sent to TensorBoard by report_to and kept in trainer_state.json, on the
# logging steps (every CALLBACK_LOGGING_STEPS), a spike at one of them.
CALLBACK_STEPS = 24
CALLBACK_LOGGING_STEPS = 2
CALLBACK_SPIKE_STEP = 20
CALLBACK_LOG = "grads.jsonl"


def train_with_callback(output_dir: Path) -> Path:
    """GradMonitorCallback (clipping to 1.0 itself) in a run that reports to TensorBoard;
    return its ``trainer_state.json``. The event file is under ``output_dir/runs/``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradclip_cli.integrations.transformers import GradMonitorCallback

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (CALLBACK_STEPS * 4, 16), generator=generator)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]

    class SpikeTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if self.state.global_step + 1 == CALLBACK_SPIKE_STEP:
                loss = loss * SPIKE_SCALE
            return loss

    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=CALLBACK_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=CALLBACK_LOGGING_STEPS, report_to=["tensorboard"],
        use_cpu=True, seed=0, data_seed=0, max_grad_norm=0.0, disable_tqdm=True,
        dataloader_num_workers=0, save_strategy="no",
    )  # fmt: skip
    callback = GradMonitorCallback(output_dir / CALLBACK_LOG, dump_dir=None, max_norm=1.0)
    trainer = SpikeTrainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])
    _train_on_one_thread(trainer)
    trainer.save_state()
    return output_dir / "trainer_state.json"


# A run whose framework logs a wrong total: the norm of half the parameters,
# as the expert-parallel norm bugs did (Megatron-LM PR#5916, DeepSpeed#8469),
# beside a monitor log of the right one, in a run folder with checkpoints.
HALF_NORM_STEPS = 10
HALF_NORM_SAVE_STEPS = 5


@dataclass(frozen=True)
class HalfNormRun:
    """``output_dir`` holds ``checkpoint-5/``, ``checkpoint-10/``, ``trainer_state.json``
    and ``grads.jsonl``; ``half_norms[step]`` is torch's (float32) 2-norm of the first
    half of the parameters' gradients, what the Trainer logged as ``grad_norm``."""

    output_dir: Path
    steps: int
    half_norms: dict[int, float]


def train_with_half_norm(output_dir: Path) -> HalfNormRun:
    """The Trainer clips (and logs the norm) through ``accelerator.clip_grad_norm_``,
    here replaced on this run's accelerator by torch's over the first half of the
    parameters alone; a GradMonitor in ``training_step`` logs the whole norm."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (HALF_NORM_STEPS * 4, 16), generator=generator)
    dataset = [{"input_ids": t, "labels": t} for t in tokens]
    monitor = GradMonitor(model, output_dir / RUN_FOLDER_LOG, dump_dir=None)
    half_norms: dict[int, float] = {}

    class MonitoredTrainer(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            loss = super().training_step(model, inputs, *args, **kwargs)
            monitor.step(self.state.global_step + 1)
            return loss

    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=HALF_NORM_STEPS, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0, save_strategy="steps",
        save_steps=HALF_NORM_SAVE_STEPS, max_grad_norm=1.0,
    )  # fmt: skip
    trainer = MonitoredTrainer(model=model, args=args, train_dataset=dataset)

    def half_clip(parameters, max_norm, norm_type=2):
        params = [p for p in parameters if p.grad is not None]
        total = torch.nn.utils.clip_grad_norm_(params[: len(params) // 2], max_norm, norm_type)
        half_norms[trainer.state.global_step + 1] = float(total)
        return total

    trainer.accelerator.clip_grad_norm_ = half_clip
    try:
        _train_on_one_thread(trainer)
    finally:
        monitor.close()
    trainer.save_state()
    return HalfNormRun(output_dir, HALF_NORM_STEPS, half_norms)


def train_autopsy_example(output_dir: Path) -> None:
    """The autopsy guide's run: ``benchmarks/autopsy_rates.py``'s Trainer run, seed 2
    (``transformer.wpe``'s gradients x100 at step 40, checkpoints every 5 steps and at
    39-41, the callback's log and dumps)."""
    from benchmarks.autopsy_rates import make_run

    make_run("trainer", 2, True, output_dir)
