"""The Hugging Face callback in a real ``transformers.Trainer`` run on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

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


def test_bad_max_norm_is_refused():
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        GradMonitorCallback(max_norm=0)
