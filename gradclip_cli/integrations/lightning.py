"""A Lightning ``Callback`` that runs :class:`~gradclip_cli.monitor.GradMonitor` every step.

    from lightning.pytorch import Trainer
    from gradclip_cli.integrations.lightning import GradMonitorCallback

    trainer = Trainer(callbacks=[GradMonitorCallback(log="grads.jsonl", dump_dir="spikes/")],
                      gradient_clip_val=1.0)

Lightning calls ``on_before_optimizer_step`` once per optimizer step, after
the backward passes of every accumulated batch, after AMP has unscaled the
gradients and before it clips them (``gradient_clip_val``): the monitor sees
the true, unclipped gradients. Steps are ``trainer.global_step`` (optimizer
steps taken before this one), the step Lightning's own loggers use there.

With ``clip_spikes=True`` the monitor clips a spike's gradients there, to the
history's ``mean + z * std`` (ZClip), before Lightning's own clipping and the
optimizer step; ``gradient_clip_val`` then still applies to every step.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError as e:  # pragma: no cover - exercised only without Lightning
    raise ImportError(
        "gradclip_cli.integrations.lightning needs Lightning: pip install 'gradclip[lightning]'"
    ) from e

from ..monitor import GradMonitor

__all__ = ["GradMonitorCallback"]


class GradMonitorCallback(Callback):
    """Log per-group gradient norms, flag spikes and dump bad steps' gradients.

    Args:
        log, dump_dir, **options: as :class:`~gradclip_cli.monitor.GradMonitor`
            (``every``, ``norm_type``, ``group_by``, ``z``, ``alpha``,
            ``warmup``, ``max_dumps``, ``clip_spikes``). Under DDP only
            global rank 0 writes.
    """

    def __init__(
        self,
        log: str | os.PathLike[str] | None = "grads.jsonl",
        dump_dir: str | os.PathLike[str] | None = "spikes/",
        **options: Any,
    ):
        super().__init__()
        self.log_path, self.dump_dir, self.options = log, dump_dir, options
        self.monitor: GradMonitor | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Before the first step: a bad option fails here, not mid-run. A later
        # fit of the same module goes on with its history; one of another
        # module (the callback reused in a sweep) gets a monitor of its own.
        if stage == "fit" and (self.monitor is None or self.monitor.model is not pl_module):
            self.monitor = GradMonitor(pl_module, self.log_path, self.dump_dir, **self.options)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is not None:
            self.monitor.step(trainer.global_step)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is not None:
            self.monitor.close()

