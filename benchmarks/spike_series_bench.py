"""The monitor's per-group spike rule: plain floats or tensors, by number of groups.

``SpikeSeries`` keeps one ``SpikeDetector`` per series (plain float
arithmetic, no tensor op) up to ``FEW_SERIES`` series, and one
``SpikeDetectors`` (float64 tensors) beyond. This times one logged step of
both ways side by side, on the same seeded calm norms (lognormal around
per-series sizes, a 10x spike now and then), for several numbers of series:
during the warm-up (steps 5 to 24, judged against the seed) and after it
(steps 26 on, running averages). Within each step the two alternate who goes
first; medians over the steps of a phase, best of ``--repeats`` runs.

    .venv/bin/python -m benchmarks.spike_series_bench
    .venv/bin/python -m benchmarks.spike_series_bench --clock cpu   # on a loaded machine

Over a run of T logged steps the floats cost less while
``25 * warm_floats + (T - 25) * after_floats`` stays below the tensors' sum.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from gradclip_cli.core.spikes import DEFAULT_WARMUP, FEW_SERIES, SpikeSeries

from .timing import markdown_table

STEPS = 60
WARMING = range(5, DEFAULT_WARMUP - 1)  # judged against the seed
AFTER = range(DEFAULT_WARMUP + 1, STEPS)  # running averages


def norms(count: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    size = [rng.uniform(0.01, 10) for _ in range(count)]
    return [
        torch.tensor([s * rng.lognormvariate(0, 0.2) * (10 if rng.random() < 0.01 else 1)
                      for s in size], dtype=torch.float64)
        for _ in range(STEPS)
    ]


def one_run(count: int, seed: int, clock) -> dict[str, list[float]]:
    """Seconds per step of each way, stepping both through the same norms."""
    rules = {"floats": SpikeSeries(few=count), "tensors": SpikeSeries(few=0)}
    for rule in rules.values():
        rule.add(count)
    seconds: dict[str, list[float]] = {name: [] for name in rules}
    names = list(rules)
    for t, x in enumerate(norms(count, seed)):
        decided = {}
        for name in names[t % 2:] + names[:t % 2]:
            start = clock()
            decided[name] = rules[name].spikes(x, None)
            seconds[name].append(clock() - start)
        assert decided["floats"] == decided["tensors"], (count, t)
    return seconds


def median_us(runs: list[dict[str, list[float]]], name: str, steps: range) -> float:
    """Microseconds: the median over ``steps`` of each step's best run."""
    return 1e6 * statistics.median(min(r[name][t] for r in runs) for t in steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--counts", default="4,8,16,32,48,64,128,1000")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for count in map(int, args.counts.split(",")):
        runs = [one_run(count, seed, clock) for seed in range(args.repeats)]
        cells = [median_us(runs, n, p) for p in (WARMING, AFTER) for n in ("floats", "tensors")]
        rows.append([count, *(f"{c:.0f}" for c in cells),
                     f"{cells[0] / cells[1]:.2f}x", f"{cells[2] / cells[3]:.2f}x",
                     "floats" if count <= FEW_SERIES else "tensors"])
    print(f"torch {torch.__version__}, {args.threads} thread(s), "
          f"{'CPU' if args.clock == 'cpu' else 'wall'} time, microseconds per logged step\n")
    print(markdown_table(
        ["series", "warm-up: floats", "warm-up: tensors", "after: floats", "after: tensors",
         "warm-up floats/tensors", "after floats/tensors", f"used (FEW_SERIES = {FEW_SERIES})"],
        rows))


if __name__ == "__main__":
    main()
