"""Per-layer gradient-norm logging beside the peers, and its share of a training step (CPU).

    .venv/bin/python -m benchmarks.peer_overhead             # small GPT-2, 1 thread, CPU time
    .venv/bin/python -m benchmarks.peer_overhead --steps 30

A small GPT-2 (Hugging Face ``GPT2LMHeadModel`` built from a config: 6
layers, width 256, vocabulary 8,192; batch 4 x 128 tokens) trains on random
tokens with Lightning's ``Trainer`` on the CPU (one thread). In
``on_before_optimizer_step`` (after backward, before the step: where each
is meant to run) three contenders log the gradients' norms, in an order that
rotates every step, each timed with this process's CPU time:

* ``GradMonitor.step()``: per-layer groups (``group_by="layer"``), the
  total, the spike rule, one JSON line a step;
* Lightning's own recipe: ``lightning.pytorch.utilities.grad_norm`` (one
  ``norm`` per parameter, then the total from them) and ``self.log_dict``;
* a plain loop: ``torch.nn.utils.get_total_norm`` and a
  ``torch.linalg.vector_norm`` per parameter, read as floats for a logger.

The training step's own time (forward, backward, optimizer; the contenders
taken out) is the denominator of "share of a step". A second run, without
Lightning, measures the cost of ``GradMonitor(..., locate_nonfinite=True)``:
training steps of two copies of the model alternate, one with the opt-in's
hooks, each followed by a logged ``GradMonitor.step``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from gradclip_cli import GradMonitor  # noqa: E402


def small_gpt2():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=8, vocab_size=8192,
                                     n_positions=128, bos_token_id=None, eos_token_id=None,
                                     loss_type="ForCausalLM")
    return transformers.GPT2LMHeadModel(config)


def batches(steps: int, batch: int = 4, length: int = 128):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 8192, (batch, length), generator=g) for _ in range(steps)]


def peers(steps: int, folder: str) -> dict[str, list[float]]:
    """Seconds per step of each contender, and of the training step without them."""
    import lightning as L

    times: dict[str, list[float]] = {"GradMonitor.step (per layer, logged)": [],
                                     "Lightning grad_norm + log_dict": [],
                                     "get_total_norm + vector_norm per parameter": [],
                                     "training step (forward, backward, optimizer)": []}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = small_gpt2()
            self.monitor = GradMonitor(self.model, os.path.join(folder, "grads.jsonl"), None)
            self.calls = 0

        def training_step(self, tokens, index):
            return self.model(tokens, labels=tokens).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def on_before_optimizer_step(self, optimizer):
            from lightning.pytorch.utilities import grad_norm

            def lightning_recipe():
                self.log_dict(grad_norm(self.model, norm_type=2))

            def plain_loop():
                params = [p for p in self.model.parameters() if p.grad is not None]
                total = torch.nn.utils.get_total_norm([p.grad for p in params])
                values = {n: float(torch.linalg.vector_norm(p.grad))
                          for n, p in self.model.named_parameters() if p.grad is not None}
                values["total"] = float(total)

            contenders = [("GradMonitor.step (per layer, logged)", self.monitor.step),
                          ("Lightning grad_norm + log_dict", lightning_recipe),
                          ("get_total_norm + vector_norm per parameter", plain_loop)]
            shift = self.calls % len(contenders)
            self.calls += 1
            spent = 0.0
            for name, run in contenders[shift:] + contenders[:shift]:
                start = time.process_time()
                run()
                elapsed = time.process_time() - start
                spent += elapsed
                times[name].append(elapsed)
            self.spent = spent

    class StepClock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, index):
            self.start = time.process_time()

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            times["training step (forward, backward, optimizer)"].append(
                time.process_time() - self.start - module.spent)

    module = Module()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[StepClock()])
    loader = torch.utils.data.DataLoader(batches(steps), batch_size=None)
    trainer.fit(module, loader)
    module.monitor.close()
    return {name: values[1:] for name, values in times.items()}  # the first step warms up


def locate_cost(steps: int, folder: str) -> dict[str, list[float]]:
    """Seconds per training step plus a logged monitor step, with and without the opt-in."""
    plain = small_gpt2()
    located = copy.deepcopy(plain)
    runs = {
        "step + GradMonitor.step": (plain, GradMonitor(plain, os.path.join(folder, "a.jsonl"),
                                                       None)),
        "step + GradMonitor.step, locate_nonfinite=True": (
            located, GradMonitor(located, os.path.join(folder, "b.jsonl"), None,
                                 locate_nonfinite=True)),
    }
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4)
                  for name, (model, _) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for step, tokens in enumerate(batches(steps + 1)):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            model, monitor = runs[name]
            start = time.process_time()
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            monitor.step(step)
            optimizers[name].step()
            optimizers[name].zero_grad()
            if step:
                times[name].append(time.process_time() - start)
    for _, monitor in runs.values():
        monitor.close()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only-locate", action="store_true",
                        help="the locate_nonfinite cost alone (no Lightning run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        results = None if args.only_locate else peers(args.steps, folder)
        located = locate_cost(args.steps, folder)
    model = small_gpt2()
    tensors = sum(1 for _ in model.parameters())
    elements = sum(p.numel() for p in model.parameters())
    print(f"small GPT-2: {tensors} tensors, {elements:,} parameters, batch 4 x 128; "
          f"{args.steps} steps (the first one a warm-up), medians of CPU time, "
          f"{torch.get_num_threads()} thread(s); torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, load average "
          f"{os.getloadavg()[0]:.2f}\n")
    if results is not None:
        step = statistics.median(results["training step (forward, backward, optimizer)"])
        print("| per step | median ms | share of a training step |")
        print("| --- | ---: | ---: |")
        for name, values in results.items():
            ms = statistics.median(values) * 1e3
            print(f"| {name} | {ms:.2f} | {ms / (step * 1e3):.1%} |")
        print()
    print("| training step + logged monitor step | median ms |")
    print("| --- | ---: |")
    medians = {name: statistics.median(values) * 1e3 for name, values in located.items()}
    for name, ms in medians.items():
        print(f"| {name} | {ms:.1f} |")
    base, opt_in = medians.values()
    print(f"\nlocate_nonfinite=True costs {opt_in - base:.1f} ms a step "
          f"({(opt_in - base) / base:.1%} of a step with the monitor)")


if __name__ == "__main__":
    main()
