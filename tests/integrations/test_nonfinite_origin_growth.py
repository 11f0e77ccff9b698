"""``GradMonitor(locate_nonfinite=True)`` on a model that gains layers after the monitor
was made (progressive growth, adapters put in place of layers): a NaN that begins in a
new layer is placed there, not in the first watched layer it reaches.

The references are independent of the monitor: the module is the one the test
corrupts, and the accumulation order is recorded by the test's own hooks.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradclip_cli import GradMonitor


class Growing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 1)
        self.blocks = torch.nn.ModuleList()

    def forward(self, x):
        h = self.fc1(x)
        for block in self.blocks:
            h = block(h)
        return self.fc2(h.tanh())


class Block(torch.nn.Linear):
    """A layer whose output turns NaN once ``poisoned`` (an overflowing activation)."""

    poisoned = False

    def forward(self, h):
        out = super().forward(h)
        return out * math.nan if self.poisoned else out


def nan_grad(module, grad_output):
    return (grad_output[0] * math.nan,)


def accumulation_order(model, x) -> list[str]:
    """The order autograd accumulates the gradients of ``model`` in, for input ``x``."""
    names = {id(p): n for n, p in model.named_parameters()}
    order: list[str] = []
    handles = [p.register_post_accumulate_grad_hook(
        lambda p: order.append(names[id(p)]) if names[id(p)] not in order else None)
        for p in model.parameters()]
    model(x).sum().backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    return order


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("added", ["before the step", "steps before"])
def test_a_nan_begun_in_a_layer_added_after_the_monitor_is_placed_there(tmp_path, where,
                                                                       added):
    model = Growing()
    x = torch.rand(16, 4)
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log, None, locate_nonfinite=True) as monitor:
        for step in range(3):
            if added == "steps before" and step == 1:
                model.blocks.append(Block(8, 8))
            model(x).sum().backward()
            assert monitor.step(step)["nonfinite_origin"] is None
            model.zero_grad()
        if added == "before the step":
            model.blocks.append(Block(8, 8))
        block = model.blocks[0]
        if where == "forward":
            block.poisoned = True
        else:
            block.register_full_backward_pre_hook(nan_grad)
        order = accumulation_order(model, x)
        model(x).sum().backward()
        origin = monitor.step(3)["nonfinite_origin"]
    grads = dict(model.named_parameters())
    first_bad = next(n for n in order if not torch.isfinite(grads[n].grad).all())
    if where == "forward":
        assert origin["forward"] == "blocks.0"
    else:
        assert origin["forward"] is None
        assert first_bad in ("blocks.0.weight", "blocks.0.bias")  # fc2 stays finite
    assert origin["backward"] == first_bad
