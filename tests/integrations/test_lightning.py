"""The Lightning callback in a real ``lightning.pytorch.Trainer`` run on the CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from .support import assert_norms_match, assert_spike_found, read_log, reference_norms

pl = pytest.importorskip("lightning.pytorch")

from gradclip_cli.integrations.lightning import GradMonitorCallback  # noqa: E402

STEPS, SPIKE_AT, CULPRIT = 40, 30, "net.2"


class Regressor(pl.LightningModule):
    """Two linear layers; at one step the loss gains a term in ``net.2`` alone."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == SPIKE_AT:
            loss = loss + 1e4 * self.net[2].weight.square().sum()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class RecordNorms(pl.Callback):
    """The float64 reference, read from the same gradients the monitor sees."""

    def __init__(self):
        self.seen: list[tuple[int, float, dict[str, float]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append((trainer.global_step, *reference_norms(pl_module)))


@pytest.fixture(scope="session")
def lightning_run(tmp_path_factory):
    """One short run (cached for the session): the folder, and the reference norms per step."""
    folder = tmp_path_factory.mktemp("lightning")
    torch.manual_seed(0)
    x = torch.randn(256, 6)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    reference = RecordNorms()
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, gradient_clip_val=1.0,
        callbacks=[GradMonitorCallback(folder / "grads.jsonl", folder / "spikes", max_dumps=STEPS),
                   reference],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=folder,
    )  # fmt: skip
    trainer.fit(Regressor(), loader)
    return folder, reference.seen


def test_one_line_per_step_with_the_norms_of_that_step(lightning_run):
    folder, seen = lightning_run
    records = read_log(folder / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [step for step, _, _ in seen] == list(range(STEPS))
    for record, (_, total, groups) in zip(records, seen):
        assert list(groups) == ["net.0", "net.2"]
        assert_norms_match(record, total, groups)


def test_the_injected_spike_is_flagged_and_dumped(lightning_run, gradclip):
    folder, _ = lightning_run
    spike = read_log(folder / "grads.jsonl")[SPIKE_AT]
    assert spike["step"] == SPIKE_AT
    assert_spike_found(gradclip, folder, spike, CULPRIT, "net.0", first_step=0)


def fit(folder, module, callbacks, max_steps=3, **options):
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    ckpt_path = options.pop("ckpt_path", None)
    settings = dict(
        max_steps=max_steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=folder,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    pl.Trainer(**{**settings, **options}).fit(module, loader, ckpt_path=ckpt_path)


def test_accumulated_batches_log_one_line_per_optimizer_step(tmp_path):
    reference = RecordNorms()
    fit(tmp_path, Regressor(), [GradMonitorCallback(tmp_path / "grads.jsonl", None), reference],
        max_steps=4, accumulate_grad_batches=2)
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [step for step, _, _ in reference.seen] == [0, 1, 2, 3]
    for record, (_, total, groups) in zip(records, reference.seen):
        assert_norms_match(record, total, groups)


def test_a_second_fit_of_another_module_logs_that_module(tmp_path):
    """One callback object in two fits (a sweep): each line is the module being fitted."""
    callback, reference = GradMonitorCallback(tmp_path / "grads.jsonl", None), RecordNorms()
    fit(tmp_path, Regressor(), [callback, reference])
    fit(tmp_path, Regressor(), [callback, reference])
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 0, 1, 2]
    for record, (_, total, groups) in zip(records, reference.seen, strict=True):
        assert_norms_match(record, total, groups)


class HeadOnly(Regressor):
    """The optimizer steps ``net.2`` alone; ``net.0`` gets gradients it never zeroes."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[2].parameters(), lr=1e-3)


class RecordSteppedNorms(RecordNorms):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        self.seen.append((trainer.global_step, *reference_norms(pl_module, only=stepped)))


def test_only_the_parameters_the_optimizer_steps_are_measured(tmp_path):
    """As Lightning's gradient_clip_val clips them: the others' gradients are not this step's."""
    reference = RecordSteppedNorms()
    callback = GradMonitorCallback(tmp_path / "grads.jsonl", None)
    fit(tmp_path, HeadOnly(), [callback, reference], max_steps=8)
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(8))
    for record, (_, total, groups) in zip(records, reference.seen, strict=True):
        assert list(groups) == ["net.2"]
        assert_norms_match(record, total, groups)


class TwoOptimizers(pl.LightningModule):
    """A GAN-style loop: manual optimization, one optimizer per network."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(x)
        opt_g.zero_grad()
        self.manual_backward(-self.disc(fake).mean())
        opt_g.step()
        opt_d.zero_grad()
        self.manual_backward(self.disc(fake.detach()).mean() - self.disc(x).mean())
        opt_d.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.gen.parameters(), lr=1e-2),
                torch.optim.SGD(self.disc.parameters(), lr=1e-2))


def test_two_optimizers_are_refused_before_the_first_step(tmp_path):
    """One log holds one series: each optimizer's steps need their own monitor."""
    callback = GradMonitorCallback(tmp_path / "grads.jsonl", None)
    with pytest.raises(ValueError, match=r"2 optimizers.*its own GradMonitor"):
        fit(tmp_path, TwoOptimizers(), [callback])
    assert not (tmp_path / "grads.jsonl").exists()


def test_one_optimizer_under_manual_optimization(tmp_path):
    class Manual(Regressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()

    reference = RecordNorms()
    fit(tmp_path, Manual(), [GradMonitorCallback(tmp_path / "grads.jsonl", None), reference])
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record, (_, total, groups) in zip(records, reference.seen, strict=True):
        assert_norms_match(record, total, groups)


def test_a_resumed_fit_continues_the_steps_with_a_new_history(tmp_path):
    """ckpt_path=...: lines are appended from the checkpoint's step on; the spike
    history is not in the checkpoint, so the resumed monitor starts a new one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    every_3 = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    fit(tmp_path, Regressor(), [GradMonitorCallback(tmp_path / "grads.jsonl", None), every_3],
        max_steps=8, enable_checkpointing=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    reference = RecordNorms()
    fit(tmp_path, Regressor(), [GradMonitorCallback(tmp_path / "grads.jsonl", None), reference],
        max_steps=10, ckpt_path=tmp_path / "ckpt" / "epoch=1-step=6.ckpt")
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9]
    for record, (_, total, groups) in zip(records[8:], reference.seen, strict=True):
        assert_norms_match(record, total, groups)
    assert records[7]["z"] is not None and records[8]["z"] is None


class Poisoned(Regressor):
    """At step ``POISON_AT`` the hidden layer's output holds a NaN, or (``in_backward``)
    the gradient flowing back into ``net.2`` from its output does."""

    def __init__(self, in_backward: bool):
        super().__init__()
        self.in_backward = in_backward
        self.net[0].register_forward_hook(self._forward_nan)
        self.net[2].register_full_backward_pre_hook(self._backward_nan)

    def _poisoned(self) -> bool:
        return self.global_step == POISON_AT

    def _forward_nan(self, module, args, output):
        return output * math.nan if self._poisoned() and not self.in_backward else output

    def _backward_nan(self, module, grad_output):
        if self._poisoned() and self.in_backward:
            return (grad_output[0] * math.nan,)
        return None


POISON_AT = 3


@pytest.mark.parametrize("in_backward", [False, True])
def test_locate_nonfinite_names_the_module_and_the_parameter(tmp_path, in_backward):
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]),
                                         batch_size=16)
    trainer = pl.Trainer(
        max_steps=POISON_AT + 1, accelerator="cpu", devices=1,
        callbacks=[GradMonitorCallback(tmp_path / "grads.jsonl", None, locate_nonfinite=True)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Poisoned(in_backward), loader)
    records = [json.loads(line) for line in (tmp_path / "grads.jsonl").read_text().splitlines()]
    assert [r["nonfinite_origin"] for r in records[:POISON_AT]] == [None] * POISON_AT
    if in_backward:  # the forward was clean; net.2's own gradients are the first NaN ones
        assert records[POISON_AT]["nonfinite_origin"]["forward"] is None
        assert records[POISON_AT]["nonfinite_origin"]["backward"] in ("net.2.weight",
                                                                      "net.2.bias")
    else:
        assert records[POISON_AT]["nonfinite_origin"]["forward"] == "net.0"
