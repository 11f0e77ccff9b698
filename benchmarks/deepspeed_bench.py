"""Issue 9: ``gradclip inspect`` of a DeepSpeed ZeRO checkpoint against the floor.

A checkpoint is written by DeepSpeed's own CPU training (2 ranks over gloo,
ZeRO stage ``--stage``, one AdamW step of an MLP of about ``--params-m``
million float32 parameters), then inspected as a fresh process each time,
page cache warm:

* floor: a process that imports torch and reads every byte of the
  ``global_stepN/`` folder once;
* ``zero_to_fp32`` + torch: what a user does today for the weights,
  DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` and a norm per tensor;
* gradclip: ``gradclip inspect DIR --what weights`` and ``--what exp_avg``.

    python -m benchmarks.deepspeed_bench --params-m 100 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from .timing import fmt_bytes, fmt_seconds, interleaved, run_process

PYTHON = sys.executable
GRADCLIP = str(Path(sys.executable).with_name("gradclip"))
WIDTH = 2048

FLOOR = """
import sys, glob, torch
buf = bytearray(16 << 20)
for path in sorted(glob.glob(sys.argv[1] + "/*/*.pt")):
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
"""

ZERO_TO_FP32 = """
import sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
state = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
norms = {k: float(torch.linalg.vector_norm(v, dtype=torch.float64)) for k, v in state.items()}
print(sum(n * n for n in norms.values()) ** 0.5)
"""


def _worker(rank: int, port: int, out: str, stage: int, layers: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_SIZE="2")
    import deepspeed
    import torch

    # DeepSpeed's CPU backend JIT-compiles a shared-memory collective (a C++
    # extension, minutes on a fresh machine) on first use; gloo alone does the job.
    # (``deepspeed.comm.torch`` as an attribute is torch itself: take the module.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    engine.backward(engine(torch.randn(1, WIDTH)).square().mean())
    engine.step()
    engine.save_checkpoint(out)


def make_checkpoint(folder: Path, params_m: float, stage: int) -> int:
    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, os.fspath(folder), stage, layers), nprocs=2)
    return layers * (WIDTH * WIDTH + WIDTH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params-m", type=float, default=100.0)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gradclip-deepspeed-bench-"))
    try:
        folder = root / "run"
        params = make_checkpoint(folder, args.params_m, args.stage)
        files = sorted(folder.glob("*/*.pt"))
        size = sum(f.stat().st_size for f in files)
        contenders = {
            "floor (import torch, read every file once)": lambda: run_process(
                [PYTHON, "-c", FLOOR, str(folder)]),
            "`zero_to_fp32` + torch norms (weights)": lambda: run_process(
                [PYTHON, "-c", ZERO_TO_FP32, str(folder)]),
            "`gradclip inspect DIR --what weights`": lambda: run_process(
                [GRADCLIP, "inspect", str(folder), "--what", "weights", "--format", "json",
                 "-q"]),
            "`gradclip inspect DIR --what exp_avg`": lambda: run_process(
                [GRADCLIP, "inspect", str(folder), "--what", "exp_avg", "--format", "json",
                 "-q"]),
        }
        results = interleaved(contenders, args.repeats)
        floor = results["floor (import torch, read every file once)"].median
        print(f"DeepSpeed ZeRO-{args.stage} checkpoint: {params / 1e6:.1f}M float32 "
              f"parameters, 2 ranks, {len(files)} files, {fmt_bytes(size)}; median of "
              f"{args.repeats}, page cache warm\n")
        print("| contender | median | ratio to floor | peak RSS |")
        print("| --- | --- | --- | --- |")
        for name, result in results.items():
            print(f"| {name} | {fmt_seconds(result.median)} | {result.median / floor:.2f}x | "
                  f"{fmt_bytes(result.max_rss)} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
