"""GradMonitor(clip_spikes=True) (ZClip) in real short runs: a plain loop, Lightning, the Trainer.

Each run injects one spike (that step's gradients times 10, before the
monitor sees them) and records the gradients just before and just after the
monitor, in float64. The reference is independent of gradclip: float64 norms
of the recorded gradients, judged by the rule as docs/reference/spike-rule.md states it
(``tests/core/spike_reference.py``). The spike step must be clipped to
``limit / (total + 1e-6)`` of itself, every other step left bit for bit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradclip_cli import GradMonitor
from tests.cli.support import REPO, ref_norm
from tests.core.spike_reference import reference
from tests.devices import DEVICES

from .support import read_log

STEPS, SPIKE_AT, FACTOR = 40, 30, 10.0


def grads64(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().to("cpu", torch.float64, copy=True)
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def spike(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(FACTOR)


def regressor() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def rows(n: int = 512):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def assert_only_the_spike_is_clipped(records, before, after, max_norm=None):
    """``before``/``after``: per step, name -> float64 gradient around the monitor."""
    assert len(records) == len(before) == len(after) == STEPS
    totals = [ref_norm(list(b.values()), 2.0) for b in before]
    judged = reference(totals)
    assert [i for i, (_, is_spike, _) in enumerate(judged) if is_spike] == [SPIKE_AT]
    for i, (record, b, a, (_, is_spike, limit)) in enumerate(zip(records, before, after, judged)):
        if not is_spike:
            limit = math.inf
        target = min(limit, math.inf if max_norm is None else max_norm)
        coef = min(1.0, target / (totals[i] + 1e-6))
        assert list(a) == list(b)
        for name in b:  # float32 gradients times a float32 coefficient: a few roundings of 6e-8
            torch.testing.assert_close(
                a[name], b[name] * coef, rtol=1e-6, atol=0, msg=f"step {i} {name}"
            )
        if is_spike:
            assert math.isclose(record["clipped_to"], target, rel_tol=1e-6), record
            assert math.isclose(record["clip_coef"], coef, rel_tol=1e-6), record
            assert record["spike"] and record["z"] > 2.5
            assert math.isclose(ref_norm(list(a.values()), 2.0), target, rel_tol=1e-5)
        elif coef < 1:  # max_norm clipped it: recorded as well
            assert record["clipped_to"] == max_norm, record
            assert math.isclose(record["clip_coef"], coef, rel_tol=1e-6), record
        else:
            assert record["clipped_to"] is None and record["clip_coef"] is None, record
            assert all(torch.equal(a[n], b[n]) for n in b), i  # untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_norm", [None, 1.0, 0.05])
def test_plain_loop(tmp_path, max_norm, gradclip, device):
    """``step()`` clips only the spike; ``clip_grad_norm_`` takes the smaller of the two."""
    torch.manual_seed(0)
    model = regressor().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = (t.to(device) for t in rows())
    before, after = [], []
    with GradMonitor(model, tmp_path / "grads.jsonl", None, clip_spikes=True) as monitor:
        for step in range(STEPS):
            batch = torch.arange(step * 16, step * 16 + 32, device=device) % len(x)
            torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
            if step == SPIKE_AT:
                spike(model)
            before.append(grads64(model))
            if max_norm is None:
                monitor.step(step)
            else:
                monitor.clip_grad_norm_(max_norm, step)
            after.append(grads64(model))
            optimizer.step()
            optimizer.zero_grad()
    assert_only_the_spike_is_clipped(read_log(tmp_path / "grads.jsonl"), before, after, max_norm)
    # trend reads the log (its new keys too) and judges it the same way.
    result = gradclip("trend", tmp_path / "grads.jsonl", "--format", "json", "--fail-on", "any")
    assert result.code == 1, result.err
    assert [p["step"] for p in result.json()["points"] if p["spike"]] == [SPIKE_AT]


def test_off_by_default_the_spike_is_only_logged(tmp_path):
    torch.manual_seed(0)
    model = regressor()
    x, y = rows()
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None)
    for step in range(SPIKE_AT + 1):
        torch.nn.functional.mse_loss(model(x[:32]), y[:32]).backward()
        if step == SPIKE_AT:
            spike(model)
        seen = grads64(model)
        record = monitor.step(step)
        assert all(torch.equal(seen[n], g) for n, g in grads64(model).items())
        model.zero_grad()
    assert record["spike"] and record["clipped_to"] is None and record["clip_coef"] is None


def test_clip_spikes_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="clip_spikes must be True or False"):
        GradMonitor(regressor(), tmp_path / "g.jsonl", None, clip_spikes=1)


def test_lightning(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from gradclip_cli.integrations.lightning import GradMonitorCallback

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = regressor()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    class Around(pl.Callback):
        """Injects the spike (``inject``) and records the gradients."""

        def __init__(self, inject: bool):
            self.inject, self.seen = inject, []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if self.inject and trainer.global_step == SPIKE_AT:
                spike(pl_module)
            self.seen.append(grads64(pl_module))

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*rows()),
        batch_size=32,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    before, after = Around(inject=True), Around(inject=False)
    monitor = GradMonitorCallback(tmp_path / "grads.jsonl", None, clip_spikes=True)
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[before, monitor, after],  # called in this order
    )  # fmt: skip
    trainer.fit(Regressor(), loader)
    assert_only_the_spike_is_clipped(read_log(tmp_path / "grads.jsonl"), before.seen, after.seen)


def test_hugging_face_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    from gradclip_cli.integrations.transformers import GradMonitorCallback

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = regressor()

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    class Around(transformers.TrainerCallback):
        def __init__(self, inject: bool):
            self.inject, self.seen = inject, []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.inject and state.global_step + 1 == SPIKE_AT + 1:  # the log's step 31
                spike(model)
            self.seen.append(grads64(model))

    x, y = rows()
    data = [{"x": a, "labels": b} for a, b in zip(x, y)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=32,
        learning_rate=1e-2, max_grad_norm=0.0, report_to="none", save_strategy="no",
        logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    before, after = Around(inject=True), Around(inject=False)
    monitor = GradMonitorCallback(tmp_path / "grads.jsonl", None, clip_spikes=True)
    transformers.Trainer(
        model=Regressor(), args=args, train_dataset=data, callbacks=[before, monitor, after]
    ).train()
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert_only_the_spike_is_clipped(records, before.seen, after.seen)


def test_the_readme_spike_clip_loop_runs_as_shown(tmp_path, monkeypatch):
    section = (REPO / "docs" / "guides" / "training-loop.md").read_text(encoding="utf-8")
    section = section[section.index("Clipping that adapts") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    assert "clip_spikes=True" in code
    shown = section[section.index("```console\n") :].splitlines()[2]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "training-loop.md", "exec"), {})
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records if r["clip_coef"] is not None] == [50]
    judged = reference([r["total_norm"] for r in records])
    record, (_, is_spike, limit) = records[50], judged[50]
    assert is_spike and math.isclose(record["clipped_to"], limit, rel_tol=1e-9)
    assert math.isclose(record["clip_coef"], limit / (record["total_norm"] + 1e-6), rel_tol=1e-9)
    # The line the guide prints is this run's, to the last few digits.
    want = json.loads(shown)
    assert list(want) == list(record) and want["step"] == 50
    for key in ("total_norm", "z", "clipped_to", "clip_coef"):
        assert math.isclose(record[key], want[key], rel_tol=1e-6), key


DDP_RANK = """
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from gradclip_cli import GradMonitor
rank, folder = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                        world_size=2)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)))
monitor = GradMonitor(model, f"{folder}/grads.jsonl", None, clip_spikes=True)
torch.manual_seed(rank)
batch = torch.randn(16, 4)  # the same each step: steady norms, so only step 7 spikes
seen = []
for step in range(8):
    loss = model(batch).square().mean() * (10.0 if step == 7 else 1.0)
    loss.backward()
    monitor.step(step)
    seen.append([p.grad.double().flatten().tolist() for p in model.parameters()])
    model.zero_grad()
