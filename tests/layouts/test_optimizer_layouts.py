"""Optimizer state as the libraries write it: each optimizer's own quantities, or a refusal.

Fixtures run the real writers once per session: transformers' ``Trainer``
with Adafactor and with SGD (momentum) and accelerate's ``save_state`` (CPU,
no FSDP). timm's and litgpt's real checkpoints are made in the frameworks
venv (``tests/frameworks/test_timm.py``, ``test_litgpt.py``). Every number is
checked against float64 computed here from the raw files (``torch.load``,
``safe_open``), never through gradclip.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.cli.support import rel_err

from .conftest import CONTEXT, VOCAB, tiny_gpt2

TOL = 1e-6


def _norm(tensors) -> float:
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm())


def _trainer(out: Path, **optim) -> Path:
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, VOCAB, (12, CONTEXT), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    args = TrainingArguments(
        output_dir=os.fspath(out), max_steps=3, save_steps=3, per_device_train_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", use_cpu=True, report_to=[],
        disable_tqdm=True, seed=0, dataloader_num_workers=0, **optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens()).train()
    return out / "checkpoint-3"


@pytest.fixture(scope="session")
def trainer_adafactor(tmp_path_factory) -> Path:
    return _trainer(tmp_path_factory.mktemp("trainer_adafactor"), optim="adafactor")


@pytest.fixture(scope="session")
def trainer_sgd(tmp_path_factory) -> Path:
    return _trainer(tmp_path_factory.mktemp("trainer_sgd"), optim="sgd",
                    optim_args="momentum=0.9")


def _by_name(checkpoint: Path) -> dict[str, tuple[dict, dict]]:
    """name -> (state, group) of optimizer.pt, mapped as the Trainer grouped them."""
    from transformers import Trainer

    model = tiny_gpt2()
    decay = set(Trainer.get_decay_parameter_names(None, model))
    names = [n for n, _ in model.named_parameters()]
    order = [n for n in names if n in decay] + [n for n in names if n not in decay]
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    group_of = {pid: g for g in saved["param_groups"] for pid in g["params"]}
    return {n: (saved["state"][pid], group_of[pid]) for pid, n in enumerate(order)}


def test_trainer_adafactor_grad_rms_is_its_factored_estimate(gradclip, trainer_adafactor):
    expected = {}
    for name, (s, _) in _by_name(trainer_adafactor).items():
        if "exp_avg_sq_row" in s:
            r, c = s["exp_avg_sq_row"].double(), s["exp_avg_sq_col"].double()
            expected[name] = ((r / r.mean(-1, keepdim=True))[:, None] * c[None, :]).sqrt()
        else:
            expected[name] = s["exp_avg_sq"].double().sqrt()
    doc = gradclip("inspect", trainer_adafactor, "--what", "grad_rms", "--format", "json").json()
    assert doc["measured"]["explain"].startswith("Adafactor (transformers) gradient RMS")
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    for row in doc["tensors"]:
        assert rel_err(row["norm"], _norm([expected[row["name"]]])) <= TOL, row["name"]
        assert row["shape"] == list(expected[row["name"]].shape)


def test_trainer_adafactor_refuses_what_it_does_not_hold(gradclip, trainer_adafactor):
    auto = gradclip("inspect", trainer_adafactor, "--format", "json").json()
    assert auto["what"] == "weights"  # no Adam moments: the contract's fallback
    for what, why in (("update", "without beta1 its last step needs the last gradient"),
                      ("exp_avg", "keeps no first moment")):
        result = gradclip("inspect", trainer_adafactor, "--what", what)
        assert result.code == 3
        line = result.err_lines[0]
        assert f"--what {what}: Adafactor (transformers): " in line
        assert line.endswith("available: --what grad_rms, --what weights"), line
        if what == "update":
            assert why in line


def test_trainer_sgd_momentum_update(gradclip, trainer_sgd):
    expected = {n: g["lr"] * s["momentum_buffer"].double()
                for n, (s, g) in _by_name(trainer_sgd).items()}
    doc = gradclip("inspect", trainer_sgd, "--what", "update", "--format", "json").json()
    assert doc["measured"]["explain"].startswith("SGD last update")
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    for row in doc["tensors"]:
        assert rel_err(row["norm"], _norm([expected[row["name"]]])) <= TOL, row["name"]
    result = gradclip("inspect", trainer_sgd, "--what", "exp_avg")
    assert result.code == 3
    assert result.err_lines[0].endswith("available: --what update, --what weights")


@pytest.fixture(scope="session")
def accelerate_state(tmp_path_factory) -> Path:
    """``Accelerator(cpu=True).save_state`` after 3 AdamW steps of a small CNN."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3),
                                torch.nn.Flatten(), torch.nn.Linear(48, 2))
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(step))
        accelerator.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("accelerate") / "state"
    accelerator.save_state(os.fspath(out))
    return out


def test_accelerate_optimizer_bin_alone(gradclip, accelerate_state):
    saved = torch.load(accelerate_state / "optimizer.bin", weights_only=True)
    group = saved["param_groups"][0]
    b1, b2 = group["betas"]
    expected = []
    for s in saved["state"].values():
        t = float(s["step"])
        m = s["exp_avg"].double() / (1 - b1**t)
        v = s["exp_avg_sq"].double() / (1 - b2**t)
        expected.append(group["lr"] * m / (v.sqrt() + group["eps"]))
    doc = gradclip("inspect", accelerate_state / "optimizer.bin", "--what", "update",
                   "--format", "json").json()
    assert doc["measured"]["evidence"] == "a state dict with state and param_groups"
    assert rel_err(doc["total_norm"], _norm(expected)) <= TOL
    weights = gradclip("inspect", accelerate_state / "model.safetensors", "--format",
                       "json").json()
    assert weights["what"] == "weights"
    assert weights["measured"]["evidence"] == "a model's buffers: 1.num_batches_tracked"
    with safe_open(str(accelerate_state / "model.safetensors"), framework="pt") as f:
        params = [f.get_tensor(k) for k in f.keys() if "running" not in k
                  and "num_batches" not in k]
    assert rel_err(weights["total_norm"], _norm(params)) <= TOL


def test_every_refusal_on_these_layouts_offers_only_what_works(
        gradclip, tmp_path, trainer_run, trainer_adafactor, trainer_sgd, accelerate_state,
        sharded_pretrained):
    from tests.cli.test_cli_roles import walk_refusals

    paths = [trainer_run, trainer_adafactor, trainer_sgd, accelerate_state / "optimizer.bin",
             accelerate_state / "model.safetensors", sharded_pretrained]
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    assert refusals >= 2 * len(paths) and followed > len(paths)
