"""Real short runs whose gradients are exactly zero for their first steps.

Under DDP, FSDP or DeepSpeed's flat gradient buffers a parameter no step has
used yet (an MoE expert no token was routed to, a branch gated off at init)
has a gradient of exact zeros, not None. A history of zeros says nothing of
a norm's scale: the first nonzero point of such a series starts its history
afresh (docs/reference/spike-rule.md), rather than being a spike at z = inf
that keeps the history at 0 and makes every later point a spike.
"""

from __future__ import annotations

import torch

from gradclip_cli import GradMonitor

from .support import read_log
from .test_spike_clip import (
    SPIKE_AT,
    STEPS,
    assert_only_the_spike_is_clipped,
    grads64,
    regressor,
    rows,
    spike,
)

GATE_OPENS = 10
ZERO_STEPS = 8


class Gated(torch.nn.Module):
    """A regressor plus a branch whose output is multiplied by a gate that is 0 until
    ``GATE_OPENS``: the branch's gradient is exact zeros (not None) until then."""

    def __init__(self):
        super().__init__()
        self.net = regressor()
        self.branch = torch.nn.Linear(6, 1)
        self.gate = 0.0

    def forward(self, x):
        return self.net(x) + self.gate * self.branch(x)


def test_trend_does_not_flag_a_layer_whose_gradient_was_zero_until_its_gate_opened(
    tmp_path, gradclip
):
    torch.manual_seed(0)
    model = Gated()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = rows()
    with GradMonitor(model, tmp_path / "grads.jsonl", None) as monitor:
        for step in range(STEPS):
            model.gate = float(step >= GATE_OPENS)
            batch = torch.arange(step * 16, step * 16 + 32) % len(x)
            torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
            zero = all(bool((p.grad == 0).all()) for p in model.branch.parameters())
            assert zero == (step < GATE_OPENS), step  # the run is what the test says
            monitor.step(step)
            optimizer.step()
            optimizer.zero_grad()
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["groups"]["branch"] == 0 for r in records] == [
        s < GATE_OPENS for s in range(STEPS)
    ]
    # The branch's group is judged from the fifth step after its gate opened on,
    # against its own points since then: none is a spike. (The total does rise as the
    # branch joins it, and may be flagged for that: a real change of the total.)
    assert not any("branch" in r["spike_groups"] for r in records), records
    result = gradclip("trend", tmp_path / "grads.jsonl", "--format", "json")
    assert result.code == 0, result.out + result.err
    report = result.json()
    assert report["status"] == "ok"
    assert not any("branch" in p["spike_groups"] for p in report["points"]), report
    assert gradclip("trend", tmp_path / "grads.jsonl").code == 0


def test_clip_spikes_after_a_run_of_zero_gradients_clips_only_the_real_spike(tmp_path):
    """The loss is multiplied by 0 for the first steps: the whole model's gradient
    is zero. The steps after are not clipped (the weights move as torch alone moves
    them), and the spike injected later is clipped to the rule's limit."""
    torch.manual_seed(0)
    model = regressor()
    twin = regressor()
    twin.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=1e-2)
    x, y = rows()
    before, after = [], []
    with GradMonitor(model, tmp_path / "grads.jsonl", None, clip_spikes=True) as monitor:
        for step in range(STEPS):
            batch = torch.arange(step * 16, step * 16 + 32) % len(x)
            scale = float(step >= ZERO_STEPS)
            for net in (model, twin):
                (scale * torch.nn.functional.mse_loss(net(x[batch]), y[batch])).backward()
            if step == SPIKE_AT:
                spike(model)
            before.append(grads64(model))
            monitor.step(step)
            after.append(grads64(model))
            optimizer.step()
            optimizer.zero_grad()
            if step < SPIKE_AT:  # torch's own step, without the monitor
                twin_optimizer.step()
                twin_optimizer.zero_grad()
            if step == SPIKE_AT - 1:
                # Same machine, same operations: the monitor changed nothing before the spike.
                for p, q in zip(model.parameters(), twin.parameters()):
                    torch.testing.assert_close(p, q, rtol=0, atol=0)
                moved = [float((p - s).abs().max()) for p, s in zip(model.parameters(), start)]
                assert min(moved) > 1e-4, moved
    assert [bool(b) and all(bool((g == 0).all()) for g in b.values()) for b in before] == [
        s < ZERO_STEPS for s in range(STEPS)
    ]
    assert_only_the_spike_is_clipped(read_log(tmp_path / "grads.jsonl"), before, after)


def test_trend_says_too_little_history_until_5_steps_after_the_first_nonzero_gradient(
    tmp_path, gradclip
):
    torch.manual_seed(0)
    model = regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = rows()
    with GradMonitor(model, tmp_path / "grads.jsonl", None) as monitor:
        for step in range(ZERO_STEPS + 5):
            scale = float(step >= ZERO_STEPS)
            (scale * torch.nn.functional.mse_loss(model(x[:32]), y[:32])).backward()
            monitor.step(step)
            optimizer.step()
            optimizer.zero_grad()
    # The newest step has 4 earlier points from the first nonzero one (and 12 in all).
    result = gradclip("trend", tmp_path / "grads.jsonl", "--format", "json", "--fail-on", "any")
    assert result.code == 0, result.out + result.err
    report = result.json()
    assert report["status"] == "insufficient_history"
    assert [p["total_norm"] == 0 for p in report["points"]] == [
        s < ZERO_STEPS for s in range(ZERO_STEPS + 5)
    ]
    assert all(p["z"] is None and not p["spike"] for p in report["points"])
    table = gradclip("trend", tmp_path / "grads.jsonl", "-q")
    assert table.code == 0
    assert "counted from its series' first nonzero norm" in " ".join(table.out.split())