print(json.dumps(seen), flush=True)
from tests import gloo
gloo.leave()  # barrier, destroy, exit without the interpreter's teardown
"""


def _ddp_ranks(folder: Path) -> list[tuple[int, str, str]]:
    """``DDP_RANK`` on two gloo ranks in ``folder``: each rank's exit code, output, errors."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DDP_RANK, str(rank), str(folder)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    ranks = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        ranks.append((proc.returncode, out, err))
    return ranks


def test_under_ddp_every_rank_clips_the_spike_alike(tmp_path):
    ranks = _ddp_ranks(tmp_path)
    if any(code < 0 for code, _, _ in ranks):
        # Each rank leaves as tests/gloo.py says, past the gloo teardown that aborted
        # ranks under load; a rank killed by a signal all the same runs again once, in
        # a fresh folder.
        tmp_path = tmp_path / "again"
        tmp_path.mkdir()
        ranks = _ddp_ranks(tmp_path)
    seen = []
    for code, out, err in ranks:
        assert code == 0, err
        seen.append(json.loads(out.splitlines()[-1]))
    assert seen[0] == seen[1]  # the same coefficient on both ranks, bit for bit
    records = read_log(tmp_path / "grads.jsonl")  # rank 0 alone wrote it
    assert [r["step"] for r in records if r["clip_coef"] is not None] == [7]
    spike = records[7]
    total_after = math.sqrt(sum(v * v for grad in seen[0][7] for v in grad))
    assert math.isclose(total_after, spike["clipped_to"], rel_tol=1e-5)
