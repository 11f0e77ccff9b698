"""The Hugging Face callback in a real ``transformers.Trainer`` run on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from tests.cli.support import as_float

from .support import assert_norms_match, assert_spike_found, read_log, reference_norms

transformers = pytest.importorskip("transformers")

from gradclip_cli.integrations.transformers import GradMonitorCallback  # noqa: E402

STEPS, SPIKE_AT, CULPRIT, MAX_NORM = 40, 30, "net.2", 1.0


class Regressor(torch.nn.Module):
    """Two linear layers; while ``inject`` is set the loss gains a term in ``net.2`` alone."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.inject = False

    def forward(self, x, labels):
        loss = torch.nn.functional.mse_loss(self.net(x), labels)
        if self.inject:
            loss = loss + 1e4 * self.net[2].weight.square().sum()
        return {"loss": loss}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class InjectSpike(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        model.inject = state.global_step + 1 == SPIKE_AT  # the monitor's number for this step


class RecordNorms(transformers.TrainerCallback):
    """Float64 norms of the gradients as they are when this callback runs."""

    def __init__(self):
        self.seen: list[tuple[int, float, dict[str, float]]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.seen.append((state.global_step + 1, *reference_norms(model)))


def training_args(folder, **overrides):
    options = dict(
        output_dir=str(folder), max_steps=STEPS, per_device_train_batch_size=32,
        learning_rate=1e-3, max_grad_norm=0.0, report_to="none", save_strategy="no",
        logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**options, **overrides})


@pytest.fixture(scope="session")
def trainer_run(tmp_path_factory):
    """One short run (cached): the folder, and the norms before and after the callback clips."""
    folder = tmp_path_factory.mktemp("hf")
    before, after = RecordNorms(), RecordNorms()
    monitor = GradMonitorCallback(folder / "grads.jsonl", folder / "spikes", max_norm=MAX_NORM,
                                  max_dumps=STEPS)
    trainer = transformers.Trainer(
        model=Regressor(), args=training_args(folder), train_dataset=Rows(),
        callbacks=[InjectSpike(), before, monitor, after],
    )
    trainer.train()
    return folder, before.seen, after.seen


def test_one_line_per_step_with_the_norms_before_clipping(trainer_run):
    folder, before, after = trainer_run
    records = read_log(folder / "grads.jsonl")
    # Steps as trainer_state.json numbers them: 1 for the first update.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [step for step, _, _ in before] == list(range(1, STEPS + 1))
    for record, (_, total, groups) in zip(records, before):
        assert list(groups) == ["net.0", "net.2"]
        assert_norms_match(record, total, groups)
    # ... and the callback clipped them, as max_grad_norm would have.
    for (_, total_before, _), (_, total_after, _) in zip(before, after):
        want = min(total_before, MAX_NORM * total_before / (total_before + 1e-6))
        assert math.isclose(total_after, want, rel_tol=1e-5)


def test_the_injected_spike_is_flagged_and_dumped(trainer_run, gradclip):
    folder, _, _ = trainer_run
    spike = read_log(folder / "grads.jsonl")[SPIKE_AT - 1]
    assert spike["step"] == SPIKE_AT
    assert_spike_found(gradclip, folder, spike, CULPRIT, "net.0", first_step=1)


def test_trainer_clipping_first_is_refused_before_any_step(tmp_path):
    callback = GradMonitorCallback(tmp_path / "grads.jsonl", tmp_path / "spikes")
    args = training_args(tmp_path, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0 .* set max_grad_norm=0"):
        callback.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(),
                                model=Regressor())
    assert not (tmp_path / "grads.jsonl").exists()


def scaled_backward(scale: float, *, unscaled_by_trainer: bool):
    """A real accelerate ``AcceleratedOptimizer`` over a ``GradScaler``, after a scaled backward.

    As a Trainer with fp16 AMP leaves it at ``on_pre_optimizer_step``: the
    gradients times the loss scale, or already unscaled where the Trainer
    clipped or logged ``grad_norm`` first.
    """
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # the process state an AcceleratedOptimizer reads
    torch.manual_seed(0)
    model = Regressor()
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)
    rows = Rows(32)
    scaler.scale(model(rows.x, rows.y)["loss"]).backward()
    if unscaled_by_trainer:
        scaler.unscale_(optimizer.optimizer)
    return model, optimizer


