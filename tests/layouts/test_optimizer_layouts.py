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

from tests.cli.support import assert_quantities_refused, rel_err

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
    assert_quantities_refused(gradclip, trainer_adafactor, "Adafactor (transformers)", {
        "update": "without beta1 its last step needs the last gradient",
        "exp_avg": "its exp_avg averages the scaled updates"},
        available="--what grad_rms, --what weights")


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


def _adam_expected(optimizer_file: Path, what: str) -> list[torch.Tensor]:
    """Each parameter's ``what`` in float64 from the raw ``optimizer.bin`` (AdamW, one group)."""
    saved = torch.load(optimizer_file, weights_only=True)
    group = saved["param_groups"][0]
    b1, b2 = group["betas"]
    out = []
    for pid in group["params"]:
        s = saved["state"][pid]
        t = float(s["step"])
        m = s["exp_avg"].double() / (1 - b1**t)
        v = s["exp_avg_sq"].double() / (1 - b2**t)
        out.append({"exp_avg": m, "grad_rms": v.sqrt(),
                    "update": group["lr"] * m / (v.sqrt() + group["eps"])}[what])
    return out


def _weights(model_file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()
                if "running" not in k and "num_batches" not in k}


@pytest.mark.parametrize("what", ["auto", "exp_avg", "grad_rms", "update", "weights"])
def test_accelerate_save_state_folder_is_one_checkpoint(gradclip, accelerate_state, what):
    doc = gradclip("inspect", accelerate_state, "--what", what, "--format", "json").json()
    assert doc["format"] == "accelerate"
    saved = torch.load(accelerate_state / "optimizer.bin", weights_only=True)
    assert doc["step"] == int(saved["state"][0]["step"]) == 3
    if what == "weights":
        expected = _weights(accelerate_state / "model.safetensors").values()
        assert doc["measured"]["evidence"] == \
            "an accelerate save_state folder: model.safetensors"
    else:
        expected = _adam_expected(accelerate_state / "optimizer.bin",
                                  "exp_avg" if what == "auto" else what)
        assert doc["what"] == ("exp_avg" if what == "auto" else what)
        assert doc["measured"]["evidence"] == "an accelerate save_state folder: optimizer.bin"
        # model.safetensors sorts its names and the optimizer was given bare parameters:
        # measured under the optimizer's ids, and the report says why.
        assert [t["name"] for t in sorted(doc["tensors"], key=lambda t: t["name"])] == \
            [f"state.{i}" for i in range(len(expected))]
        assert any("named by parameter id" in line for line in doc["description"])
    assert rel_err(doc["total_norm"], _norm(expected)) <= TOL
    assert "random_states_0.pkl not read" in doc["description"][0]


def test_accelerate_pytorch_model_bin_maps_by_model_order(gradclip, accelerate_state):
    folder = accelerate_state.parent / "state_bin"
    model = torch.load(folder / "pytorch_model.bin", weights_only=True)
    params = [n for n in model if "running" not in n and "num_batches" not in n]
    moments = dict(zip(params, _adam_expected(folder / "optimizer.bin", "update")))
    doc = gradclip("inspect", folder, "--what", "update", "--format", "json").json()
    assert doc["step"] == 3 and [t["name"] for t in doc["tensors"]] == params
    for t in doc["tensors"]:
        assert rel_err(t["norm"], _norm([moments[t["name"]]])) <= TOL, t["name"]
        assert rel_err(t["ratio"], t["norm"] / _norm([model[t["name"]]])) <= TOL
    assert not any("named by parameter id" in line for line in doc["description"])


def test_accelerate_several_models_are_refused(gradclip, tmp_path, accelerate_state):
    import shutil

    copy = tmp_path / "state"
    shutil.copytree(accelerate_state, copy)
    shutil.copy(copy / "model.safetensors", copy / "model_1.safetensors")
    result = gradclip("inspect", copy)
    assert result.code == 3 and len(result.err_lines) == 1
    assert "model_1.safetensors" in result.err and "give the file to read" in result.err


def test_accelerate_save_state_never_opens_its_pickles(gradclip, tmp_path, accelerate_state):
    import pickle
    import shutil

    copy = tmp_path / "state"
    shutil.copytree(accelerate_state, copy)
    marker = tmp_path / "ran"

    class Runs:  # what an unpickler would run: a file appears
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (copy / "random_states_0.pkl").write_bytes(pickle.dumps(Runs()))
    (copy / "sampler.bin").write_bytes(pickle.dumps(Runs()))
    for flags in ((), ("--trust-pickle",)):
        result = gradclip("inspect", copy, *flags, "--format", "json")
        assert result.code == 0, result.err
        assert not marker.exists()
    assert gradclip("inspect", copy, "--what", "grads").code == 3


