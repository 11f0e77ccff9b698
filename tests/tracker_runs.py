"""Tracker files written by the trackers' own libraries, for ``trend``'s tracker readers.

Each writer logs the same series (``NORMS``: a calm gradient norm with a
50-fold spike at ``SPIKE_STEP``) through the real library: torch's and
tensorboard's ``SummaryWriter``s, ``mlflow`` to a file store and to SQLite,
``trackio``, ``wandb`` offline. trackio and wandb read their settings from
the environment when they are imported, so they write from a process of
their own. The numbers a test compares against are ``NORMS``, rounded to
float32 where the tracker stores float32 (TensorBoard).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STEPS = 40
SPIKE_STEP = 30
SPIKE_SCALE = 50.0
TAG = "train/grad_norm"


def norm_at(step: int) -> float:
    calm = 1.0 + 0.05 * math.sin(step)
    return calm * SPIKE_SCALE if step == SPIKE_STEP else calm


NORMS = {step: norm_at(step) for step in range(STEPS)}


def float32(value: float) -> float:
    import struct

    return struct.unpack("<f", struct.pack("<f", value))[0]


def needs(module: str):
    """The tracker's library, or a skip naming it (they come with the test extra)."""
    return pytest.importorskip(module)


def write_torch_tensorboard(folder: Path, *, new_style: bool = False, tag: str = TAG,
                            norms: dict[int, float] | None = None,
                            double: bool = False) -> Path:
    """torch's ``SummaryWriter``: ``simple_value`` (default) or a tensor summary
    (``new_style``), float64 with ``double``."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, value in (NORMS if norms is None else norms).items():
        writer.add_scalar(tag, value, step, new_style=new_style or double,
                          double_precision=double)
        writer.add_scalar("train/loss", 2.0 - step / 100, step)
    writer.close()
    return _event_file(folder)


def write_tensorboard_writer(folder: Path, *, tag: str = TAG) -> Path:
    """tensorboard's own ``tensorboard.summary.Writer`` (tensor summaries only)."""
    from tensorboard.summary import Writer

    writer = Writer(str(folder))
    for step, value in NORMS.items():
        writer.add_scalar(tag, value, step)
    writer.close()
    return _event_file(folder)


def _event_file(folder: Path) -> Path:
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    return files[0]


def write_mlflow(stores: dict[str, dict[str, dict[int, float]]], *, cwd: Path,
                 tag: str = TAG) -> None:
    """``mlflow`` logging, for each tracking URI (``file:...``, ``sqlite:///...``), each of
    its runs (name -> norms by step), from one process (importing mlflow is most of
    the time)."""
    _write_in_process(f"""
        import json
        import mlflow
        STORES = json.loads({json.dumps(stores)!r})
        for uri, runs in STORES.items():
            mlflow.set_tracking_uri(uri)
            for name, norms in runs.items():
                with mlflow.start_run(run_name=name):
                    for step, value in norms.items():
                        mlflow.log_metrics({{{tag!r}: value, "loss": 1.0}}, step=int(step))
        """, cwd, {"MLFLOW_ALLOW_FILE_STORE": "true"})


def write_trackio(folder: Path, *, runs: tuple[str, ...] = ("calm-run",)) -> Path:
    """``trackio`` logging to project ``proj`` in ``folder``; returns its database."""
    _write_in_process(f"""
        import trackio
        {_NORMS_FROM_JSON.format(json.dumps(NORMS))}
        for name in {runs!r}:
            trackio.init(project="proj", name=name)
            for step, value in NORMS.items():
                trackio.log({{{TAG!r}: value, "loss": 1.0}}, step=step)
            trackio.finish()
        """, folder, {"TRACKIO_DIR": str(folder), "HF_HOME": str(folder / "hf")})
    return folder / "proj.db"