@pytest.mark.parametrize("unscaled_by_trainer", [False, True])
def test_amp_loss_scale_is_taken_out_before_measuring_and_clipping(tmp_path, unscaled_by_trainer):
    """fp16 AMP: the log and the clip see the true gradients, not the scaled ones.

    transformers 4.46 to 5.0 with ``max_grad_norm=0`` call the hook with the
    gradients still multiplied by the loss scale; later releases unscale them
    first. Either way the callback measures the unscaled gradients, and the
    optimizer then steps with exactly the gradients the callback clipped.
    """
    scale = 2.0**16
    args = training_args(tmp_path)  # before the optimizer: it resets accelerate's process state
    model, optimizer = scaled_backward(scale, unscaled_by_trainer=unscaled_by_trainer)
    true_total = reference_norms(model)[0] / (1.0 if unscaled_by_trainer else scale)
    callback = GradMonitorCallback(tmp_path / "grads.jsonl", None, max_norm=MAX_NORM)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback.on_train_begin(args, state, control, model=model)
    callback.on_pre_optimizer_step(args, state, control, model=model, optimizer=optimizer)
    callback.on_train_end(args, state, control)
    [record] = read_log(tmp_path / "grads.jsonl")
    assert math.isclose(as_float(record["total_norm"]), true_total, rel_tol=1e-6)
    want = min(true_total, MAX_NORM * true_total / (true_total + 1e-6))
    assert math.isclose(reference_norms(model)[0], want, rel_tol=1e-5)
    # The scaler knows the gradients are unscaled: its step neither unscales
    # them again nor skips the update.
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.detach().clone() for p in model.parameters()]
    optimizer.step()
    for p, was, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), was - 0.1 * g)


def test_bad_max_norm_is_refused():
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        GradMonitorCallback(max_norm=0)


def test_a_second_training_of_another_model_logs_that_model(tmp_path):
    """One callback object in two Trainers (a sweep): each line is the model being trained."""
    callback, reference = GradMonitorCallback(tmp_path / "grads.jsonl", None), RecordNorms()
    for _ in range(2):
        transformers.Trainer(
            model=Regressor(), args=training_args(tmp_path, max_steps=3), train_dataset=Rows(),
            callbacks=[reference, callback],
        ).train()
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 1, 2, 3]
    for record, (_, total, groups) in zip(records, reference.seen, strict=True):
        assert_norms_match(record, total, groups)


def test_accumulated_batches_log_one_line_per_optimizer_step(tmp_path):
    """Steps and norms line up with the Trainer's own ``grad_norm`` in trainer_state.json."""
    reference = RecordNorms()
    args = training_args(tmp_path, max_steps=4, gradient_accumulation_steps=2,
                         per_device_train_batch_size=8, logging_strategy="steps", logging_steps=1)
    callback = GradMonitorCallback(tmp_path / "grads.jsonl", None)
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=Rows(),
                                   callbacks=[reference, callback])
    trainer.train()
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record, (_, total, groups) in zip(records, reference.seen, strict=True):
        assert_norms_match(record, total, groups)
    logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    assert sorted(logged) == [1, 2, 3, 4]
    for record in records:  # the Trainer's float32 norm of the same gradients
        assert math.isclose(logged[record["step"]], record["total_norm"], rel_tol=1e-5)


def test_evaluation_alone_writes_nothing(tmp_path):
    callback = GradMonitorCallback(tmp_path / "grads.jsonl", tmp_path / "spikes")
    trainer = transformers.Trainer(model=Regressor(), args=training_args(tmp_path),
                                   eval_dataset=Rows(64), callbacks=[callback])
    trainer.evaluate()
    trainer.predict(Rows(16))
    assert not (tmp_path / "grads.jsonl").exists() and not (tmp_path / "spikes").exists()


def test_a_resumed_run_continues_the_steps_with_a_new_history(tmp_path):
    """resume_from_checkpoint: lines are appended from checkpoint-N's step on; the
    spike history is not in the checkpoint, so the resumed monitor starts a new one."""
    saving = dict(save_strategy="steps", save_steps=6)
    transformers.Trainer(
        model=Regressor(), args=training_args(tmp_path, max_steps=8, **saving),
        train_dataset=Rows(), callbacks=[GradMonitorCallback(tmp_path / "grads.jsonl", None)],
    ).train()
    reference, monitor = RecordNorms(), GradMonitorCallback(tmp_path / "grads.jsonl", None)
    transformers.Trainer(
        model=Regressor(), args=training_args(tmp_path, max_steps=10, **saving),
        train_dataset=Rows(), callbacks=[reference, monitor],
    ).train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9, 10]
    for record, (_, total, groups) in zip(records[8:], reference.seen, strict=True):
        assert_norms_match(record, total, groups)
    assert records[7]["z"] is not None and records[8]["z"] is None
