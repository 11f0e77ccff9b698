"""A Hugging Face ``TrainerCallback`` that runs :class:`~gradclip_cli.monitor.GradMonitor`.

    from transformers import Trainer, TrainingArguments
    from gradclip_cli.integrations.transformers import GradMonitorCallback

    args = TrainingArguments("out", max_grad_norm=0)  # the callback clips instead
    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[GradMonitorCallback(max_norm=1.0)])

The Trainer calls ``on_pre_optimizer_step`` once per optimizer step, after
the backward passes of every accumulated batch, but *after* its own clipping
to ``max_grad_norm``: a monitor there would see
clipped gradients, in which a spike is already flattened. So the Trainer's
clipping is turned off (``max_grad_norm=0``) and the callback clips with
``max_norm``: one measurement gives the logged norms and the clip, as
:meth:`GradMonitor.clip_grad_norm_` does. Training with ``max_grad_norm > 0``
is refused before the first step rather than logged wrong.

With ``clip_spikes=True`` the callback also clips a spike there, to the
history's ``mean + z * std`` (ZClip): the hook runs after the Trainer's
clipping and before ``optimizer.step()``, so gradients changed in it are the
ones the optimizer uses. With ``max_norm`` too, a spike is clipped to the
smaller of the two limits.

With fp16 AMP (a ``GradScaler``) the gradients reach the hook multiplied by
the loss scale (65536 at first) unless the Trainer has unscaled them, which
it does only to clip or, in recent releases, to log ``grad_norm``: with
``max_grad_norm=0`` transformers 4.46 to 5.0 do not. The callback has the
scaler unscale them first (``GradScaler.unscale_``, torch's way to work with
unscaled gradients; the optimizer step then uses them as they are), so the
monitor measures and clips the true gradients either way.

Steps are ``state.global_step + 1``: the number the Trainer gives this
update in ``trainer_state.json``'s ``log_history`` and in ``checkpoint-N``.
A run resumed with ``resume_from_checkpoint`` appends to the log, its steps
going on from the checkpoint's. The spike history is not in the checkpoint:
the monitor starts a new one. ``log`` and ``dump_dir`` are relative to the
working directory, not ``output_dir``.

On the Trainer's logging steps (``logging_steps``) the callback also adds
that step's norms to the Trainer's logs: ``gradclip/total_norm``,
``gradclip/norm/<group>`` (the log's group names), ``gradclip/spike`` (1.0
or 0.0) and, on steps it scaled, ``gradclip/clip_coef``
(``gradclip_cli.tracker_scalars``), the log's float64 numbers. So every
``report_to`` integration receives them (TensorBoard and W&B write them as
``train/gradclip/...``, the prefix they give every training key; TensorBoard
keeps float32) and ``trainer_state.json``'s ``log_history`` keeps them,
where ``gradclip trend`` reads them back. The Trainer calls the integrations
before the callbacks passed to it, so the callback puts a small companion
(``_TrainerLogs``, which only adds these keys) at the head of the Trainer's
callbacks when training begins; the others keep their order.
``log_metrics=False`` leaves the logs alone. Steps the monitor does not
log (``every``) add nothing: make ``logging_steps`` a multiple of it.

Not for DeepSpeed runs: the engine keeps (and clips) the gradients in its
own buffers, not in the parameters' ``.grad``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "gradclip_cli.integrations.transformers needs transformers: "
        "pip install 'gradclip[transformers]'"
    ) from e

from torch.amp.grad_scaler import OptState

from ..monitor import GradMonitor
from ..tracker_scalars import scalars

__all__ = ["GradMonitorCallback"]


class GradMonitorCallback(TrainerCallback):
    """Log per-group gradient norms, flag spikes, dump bad steps' gradients, and clip.

    Args:
        log, dump_dir, **options: as :class:`~gradclip_cli.monitor.GradMonitor`
            (``every``, ``norm_type``, ``group_by``, ``z``, ``alpha``,
            ``warmup``, ``max_dumps``, ``clip_spikes``). Under DDP only
            global rank 0 writes.
        max_norm: clip the gradients to this total norm after measuring them
            (the Trainer's ``max_grad_norm``, which must then be 0); None to
            only watch.
    """

    def __init__(
        self,
        log: str | os.PathLike[str] | None = "grads.jsonl",
        dump_dir: str | os.PathLike[str] | None = "spikes/",
        *,
        max_norm: float | None = None,
        log_metrics: bool = True,
        **options: Any,
    ):
        if max_norm is not None and not float(max_norm) > 0:
            raise ValueError(f"GradMonitorCallback: max_norm must be > 0, got {max_norm}")
        if not isinstance(log_metrics, bool):
            raise ValueError(
                f"GradMonitorCallback: log_metrics must be True or False, got {log_metrics!r}")
        self.log_path, self.dump_dir, self.options = log, dump_dir, options
        self.log_metrics = log_metrics
        self._logged_step: int | None = None  # the step whose norms the logs have
        self.max_norm = None if max_norm is None else float(max_norm)
        self.monitor: GradMonitor | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        if args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(
                f"GradMonitorCallback: TrainingArguments.max_grad_norm={args.max_grad_norm} "
                "clips the gradients before the callback sees them; set max_grad_norm=0 "
                f"and pass max_norm={args.max_grad_norm} to GradMonitorCallback, which "
                "clips after measuring"
            )
        # Training the same model again goes on with its history; another model
        # (the callback reused in a sweep, or model_init) gets a monitor of its own.
        if self.monitor is None or self.monitor.model is not model:
            self.monitor = GradMonitor(model, self.log_path, self.dump_dir, **self.options)
        if self.log_metrics:
            _lead_the_loggers(self, _calling_handler(self))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                              **kwargs: Any) -> None:
        if self.monitor is None:
            return
        _unscale(optimizer)
        step = state.global_step + 1
        if self.max_norm is None:
            self.monitor.step(step)
        else:
            self.monitor.clip_grad_norm_(self.max_norm, step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        # Here only when the companion could not go first (see _lead_the_loggers).
        self.add_to_logs(state, logs)

    def add_to_logs(self, state: Any, logs: Any) -> None:
        """Add this step's norms to a training log (one with ``loss``) and to its
        ``log_history`` entry, once per step: not to evaluation logs or the summary."""
        record = None if self.monitor is None else self.monitor.last_record
        if (not self.log_metrics or record is None or not isinstance(logs, dict)
                or "loss" not in logs or record["step"] != state.global_step
                or self._logged_step == state.global_step):
            return
        self._logged_step = state.global_step
        values = scalars(record)
        history = state.log_history
        # Trainer.log appends {**logs, "step": global_step} just before calling on_log.
        entry = history[-1] if history else None
        if (isinstance(entry, dict) and entry is not logs
                and entry.get("step") == state.global_step and logs.keys() <= entry.keys()):
            entry.update(values)
        logs.update(values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()


class _TrainerLogs(TrainerCallback):
    """Adds the callback's norms to the Trainer's logs, from the head of its callbacks.

    ``CallbackHandler.call_event`` calls the callbacks in order and the
    Trainer puts its ``report_to`` integrations before the ones passed to it;
    keys added to ``logs`` after an integration has written them would reach
    ``log_history`` and the later callbacks, but not that integration.
    """

    def __init__(self, owner: GradMonitorCallback):
        self.owner = owner

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
               **kwargs: Any) -> None:
        self.owner.add_to_logs(state, logs)


def _calling_handler(owner: GradMonitorCallback) -> Any:
    """The ``CallbackHandler`` whose ``call_event`` is calling ``owner`` now: the
    nearest caller (a few frames up, past a subclass's ``super()`` calls) whose
    ``self`` is one holding ``owner``; None when there is none."""
    from transformers.trainer_callback import CallbackHandler

    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if isinstance(caller, CallbackHandler) and owner in getattr(caller, "callbacks", ()):
            return caller
        frame = frame.f_back
    return None


def _lead_the_loggers(owner: GradMonitorCallback, handler: Any) -> None:
    """Put a ``_TrainerLogs`` of ``owner`` at the head of ``handler``'s callbacks.

    ``handler`` is the Trainer's ``CallbackHandler`` that called
    ``owner.on_train_begin`` (its ``call_event`` calls each callback itself).
    Its list is replaced, not changed in place: the loop calling this event
    goes on over the old one. No handler (a future Trainer calling callbacks
    another way, or a direct call) is a warning: the norms then still reach
    ``log_history`` and the callbacks after this one.
    """
    from transformers.trainer_callback import CallbackHandler

    callbacks = getattr(handler, "callbacks", None)
    if not isinstance(handler, CallbackHandler) or not isinstance(callbacks, list) \
            or owner not in callbacks:
        warnings.warn("GradMonitorCallback: not called by a transformers CallbackHandler; "
                      "the norms reach trainer_state.json's log_history and the callbacks "
                      "after this one, but not report_to integrations listed before it",
                      stacklevel=3)
        return
    if any(isinstance(cb, _TrainerLogs) and cb.owner is owner for cb in callbacks):
        return  # a second train() of the same Trainer
    handler.callbacks = [_TrainerLogs(owner), *callbacks]


def _unscale(optimizer: Any) -> None:
    """Have AMP's loss scaler unscale the gradients, unless it has this step.

    ``optimizer`` is the Trainer's accelerate ``AcceleratedOptimizer``, which
    holds the ``GradScaler`` (None without fp16 AMP). The scaler records per
    optimizer whether ``unscale_`` ran since its last ``update()``; running it
    twice is an error, and ``step()`` skips its own unscaling after one.
    """
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return
    inner = optimizer.optimizer
    if scaler._per_optimizer_states[id(inner)]["stage"] is OptState.READY:
        scaler.unscale_(inner)
