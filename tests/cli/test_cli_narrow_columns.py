"""At 80 columns the groups table keeps the columns that answer "which layer" (issue 41, 10).

``share`` (each group's part of the total) and the bar against the largest
group go last; the sizes, the largest magnitude and the ratio go first.
"""

from __future__ import annotations

import pytest
import torch

from .support import run_process


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_projection = torch.nn.Linear(16, 16)
        self.feed_forward_output = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.feed_forward_output(self.attention_projection(x))


@pytest.fixture
def adamw_checkpoint(tmp_path):
    """A model with layer names of a real model's length and its real AdamW state: the
    groups table has a ratio column (exp_avg over the weights)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"transformer_blocks": torch.nn.ModuleList(
        [Block() for _ in range(3)])})
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 16)
    for block in model["transformer_blocks"]:
        x = block(x)
    x.pow(2).sum().backward()
    opt.step()
    path = tmp_path / "adamw.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


def _header(out: str) -> list[str]:
    row = next(line for line in out.splitlines() if line.startswith("┃ group"))
    return [cell.strip() for cell in row.strip("┃").split("┃")]


@pytest.mark.parametrize("width, shown", [
    (120, ["group", "norm", "share", "max abs", "ratio", "elements", "non-finite", ""]),
    (80, ["group", "norm", "share", "ratio", ""]),
    (70, ["group", "norm", "share", ""]),
    (60, ["group", "norm", "share"]),
])
def test_share_and_the_bar_go_last(adamw_checkpoint, width, shown):
    r = run_process("inspect", adamw_checkpoint, "--top", "0", env={"COLUMNS": str(width)})
    assert r.code == 0, r.err
    assert _header(r.out) == shown
    assert max(map(len, r.out.splitlines())) <= width
    bars = [line for line in r.out.splitlines() if "█" in line]
    assert len(bars) == (3 if "" in shown else 0)
