"""A Lightning ``Callback`` that runs :class:`~gradclip_cli.monitor.GradMonitor` every step.

    from lightning.pytorch import Trainer
    from gradclip_cli.integrations.lightning import GradMonitorCallback

    trainer = Trainer(callbacks=[GradMonitorCallback(log="grads.jsonl", dump_dir="spikes/")],
                      gradient_clip_val=1.0)

Lightning calls ``on_before_optimizer_step`` once per optimizer step, after
the backward passes of every accumulated batch, after AMP has unscaled the
gradients and before it clips them (``gradient_clip_val``): the monitor sees
the true, unclipped gradients. It measures the parameters that optimizer
steps, as ``gradient_clip_val`` clips them: a parameter outside it may hold
a gradient that is not this step's (one the optimizer never zeroes). Steps
are ``trainer.global_step`` (optimizer steps taken before this one), the
step Lightning's own loggers use there.

One log holds one series of steps, so a module with several optimizers (a
GAN's manual optimization) is refused before the first step: watch each
network with its own :class:`~gradclip_cli.monitor.GradMonitor` (its own
log), called in ``training_step`` before that optimizer's ``step()``.

With ``clip_spikes=True`` the monitor clips a spike's gradients there, to the
history's ``mean + z * std`` (ZClip), before Lightning's own clipping and the
optimizer step; ``gradient_clip_val`` then still applies to every step.

Each logged step's norms also go to the Lightning loggers, through the
LightningModule's ``log_dict`` from ``on_before_optimizer_step`` (a hook
that may log, per step), so TensorBoard, CSV, W&B, MLflow or any other
logger shows them with no setup of their own: ``gradclip/total_norm``,
``gradclip/norm/<group>`` (the log's group names), ``gradclip/spike`` (1.0
or 0.0) and, on steps the monitor scaled, ``gradclip/clip_coef``
(``gradclip_cli.tracker_scalars``). Lightning writes them at the step the
log has (``trainer.global_step``), on the steps its ``log_every_n_steps``
picks (the callback calls ``log_dict`` on those steps only: ``self.log``
is slow per key); they are the log's float64 numbers, which a logger may store as
float32 (TensorBoard does; CSV keeps them whole). ``log_metrics=False``
leaves the loggers alone.

A fit resumed with ``ckpt_path=...`` appends to the log, its steps going on
from the checkpoint's. The spike history is not in the checkpoint: the
monitor starts a new one. ``log`` and ``dump_dir`` are relative to the
working directory, not ``default_root_dir``.
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

import torch

from ..monitor import GradMonitor, ParameterListing
from ..tracker_scalars import scalars

__all__ = ["GradMonitorCallback"]


class GradMonitorCallback(Callback):
    """Log per-group gradient norms, flag spikes and dump bad steps' gradients.

    Args:
        log, dump_dir, **options: as :class:`~gradclip_cli.monitor.GradMonitor`
            (``every``, ``norm_type``, ``group_by``, ``z``, ``alpha``,
            ``warmup``, ``max_dumps``, ``clip_spikes``, ``tensorboard``).
            Under DDP only global rank 0 writes.
        log_metrics: also log the norms through the LightningModule's
            loggers (``self.log_dict``); False to leave them out.
    """

    def __init__(
        self,
        log: str | os.PathLike[str] | None = "grads.jsonl",
        dump_dir: str | os.PathLike[str] | None = "spikes/",
        *,
        log_metrics: bool = True,
        **options: Any,
    ):
        super().__init__()
        if not isinstance(log_metrics, bool):
            raise ValueError(
                f"GradMonitorCallback: log_metrics must be True or False, got {log_metrics!r}")
        self.log_path, self.dump_dir, self.options = log, dump_dir, options
        self.log_metrics = log_metrics
        self.monitor: GradMonitor | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Before the first step: a bad option fails here, not mid-run. A later
        # fit of the same module goes on with its history; one of another
        # module (the callback reused in a sweep) gets a monitor of its own.
        if stage == "fit" and (self.monitor is None or self.monitor.model.module is not pl_module):
            self.monitor = GradMonitor(
                _SteppedParameters(pl_module), self.log_path, self.dump_dir, **self.options
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) > 1:
            raise ValueError(
                f"GradMonitorCallback: this LightningModule has {len(trainer.optimizers)} "
                "optimizers; one log holds one series of steps, so watch each network with "
                "its own GradMonitor(submodule, log=...), called in training_step before "
                "that optimizer's step()"
            )

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.monitor is not None:
            self.monitor.model.optimizer = optimizer
            record = self.monitor.step(trainer.global_step)
            if record is not None and self.log_metrics and _logs_this_step(trainer):
                values = scalars(record)
                # As float64 CPU tensors: self.log keeps a tensor's dtype and device, where
                # a Python float would become a float32 on the module's device (a copy to
                # the accelerator per value, and another back when the logger reads it).
                numbers = torch.tensor(list(values.values()), dtype=torch.float64).unbind()
                pl_module.log_dict(dict(zip(values, numbers)), on_step=True, on_epoch=False,
                                   prog_bar=False, logger=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is not None:
            self.monitor.close()



def _logs_this_step(trainer: Any) -> bool:
    """Whether Lightning sends this step's values to its loggers (``log_every_n_steps``).

    ``self.log`` is slow per key (a 1,000-group ``log_dict`` every step made
    the hook 8.7x slower, 1.6x at the default ``log_every_n_steps=50``;
    docs/guides/dashboards.md), and a value logged on a step Lightning does
    not send is overwritten unseen: so only those steps log. Lightning's own
    test, where it has one; else every step. None without a logger.
    """
    if not getattr(trainer, "loggers", True):
        return False  # Trainer(logger=False): nothing to send them to (self.log would warn)
    connector = getattr(trainer, "_logger_connector", None)
    decision = getattr(connector, "should_update_logs", True)
    return decision if isinstance(decision, bool) else True


class _SteppedParameters(torch.nn.Module):
    """The parameters of ``module`` that ``optimizer`` steps, under their names in ``module``.

    What the monitor measures, clips and dumps at a step: the gradients the
    optimizer is about to use, those Lightning's ``gradient_clip_val`` clips
    (``clip_gradients`` reads the optimizer's ``param_groups``).
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self._module = [module]  # in a list: not registered as a submodule
        self._listing = ParameterListing()  # read again only when the module changes
        self.optimizer: Any = None

    @property
    def module(self) -> torch.nn.Module:
        return self._module[0]

    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True):
        """The module's own modules: where ``locate_nonfinite``'s forward hooks go."""
        return self.module.named_modules(memo, prefix, remove_duplicate)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        if self.optimizer is None:  # before the first step (locate_nonfinite's hooks): all
            yield from self.module.named_parameters(prefix, recurse, remove_duplicate)
            return
        stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        if (prefix, recurse, remove_duplicate) == ("", True, True):
            named = zip(*self._listing.named(self.module))
        else:
            named = self.module.named_parameters(prefix, recurse, remove_duplicate)
        for name, param in named:
            if id(param) in stepped:
                yield name, param
