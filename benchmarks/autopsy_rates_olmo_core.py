"""Does ``gradclip autopsy`` name the layer a spike was injected into on real OLMo-core runs?

``benchmarks/autopsy_rates.py``'s question for a pretraining framework: OLMo-core's
tiny ``olmo2_1M`` transformer in its ``TransformerTrainModule`` (AdamW), 1 rank,
``STEPS`` steps, checkpointed by OLMo-core's own ``Checkpointer`` every ``EVERY``
steps and at the steps before, at and after the spike, watched by gradclip's
``GradMonitor`` (``tests/frameworks/olmo_core_spike_run.py`` trains it, in the
frameworks venv: ai2-olmo-core pins its own dependencies). With injection, at
``SPIKE_STEP`` one layer's gradients (a different layer and factor for each seed)
are multiplied by 20, 50 or 100 before the monitor and the optimizer see them.

The autopsy is run on the run's folder as a user would (``gradclip autopsy
FOLDER --format json``): injected, it must exit 1 and rank the injected layer
first with its onset at ``SPIKE_STEP``; on the same seed without injection it
must find nothing to explain (exit 0, status ``nothing``).

    GRADCLIP_FRAMEWORKS_PYTHON=/path/to/frameworks-venv/bin/python \\
        PYTHONPATH=. .venv/bin/python -m benchmarks.autopsy_rates_olmo_core --seeds 10

``--runs DIR`` keeps each run in ``DIR/seedN-injected`` or ``DIR/seedN-clean`` and
reuses one already there (a run is deterministic in its seed), so the autopsy
can be measured again, after a change to gradclip, on the same runs.

``--batch N`` trains each step on N sequences of random tokens (the generator's
``--batch``; default ``BATCH``, 8 sequences of 16 tokens): the larger the batch,
the less a step's gradient varies with the tokens drawn. Kept runs of another
batch are named ``DIR/seedN-batchN-injected`` / ``-clean``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "tests" / "frameworks" / "olmo_core_spike_run.py"
SPIKE_STEP = 35  # as the generator's
BATCH = 8  # sequences per step, as the generator's default
LAYERS = ("blocks.0", "blocks.1", "embeddings", "lm_head.w_out")
FACTORS = (20.0, 50.0, 100.0)


def injection(seed: int) -> tuple[str, float]:
    """The layer and factor of ``seed``'s spike: every layer and factor in turn."""
    return LAYERS[seed % len(LAYERS)], FACTORS[seed % len(FACTORS)]


def make_run(python: str, out: Path, seed: int, injected: bool, batch: int = BATCH) -> Path:
    """One real OLMo-core run of ``batch`` sequences a step into ``out``; the run's
    folder (``out/run``)."""
    extra = [injection(seed)[0], f"{injection(seed)[1]:g}"] if injected else []
    if batch != BATCH:
        extra += ["--batch", str(batch)]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    command = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(GENERATOR),
        str(out),
        str(seed),
        *extra,
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{GENERATOR.name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return out / "run"


def autopsy(folder: Path, *extra: str) -> tuple[int, dict]:
    """``gradclip autopsy FOLDER --format json``, as a user runs it: exit code and document."""
    done = subprocess.run(
        [sys.executable, "-m", "gradclip_cli", "autopsy", str(folder), "--format", "json", *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, json.loads(done.stdout)


def judged(layer: str | None, code: int, doc: dict) -> tuple[bool, str]:
    """Whether the autopsy got the run right (``layer``: the injected one, None for a clean
    run), and what it said."""
    first = doc["groups"][0] if doc["groups"] else None
    name = None if first is None else first["name"]
    onset = None if first is None else first["onset"]
    said = f"exit {code}, {doc['status']}, step {doc['step']}, first {name} (onset {onset})"
    if layer is None:
        return code == 0 and doc["status"] == "nothing", said
    return (
        code == 1 and doc["status"] == "explained" and name == layer and onset == SPIKE_STEP
    ), said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--runs", type=Path, default=None,
                        help="keep the runs here and reuse those already there")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help=f"sequences of random tokens per step (default {BATCH})")
    options = parser.parse_args(argv)
    if options.batch < 1:
        parser.error("--batch must be 1 or more")
    python = os.environ.get("GRADCLIP_FRAMEWORKS_PYTHON")
    if not python:
        parser.error(
            "GRADCLIP_FRAMEWORKS_PYTHON must name the frameworks venv's python (.ci/run builds one)"
        )
    seeds = range(options.first_seed, options.first_seed + options.seeds)
    start = time.perf_counter()
    print(
        f"autopsy on real OLMo-core runs (olmo2_1M, 1 rank): spike at step {SPIKE_STEP} "
        f"x{FACTORS} in one of {LAYERS}; {options.batch} sequences a step; "
        f"seeds {seeds.start}-{seeds.stop - 1}; "
        f"{platform.machine()}"
    )
    print()
    print(
        "| run | injected: layer named first, onset at its step | explained step = the "
        "injected one | clean: nothing to explain |"
    )
    print("| --- | ---: | ---: | ---: |")
    hits = clean_ok = at_step = 0
    misses = []
    for seed in seeds:
        for injected in (True, False):
            if options.runs is not None:
                batch = "" if options.batch == BATCH else f"batch{options.batch}-"
                kind = "injected" if injected else "clean"
                out = options.runs / f"seed{seed}-{batch}{kind}"
                folder = out / "run"
                if not (out / "reference" / "spike.pt").exists():
                    shutil.rmtree(out, ignore_errors=True)  # a run cut short
                    folder = make_run(python, out, seed, injected, options.batch)
                code, doc = autopsy(folder)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    folder = make_run(python, Path(tmp), seed, injected, options.batch)
                    code, doc = autopsy(folder)
            layer = injection(seed)[0] if injected else None
            good, said = judged(layer, code, doc)
            if injected:
                hits += good
                at_step += doc["step"] == SPIKE_STEP
                if good and doc["step"] != SPIKE_STEP:
                    misses.append(
                        f"seed {seed} ({layer} x{injection(seed)[1]:g}): named first "
                        f"at its step; the step explained: {said}"
                    )
            else:
                clean_ok += good
            if not good:
                what = f"{layer} x{injection(seed)[1]:g}" if injected else "clean"
                misses.append(f"seed {seed} ({what}): {said}")
    ok = hits == len(seeds) == clean_ok
    print(
        f"| OLMo-core, batch {options.batch}, {len(seeds)} seeds | {hits} / {len(seeds)} | "
        f"{at_step} / {len(seeds)} | {clean_ok} / {len(seeds)} |"
    )
    for miss in misses:
        print(f"  - {miss}")
    print()
    print(
        f"{time.perf_counter() - start:.0f} s; goal (every injected layer named first at its "
        f"step, nothing in every clean run): {'met' if ok else 'NOT met'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