def test_accelerate_named_state_maps_to_layers(gradclip, accelerate_auto_runs):
    folder = accelerate_auto_runs / "checkpoint_1"
    saved = torch.load(folder / "optimizer.bin", weights_only=True)
    names = saved["param_groups"][0]["param_names"]
    moments = dict(zip(names, _adam_expected(folder / "optimizer.bin", "exp_avg")))
    weights = _weights(folder / "model.safetensors")
    doc = gradclip("inspect", folder, "--format", "json").json()
    assert doc["what"] == "exp_avg" and doc["step"] == 4
    assert {t["name"] for t in doc["tensors"]} == set(names)
    for g in doc["groups"]:
        members = [n for n in names if n.split(".")[0] == g["name"]]
        assert rel_err(g["norm"], _norm([moments[n] for n in members])) <= TOL
        assert rel_err(g["ratio"], g["norm"] / _norm([weights[n] for n in members])) <= TOL
    assert [g["name"] for g in doc["groups"]] == ["0", "1", "3"]


def test_accelerate_automatic_naming_trends_by_step(gradclip, accelerate_auto_runs):
    doc = gradclip("trend", accelerate_auto_runs, "--format", "json").json()
    assert doc["what"] == "exp_avg"
    assert [p["step"] for p in doc["points"]] == [2, 4]
    for point, name in zip(doc["points"], ("checkpoint_0", "checkpoint_1")):
        assert point["source"].endswith(name)
        expected = _adam_expected(accelerate_auto_runs / name / "optimizer.bin", "exp_avg")
        assert rel_err(point["total_norm"], _norm(expected)) <= TOL
    # The save folder itself is a run, not a checkpoint: inspect names the command.
    result = gradclip("inspect", accelerate_auto_runs)
    assert result.code == 3 and "gradclip trend" in result.err


def test_every_refusal_on_these_layouts_offers_only_what_works(
        gradclip, tmp_path, trainer_run, trainer_adafactor, trainer_sgd, accelerate_state,
        sharded_pretrained):
    from tests.cli.support import walk_refusals

    paths = [trainer_run, trainer_adafactor, trainer_sgd, accelerate_state / "optimizer.bin",
             accelerate_state / "model.safetensors", accelerate_state, sharded_pretrained]
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    assert refusals >= 2 * len(paths) and followed > len(paths)


@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_is_never_measured_as_sgd(gradclip, tmp_path, nesterov):
    """torch.optim.Muon keeps SGD's ``momentum_buffer``, but its step orthogonalises
    the momentum: no ``lr * buffer`` (SGD's step) is reported for it, with or without
    Nesterov, and the default measures the weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    muon = torch.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=0.02,
                            nesterov=nesterov)
    for step in range(2):
        muon.zero_grad()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        muon.step()
    path = tmp_path / "muon.pt"
    torch.save({"model": model.state_dict(), "optimizer": muon.state_dict()}, path)
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "weights"
    assert rel_err(doc["total_norm"], _norm(model.state_dict().values())) <= TOL
    assert_quantities_refused(gradclip, path, "Muon", {
        "update": "its step orthogonalises the momentum (Newton-Schulz",
        "exp_avg": "its momentum is an average kept without a step count"})
    from tests.cli.support import walk_refusals

    refusals, followed = walk_refusals(gradclip, [path], tmp_path)
    assert refusals >= 3 and followed >= 3


def test_optimizer_state_keyed_by_names(gradclip, tmp_path):
    """torch's own ``get_state_dict`` (``torch.distributed.checkpoint.state_dict``, also
    what FSDP's ``optim_state_dict`` gives) keys the optimizer state by parameter name:
    read as named state, the numbers those of the names it gives, saved with or without
    the model."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    for step in range(2):
        adamw.zero_grad()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        adamw.step()
    weights, optim = get_state_dict(model, adamw)
    assert set(optim["state"]) == set(weights)  # keyed by name, not by id
    expected = {n: s["exp_avg"].double() / (1 - 0.8 ** float(s["step"]))
                for n, s in optim["state"].items()}
    both, alone = tmp_path / "both.pt", tmp_path / "optim.pt"
    torch.save({"model": weights, "optim": optim}, both)
    torch.save(optim, alone)
    for path in (both, alone):
        doc = gradclip("inspect", path, "--format", "json").json()
        assert doc["what"] == "exp_avg"
        assert sorted(t["name"] for t in doc["tensors"]) == sorted(expected)
        assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
        for row in doc["tensors"]:
            assert rel_err(row["norm"], _norm([expected[row["name"]]])) <= TOL, row["name"]
    stray = {"state": {**optim["state"], "ghost.weight": optim["state"]["0.weight"]},
             "param_groups": optim["param_groups"]}
    torch.save({"model": weights, "optim": stray}, alone)
    result = gradclip("inspect", alone)
    assert result.code == 3
    assert result.err_lines == [
        f"gradclip: {alone}: 'optim' is not an optimizer state dict: state holds "
        "'ghost.weight', which no param group names"]
