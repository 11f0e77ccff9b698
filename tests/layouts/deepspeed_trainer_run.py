"""A real Hugging Face ``Trainer`` run under DeepSpeed ZeRO 2, on two CPU processes.

``python -m tests.layouts.deepspeed_trainer_run OUT`` starts 2 processes
(gloo, DeepSpeed's CPU accelerator) that train the tests' tiny GPT-2 for
``STEPS`` steps with ``TrainingArguments(deepspeed=<ZeRO-2 config>)``,
saving ``OUT/checkpoint-N/`` at every step: the Trainer's files
(``trainer_state.json``, ``model.safetensors``, ...) beside DeepSpeed's
``latest``, ``global_stepN/`` and ``zero_to_fp32.py``. The position
embedding ``transformer.wpe.weight`` is frozen (``requires_grad=False``):
DeepSpeed saves it as a frozen parameter, weights without optimizer state.

No ``optimizer`` section in the config: the Trainer builds its own
``torch.optim.AdamW`` (two param groups, decayed and not) and DeepSpeed
wraps it. After training, ``OUT/reference.pt`` holds, for every trainable
parameter, what DeepSpeed's own API assembles from the partitions
(``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``): the
tests' per-parameter reference for the last checkpoint.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path

from tests.layouts.deepspeed_runs import spawn

WORLD = 2
STEPS = 3
LR = 1e-3
FROZEN = "transformer.wpe.weight"
# The Trainer's AdamW defaults (TrainingArguments adam_beta1/2, adam_epsilon).
BETAS, EPS = (0.9, 0.999), 1e-8


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    from tests.layouts.conftest import CONTEXT, VOCAB, tiny_gpt2

    # As deepspeed_runs.py: gloo alone, without the JIT-compiled shared-memory collective.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.set_num_threads(1)

    class Tokens(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, VOCAB, (4 * STEPS, CONTEXT), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": 2}}
    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, save_steps=1, per_device_train_batch_size=2,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.1, use_cpu=True,
        report_to=[], logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        deepspeed=config, ddp_backend="gloo",
    )
    model = tiny_gpt2()
    model.get_parameter(FROZEN).requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
    # DeepSpeed links each parameter to its optimizer state after the first
    # optimizer.step() call, which ZeRO 2 makes one param group at a time: the
    # second group's parameters get linked before their state exists. Link again,
    # with DeepSpeed's own code, now that every group's state does.
    zero = trainer.model_wrapped.optimizer
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    reference = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        reference[name] = {"weight": safe_get_full_fp32_param(param).detach().clone(),
                           **{key: safe_get_full_optimizer_state(param, key).detach().clone()
                              for key in ("exp_avg", "exp_avg_sq")}}
    if rank == 0:
        torch.save(reference, os.path.join(out, "reference.pt"))


def build(out: Path) -> None:
    spawn(_worker, out)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    build(Path(sys.argv[1]))
