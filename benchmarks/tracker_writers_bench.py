"""What writing the monitor's norms to a tracker costs per logged step.

    .venv/bin/python -m benchmarks.tracker_writers_bench [--groups 1000] [--repeats 21]

One process, a model of ``--groups`` small linear layers (one group each,
``group_by="layer"``) with seeded gradients. Contenders alternate within each
repetition (timing.interleaved); medians are printed:

- ``monitor``: ``GradMonitor.step`` with its JSON Lines log only;
- ``monitor + tensorboard``: the same with ``tensorboard=DIR`` (one
  ``Summary`` event per step through torch's ``SummaryWriter``);
- ``add_scalar per tag``: torch's ``SummaryWriter.add_scalar`` once per tag
  of the same step, the way the writer does not do it (the reason it does not).

Then real Lightning fits (CPU, ``--lightning-steps`` steps, a CSV logger)
with the callback's ``log_metrics`` off, and on with ``log_every_n_steps``
1 and 50 (Lightning's default): the mean time per step of the
``on_before_optimizer_step`` hook, which measures, logs the line and (on,
on the steps Lightning sends to its loggers) calls ``log_dict`` with every
group's norm.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gradclip_cli import GradMonitor
from gradclip_cli.tracker_scalars import scalars

from .timing import interleaved


def layers(groups: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(groups)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def writer_contenders(groups: int, folder: Path) -> dict:
    from torch.utils.tensorboard import SummaryWriter

    model = layers(groups)
    plain = GradMonitor(model, folder / "plain.jsonl", None)
    board = GradMonitor(model, folder / "board.jsonl", None, tensorboard=folder / "tb")
    writer = SummaryWriter(str(folder / "tb_add_scalar"))
    record = plain.step(0)
    values = scalars(record)
    steps = iter(range(1, 10**9))

    def add_scalar_per_tag():
        step = next(steps)
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)

    return {"monitor": lambda: plain.step(next(steps)),
            "monitor + tensorboard": lambda: board.step(next(steps)),
            "add_scalar per tag": add_scalar_per_tag}


def lightning_hook_seconds(groups: int, steps: int, folder: Path, log_metrics: bool,
                           every: int) -> float:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from gradclip_cli.integrations.lightning import GradMonitorCallback

    class Timed(GradMonitorCallback):
        seconds: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            start = time.perf_counter()
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
            self.seconds.append(time.perf_counter() - start)

    class Stack(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = layers(groups)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * steps, 8))
    name = f"{log_metrics}-{every}"
    callback = Timed(folder / f"lightning-{name}.jsonl", None, log_metrics=log_metrics)
    callback.seconds = []
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[callback],
                         logger=CSVLogger(folder, name=f"csv-{name}"),
                         log_every_n_steps=every, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=folder)
    trainer.fit(Stack(), torch.utils.data.DataLoader(data, batch_size=8))
    return statistics.mean(callback.seconds[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--lightning-steps", type=int, default=102)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results = interleaved(writer_contenders(args.groups, folder), args.repeats)
        base = results["monitor"].median
        print(f"{args.groups} groups, medians of {args.repeats}:")
        for name, result in results.items():
            print(f"  {name:<24} {result.median * 1e3:8.2f} ms  ({result.median / base:.2f}x)")
        n = args.lightning_steps
        off = lightning_hook_seconds(args.groups, n, folder, False, 1)
        print(f"Lightning on_before_optimizer_step, mean of steps 3-{n}:")
        print(f"  log_metrics=False                  {off * 1e3:8.2f} ms")
        for every in (1, 50):
            on = lightning_hook_seconds(args.groups, n, folder, True, every)
            print(f"  log_metrics=True, every {every:<2} steps    {on * 1e3:8.2f} ms  "
                  f"({on / off:.2f}x)")


if __name__ == "__main__":
    main()
