"""Large checkpoints written by the pretraining frameworks themselves, for frameworks_bench.py.

Run in the frameworks venv (the one ``GRADCLIP_FRAMEWORKS_PYTHON`` names for
tests/frameworks), from the repository's root::

    $GRADCLIP_FRAMEWORKS_PYTHON -m benchmarks.framework_checkpoints torchtitan OUT --gb 1.2
    $GRADCLIP_FRAMEWORKS_PYTHON -m benchmarks.framework_checkpoints megatron OUT --gb 1.2

Each is the test fixtures' run script (``tests/frameworks/torchtitan_run.py``,
``megatron_run.py``: the framework's own model, optimizer and saving code,
gloo, the CPU) with the model enlarged until weights plus both AdamW moments
reach ``--gb`` GiB, one training step, no reference loads:

* torchtitan: its Llama 3 (fused ``wqkv``, GQA), ``CheckpointManager``
  writing ``OUT/run/checkpoint/step-1/`` in full (model, optimizer,
  lr_scheduler, train_state);
* Megatron: Megatron-core's ``GPTModel``, its ``dist_checkpointing.save``
  writing ``OUT/run/iter_0000001/`` (``torch_dist``) and the tracker.

``--ranks 2`` saves from two data-parallel gloo ranks (two ``.distcp``
files, the replicated state deduplicated between them).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
BYTES_PER_PARAMETER = 12  # float32 weight, exp_avg and exp_avg_sq


def torchtitan_sizes(gb: float) -> dict:
    """Llama 3 sizes (dim 1024, 16 heads of which 8 key-value, MLP 2816, vocab 16384) with
    enough layers that parameters x 12 bytes reach ``gb`` GiB."""
    dim, kv_heads, heads, hidden, vocab = 1024, 8, 16, 2816, 16384
    per_layer = dim * dim * (2 + 2 * kv_heads / heads) + 3 * dim * hidden + 2 * dim
    rest = 2 * vocab * dim + vocab + dim
    layers = max(1, math.ceil((gb * GIB / BYTES_PER_PARAMETER - rest) / per_layer))
    return dict(
        dim=dim, n_layers=layers, heads=heads, kv_heads=kv_heads, hidden=hidden, vocab=vocab
    )


def megatron_sizes(gb: float) -> dict:
    """GPTModel sizes (hidden 1024, 16 heads, MLP 4 x hidden, vocab 8192, untied output
    layer) with enough layers that parameters x 12 bytes reach ``gb`` GiB."""
    hidden, vocab, sequence = 1024, 8192, 8
    per_layer = 12 * hidden * hidden + 13 * hidden
    rest = 2 * vocab * hidden + sequence * hidden + 2 * hidden
    layers = max(1, math.ceil((gb * GIB / BYTES_PER_PARAMETER - rest) / per_layer))
    return dict(LAYERS=layers, HIDDEN=hidden, HEADS=16, VOCAB=vocab, SEQUENCE=sequence)


def worker(framework: str, out: Path, gb: float) -> None:
    """One torchrun rank: the run script's ``main`` at the enlarged sizes."""
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    dist.init_process_group("gloo")
    try:
        if framework == "torchtitan":
            from tests.frameworks import torchtitan_run

            torchtitan_run.main(out, steps=1, sizes=torchtitan_sizes(gb), reference=False)
        else:
            from tests.frameworks import megatron_run

            for name, value in {**megatron_sizes(gb), "STEPS": 1}.items():
                setattr(megatron_run, name, value)
            megatron_run.main(out, with_reference=False)
    finally:
        dist.destroy_process_group()


def generate(python: str, framework: str, out: Path, gb: float, ranks: int = 1) -> Path:
    """Run the generator under ``torchrun`` in ``python`` (the frameworks venv); returns the
    checkpoint folder it wrote."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "benchmarks.framework_checkpoints",
            "--worker",
            framework,
            str(out),
            "--gb",
            str(gb),
        ],
        cwd=REPO,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    folder = out / "run" / ("checkpoint/step-1" if framework == "torchtitan" else "iter_0000001")
    if not folder.is_dir():
        raise RuntimeError(f"{framework}: the run wrote no {folder}")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("torchtitan", "megatron"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--gb", type=float, default=1.2)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.framework, args.out, args.gb)
        return
    print(generate(sys.executable, args.framework, args.out, args.gb, args.ranks))


if __name__ == "__main__":
    main()