def write_wandb_offline(folder: Path, *, global_step: bool = False, name: str = "calm-run",
                        norms: dict[int, float] | None = None) -> Path:
    """``wandb`` in offline mode; returns the run's ``wandb/offline-run-*`` folder.

    ``global_step``: log as the Hugging Face Trainer's W&B callback does:
    ``define_metric("*", step_metric="train/global_step")``, each call with
    ``train/global_step`` (here 5 x the step) and no ``step=``, and an evaluation
    logged between, so W&B's own ``_step`` is not the training step."""
    logging = """
        run.define_metric("train/global_step")
        run.define_metric("*", step_metric="train/global_step", step_sync=True)
        for step, value in NORMS.items():
            run.log({"train/grad_norm": float(value), "train/global_step": 5 * step})
            run.log({"eval/loss": 1.0, "train/global_step": 5 * step})
        """ if global_step else """
        for step, value in NORMS.items():
            run.log({"train/grad_norm": float(value), "loss": 1.0}, step=step)
        """
    start = textwrap.dedent(f"""
        import wandb
        {_NORMS_FROM_JSON.format(json.dumps(NORMS if norms is None else norms))}
        run = wandb.init(project="p", name={name!r}, dir={str(folder)!r})
        """)
    _write_in_process(start + textwrap.dedent(logging) + "run.finish()\n", folder,
                      {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                       "WANDB_DIR": str(folder)})
    runs = sorted((folder / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


# The series as JSON text inside a writer's script: one line, NaN and Infinity included.
_NORMS_FROM_JSON = "import json; NORMS = {{int(k): v for k, v in json.loads({!r}).items()}}"


def _write_in_process(script: str, cwd: Path, env: dict[str, str]) -> None:
    cwd.mkdir(parents=True, exist_ok=True)
    script = textwrap.dedent(script)
    done = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]


LIGHTNING_STEPS = 30
LIGHTNING_SPIKE_STEP = 20
LIGHTNING_LAYERS = ("layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias")


def train_lightning(folder: Path) -> dict[int, dict[str, float]]:
    """A real Lightning run logging ``grad_norm`` (Lightning's own utility) from
    ``on_before_optimizer_step`` (before Lightning clips) through a TensorBoardLogger and a
    CSVLogger, both into
    ``folder/lightning_logs/version_0/``; the loss is scaled 1000-fold at
    ``LIGHTNING_SPIKE_STEP``. Returns the float64 norms of every step's gradients:
    ``{step: {"total": ..., parameter: ...}}``."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.utilities import grad_norm

    torch.manual_seed(0)
    reference: dict[int, dict[str, float]] = {}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer1 = torch.nn.Linear(4, 8)
            self.layer2 = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer2(torch.tanh(self.layer1(x))), y)
            return loss * 1000.0 if self.global_step == LIGHTNING_SPIKE_STEP else loss

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(grad_norm(self, norm_type=2))
            norms = {n: p.grad.double().norm().item() for n, p in self.named_parameters()}
            norms["total"] = math.sqrt(sum(v * v for v in norms.values()))
            reference[self.global_step] = norms

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(LIGHTNING_STEPS * 4, 4),
                                          torch.randn(LIGHTNING_STEPS * 4, 1))
    loggers = [TensorBoardLogger(str(folder), name="lightning_logs", version=0),
               CSVLogger(str(folder), name="lightning_logs", version=0)]
    trainer = pl.Trainer(max_steps=LIGHTNING_STEPS, logger=loggers, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         # clipped after on_before_optimizer_step logged the norms: the
                         # spike does not throw the weights off for the steps after it
                         gradient_clip_val=1.0)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
    return reference


LIGHTNING_CHECKPOINTED_STEPS = 14
LIGHTNING_CHECKPOINTED_SPIKE_STEP = 10


def train_lightning_checkpointed(folder: Path, *, steps: int = LIGHTNING_CHECKPOINTED_STEPS,
                                 spike_step: int = LIGHTNING_CHECKPOINTED_SPIKE_STEP,
                                 log_every_n_steps: int = 1,
                                 resumed_at: int | None = None) -> Path:
    """A real Lightning run with Adam, no clipping, logging its total gradient norm
    (Lightning's ``grad_norm``) from ``on_before_optimizer_step`` through a CSVLogger
    into ``folder/lightning_logs/version_0/``, and a ``ModelCheckpoint`` after every
    step into ``folder/ckpts/step=N.ckpt``; the loss is scaled 1000-fold at
    ``LIGHTNING_CHECKPOINTED_SPIKE_STEP`` (``spike_step``); ``log_every_n_steps`` as
    Lightning's (it logs the steps N with N + 1 a multiple). Lightning's loggers number a
    step's values by
    ``trainer.global_step`` before its update (from 0), while ``step=N.ckpt`` holds the
    state after N updates: the spike's gradient is first in ``step=11.ckpt``.
    ``resumed_at``: the run stops after that many steps and a new ``Trainer`` resumes it
    from ``step=<resumed_at>.ckpt`` (``fit(ckpt_path=...)``), logging into ``version_1/``
    from the step it resumed at. Returns the checkpoints' folder."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities import grad_norm

    torch.manual_seed(0)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(4, 8)
            self.l2 = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.l2(torch.tanh(self.l1(x))), y)
            return loss * 1000.0 if self.global_step == spike_step else loss

        def on_before_optimizer_step(self, optimizer):
            self.log("grad_norm", grad_norm(self, norm_type=2)["grad_2.0_norm_total"])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(steps * 4, 4), torch.randn(steps * 4, 1))

    def fit(max_steps: int, version: int, ckpt_path: str | None = None) -> None:
        checkpoints = ModelCheckpoint(dirpath=str(folder / "ckpts"), every_n_train_steps=1,
                                      save_top_k=-1, filename="{step}")
        trainer = pl.Trainer(max_steps=max_steps, log_every_n_steps=log_every_n_steps,
                             logger=CSVLogger(str(folder), name="lightning_logs",
                                              version=version),
                             callbacks=[checkpoints], enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", devices=1)
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4),
                    ckpt_path=ckpt_path)

    if resumed_at is None:
        fit(steps, 0)
    else:
        fit(resumed_at, 0)
        fit(steps, 1, str(folder / "ckpts" / f"step={resumed_at}.ckpt"))
    return folder / "ckpts"
