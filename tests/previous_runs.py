"""Real torch.optim loops that save checkpoints one optimizer step apart, for ``--previous``.

Each run trains a small model with a real optimizer, saves ``{"model",
"optimizer"}`` with ``torch.save`` after every step from ``first_saved`` on
(``step-N.pt``, N the optimizer step just taken; ``step-0.pt`` is the model
before any step), and saves the gradients every step used with
``gradclip_cli.save_grads`` just before ``optimizer.step()`` (``grads-N.pt``):
what the optimizer saw, the reference the reconstruction is compared with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gradclip_cli import save_grads


class Net(torch.nn.Module):
    """Two layers; float32 unless a dtype is given."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32, hidden: int = 16):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(12, hidden)
        self.b = torch.nn.Linear(hidden, 5)
        self.to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@dataclass(frozen=True)
class Run:
    folder: Path
    steps: int

    def checkpoint(self, step: int) -> Path:
        return self.folder / f"step-{step}.pt"

    def grads(self, step: int) -> dict[str, torch.Tensor]:
        return torch.load(self.folder / f"grads-{step}.pt", weights_only=True)["grads"]


def train(folder: Path, make: Callable[[torch.nn.Module], torch.optim.Optimizer], *,
          steps: int = 5, dtype: torch.dtype = torch.float32, seed: int = 0,
          first_saved: int = 0, before_step: Callable | None = None,
          save: Callable[[torch.nn.Module, torch.optim.Optimizer], dict] | None = None) -> Run:
    """Train ``steps`` optimizer steps; ``before_step(step, optimizer)`` may change a setting
    before step ``step``; ``save`` overrides what a checkpoint holds."""
    folder.mkdir(parents=True, exist_ok=True)
    model = Net(seed, dtype)
    opt = make(model)
    contents = save or (lambda m, o: {"model": m.state_dict(), "optimizer": o.state_dict()})
    generator = torch.Generator().manual_seed(seed + 100)
    if first_saved == 0:
        torch.save(contents(model, opt), folder / "step-0.pt")
    for step in range(1, steps + 1):
        opt.zero_grad()
        x = torch.randn(32, 12, generator=generator).to(dtype)
        # A loss whose gradients differ in scale from layer to layer and step to step.
        loss = model(x).square().mean() * (1 + step % 3)
        loss.backward()
        save_grads(model, folder / f"grads-{step}.pt")
        if before_step is not None:
            before_step(step, opt)
        opt.step()
        if step >= first_saved:
            torch.save(contents(model, opt), folder / f"step-{step}.pt")
    return Run(folder, steps)


def float64_norm(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.double()).item()
