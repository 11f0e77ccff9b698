"""Inspecting real checkpoints: every number against float64 computed here from the raw files.

The references never go through gradclip: the optimizer state comes from
``torch.load``, the weights from ``safe_open``, the mapping of optimizer ids to
names from the model and ``Trainer.get_decay_parameter_names`` (the grouping
the Trainer itself used), and the bias correction is done by hand.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.cli.support import rel_err, unwrapped

from .conftest import tiny_gpt2

TOL = 1e-6  # the contract's accuracy; the references are float64


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}


def _norm(tensors) -> float:
    tensors = list(tensors)
    if not tensors:
        return 0.0
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm())


def _trainer_reference(checkpoint: Path):
    """name -> (exp_avg_hat, grad_rms, update) in float64, mapped as the Trainer grouped them."""
    from transformers import Trainer

    model = tiny_gpt2()
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters()]
    order = [n for n, _ in named if n in decay] + [n for n, _ in named if n not in decay]
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    group_of = {pid: g for g in saved["param_groups"] for pid in g["params"]}
    out = {}
    for pid, name in enumerate(order):
        state, group = saved["state"][pid], group_of[pid]
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        m = state["exp_avg"].double() / (1 - beta1**step)
        v = state["exp_avg_sq"].double() / (1 - beta2**step)
        out[name] = (m, v.sqrt(), group["lr"] * m / (v.sqrt() + group["eps"]))
    return out


@pytest.mark.parametrize("what, column", [("exp_avg", 0), ("grad_rms", 1), ("update", 2)])
def test_trainer_checkpoint_moments(gradclip, trainer_run, what, column):
    reference = _trainer_reference(trainer_run)
    weights = _safetensors(trainer_run / "model.safetensors")
    result = gradclip("inspect", trainer_run, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == what and doc["step"] == 4 and doc["format"] == "hf-trainer"
    assert rel_err(doc["total_norm"], _norm(r[column] for r in reference.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(reference)
    for name, row in rows.items():
        expected = reference[name][column]
        assert rel_err(row["norm"], _norm([expected])) <= TOL, name
        assert rel_err(row["ratio"], _norm([expected]) / _norm([weights[name]])) <= TOL, name
    for group in doc["groups"]:
        members = [n for n, r in rows.items() if r["group"] == group["name"]]
        ratio = _norm(reference[n][column] for n in members) / _norm(weights[n] for n in members)
        assert rel_err(group["ratio"], ratio) <= TOL, group["name"]


def test_trainer_checkpoint_auto_is_exp_avg_and_says_so(gradclip, trainer_run):
    result = gradclip("inspect", trainer_run)
    assert result.code == 0, result.err
    shown = unwrapped(result.out)
    assert "what: exp_avg" in shown
    assert "Trainer checkpoint at global_step 4: model.safetensors, optimizer.pt" in shown
    measured = gradclip("inspect", trainer_run, "--format", "json").json()["measured"]
    assert measured == {
        "what": "exp_avg", "evidence": "the Trainer's optimizer.pt",
        "explain": "AdamW first moment exp_avg / (1 - beta1^step), each parameter's own step",
        "chosen": "--what auto: no gradients saved"}


def test_trainer_checkpoint_weights_and_no_grads(gradclip, trainer_run):
    weights = _safetensors(trainer_run / "model.safetensors")
    doc = gradclip("inspect", trainer_run, "--what", "weights", "--format", "json").json()
    assert doc["what"] == "weights"
    assert rel_err(doc["total_norm"], _norm(weights.values())) <= TOL
    result = gradclip("inspect", trainer_run, "--what", "grads")
    assert result.code == 3
    assert result.err_lines == [
        f"gradclip: {trainer_run}: --what grads: a Trainer checkpoint holds no gradients; "
        "it holds AdamW state (exp_avg, exp_avg_sq); available: --what exp_avg, "
        "--what grad_rms, --what update, --what weights"]


def test_lightning_checkpoint(gradclip, lightning_ckpt):
    saved = torch.load(lightning_ckpt, weights_only=True)
    names = list(saved["state_dict"])  # module order: the order of parameters()
    optimizer = saved["optimizer_states"][0]
    beta1, _ = optimizer["param_groups"][0]["betas"]
    expected = {}
    for pid, name in enumerate(names):
        state = optimizer["state"][pid]
        expected[name] = state["exp_avg"].double() / (1 - beta1 ** float(state["step"]))
    doc = gradclip("inspect", lightning_ckpt, "--what", "exp_avg", "--format", "json").json()
    assert doc["what"] == "exp_avg" and doc["format"] == "lightning"
    assert doc["step"] == saved["global_step"] == 3
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    for row in doc["tensors"]:
        assert rel_err(row["norm"], _norm([expected[row["name"]]])) <= TOL
        ratio = _norm([expected[row["name"]]]) / _norm([saved["state_dict"][row["name"]]])
        assert rel_err(row["ratio"], ratio) <= TOL


@pytest.mark.parametrize("what", ["grad_rms", "update", "weights"])
def test_lightning_checkpoint_other_quantities(gradclip, lightning_ckpt, what):
    """The rest of what a Lightning .ckpt holds, per parameter, against float64 from the
    file as torch.load reads it (the moments mapped by module order, as above)."""
    saved = torch.load(lightning_ckpt, weights_only=True)
    optimizer = saved["optimizer_states"][0]
    group = optimizer["param_groups"][0]
    beta1, beta2 = group["betas"]
    expected = {}
    for pid, (name, weight) in enumerate(saved["state_dict"].items()):
        state = optimizer["state"][pid]
        m = state["exp_avg"].double() / (1 - beta1 ** float(state["step"]))
        v = state["exp_avg_sq"].double() / (1 - beta2 ** float(state["step"]))
        expected[name] = {"grad_rms": v.sqrt(), "weights": weight.double(),
                          "update": group["lr"] * m / (v.sqrt() + group["eps"])}[what]
    doc = gradclip("inspect", lightning_ckpt, "--what", what, "--format", "json").json()
    assert doc["what"] == what
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    assert {row["name"] for row in doc["tensors"]} == set(expected)
    for row in doc["tensors"]:
        assert rel_err(row["norm"], _norm([expected[row["name"]]])) <= TOL, row["name"]


@pytest.mark.parametrize("given", ["folder", "index"])
@pytest.mark.parametrize("fixture", ["sharded_pretrained", "sharded_bin"])
def test_sharded_set_one_total(gradclip, request, fixture, given):
    folder = request.getfixturevalue(fixture)
    index = next(folder.glob("*.index.json"))
    shards = sorted(folder.glob("*-of-*"))
    assert len(shards) > 3
    tensors = {}
    for shard in shards:
        part = (_safetensors(shard) if shard.suffix == ".safetensors"
                else torch.load(shard, weights_only=True))
        tensors.update(part)
    result = gradclip("inspect", folder if given == "folder" else index, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["format"] == "hf-sharded"
    assert doc["description"][0] == f"{index.name}: {len(tensors)} tensors in {len(shards)} shards"
    assert rel_err(doc["total_norm"], _norm(tensors.values())) <= TOL
    assert all("ratio" not in row for row in doc["tensors"])  # weights are not their own ratio


def test_one_shard_alone_says_so(gradclip, sharded_pretrained):
    shard = sorted(sharded_pretrained.glob("*-of-*"))[1]
    result = gradclip("inspect", shard)
    assert result.code == 0, result.err
    assert (f"covers shard {shard.name} only; the whole checkpoint is indexed by "
            "model.safetensors.index.json") in result.out
    doc = gradclip("inspect", shard, "--format", "json").json()
    assert rel_err(doc["total_norm"], _norm(_safetensors(shard).values())) <= TOL


def test_a_plain_file_with_sgd_momentum_is_listed(gradclip, tmp_path):
    model = torch.nn.Linear(4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    sgd.step()
    path = tmp_path / "sgd.pt"
    torch.save({"model": model.state_dict(), "optimizer": sgd.state_dict()}, path)
    result = gradclip("inspect", path, "--what", "exp_avg")
    assert result.code == 3
    assert result.err_lines == [
        f"gradclip: {path}: --what exp_avg: SGD: its momentum buffer is a sum, not an average; "
        "it holds SGD state (momentum_buffer); available: --what update, --what weights"]
    doc = gradclip("inspect", path, "--what", "weights", "--format", "json").json()
    assert rel_err(doc["total_norm"], _norm(model.state_dict().values())) <= TOL


def test_param_names_map_directly(gradclip, tmp_path):
    # torch >= 2.6 stores param_names when the optimizer is given named parameters.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    adam = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    state = adam.state_dict()
    assert "param_names" in state["param_groups"][0]
    path = tmp_path / "named.pt"
    torch.save({"optimizer": state}, path)  # no weights: the names alone map the state
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "exp_avg"
    by_name = dict(zip(state["param_groups"][0]["param_names"], state["param_groups"][0]["params"]))
    for row in doc["tensors"]:
        m = state["state"][by_name[row["name"]]]["exp_avg"].double() / (1 - 0.9)
        assert rel_err(row["norm"], _norm([m])) <= TOL
    assert math.isclose(doc["total_norm"], _norm(
        s["exp_avg"].double() / (1 - 0.9) for s in state["state"].values()), rel_tol=TOL)


def test_grads_beside_weights_get_ratio(gradclip):
    # training_state.pt: grads, the model (lm_head tied to wte) and AdamW after one step.
    from tests.cli.support import SAMPLES

    saved = torch.load(SAMPLES / "training_state.pt", weights_only=True)
    doc = gradclip("inspect", SAMPLES / "training_state.pt", "--format", "json").json()
    assert doc["what"] == "grads"
    for row in doc["tensors"]:
        ratio = _norm([saved["grads"][row["name"]]]) / _norm([saved["model"][row["name"]]])
        assert rel_err(row["ratio"], ratio) <= TOL, row["name"]
    exp_avg = gradclip("inspect", SAMPLES / "training_state.pt", "--what", "exp_avg",
                       "--format", "json").json()
    # One step: exp_avg_hat == (0.1 * g) / (1 - 0.9) == g, the saved gradient itself.
    assert rel_err(exp_avg["total_norm"], doc["total_norm"]) <= 1e-5


def test_a_folder_with_two_indexes_asks_for_one(gradclip, sharded_pretrained, sharded_bin,
                                                 tmp_path):
    both = tmp_path / "both"
    shutil.copytree(sharded_pretrained, both)
    for f in sharded_bin.iterdir():
        shutil.copy(f, both / f.name)
    result = gradclip("inspect", both)
    assert result.code == 3
    assert result.err_lines == [
        f"gradclip: {both}: holds several indexes (model.safetensors.index.json, "
        "pytorch_model.bin.index.json); give the one to read"]
    assert gradclip("inspect", both / "pytorch_model.bin.index.json").code == 0


def test_lightning_checkpoint_with_saved_grads_is_clipped_whole(gradclip, lightning_ckpt,
                                                                tmp_path):
    saved = torch.load(lightning_ckpt, weights_only=True)
    total = _norm(saved["grads"].values())
    doc = gradclip("inspect", lightning_ckpt, "--format", "json").json()
    assert doc["what"] == "grads" and rel_err(doc["total_norm"], total) <= TOL
    out = tmp_path / "clipped.ckpt"
    result = gradclip("clip", lightning_ckpt, "--max-norm", str(total / 4), "-o", out)
    assert result.code == 0, result.err
    clipped = torch.load(out, weights_only=True)
    assert rel_err(_norm(clipped["grads"].values()), total / 4) <= 1e-5
    assert set(clipped) == set(saved)
    for name, weight in saved["state_dict"].items():
        assert torch.equal(clipped["state_dict"][name], weight)
    assert clipped["optimizer_states"][0]["param_groups"] == saved["optimizer_states"][0][
        "param_groups"]
    assert clipped["global_step"] == saved["global_step"]


def test_ci_formats_carry_what_and_ratio(gradclip, trainer_run):
    """markdown and junit say what was measured and give each group's ratio, read back by
    a CommonMark + GFM parser and by ElementTree, equal to the float64 reference."""
    import xml.etree.ElementTree as ET

    from tests.format.test_ci_formats import cells

    reference = _trainer_reference(trainer_run)
    weights = _safetensors(trainer_run / "model.safetensors")
    doc = gradclip("inspect", trainer_run, "--what", "update", "--format", "json").json()
    members = {g["name"]: [t["name"] for t in doc["tensors"] if t["group"] == g["name"]]
               for g in doc["groups"]}

    def expected(group: str) -> float:
        return (_norm(reference[n][2] for n in members[group])
                / _norm(weights[n] for n in members[group]))

    markdown = gradclip("inspect", trainer_run, "--what", "update", "--format", "markdown")
    assert markdown.code == 0 and "update at step 4: 28 tensors" in markdown.out
    groups_table, top_table = markdown.out.split("**Top 5 tensors by norm**")
    header, *rows = cells(groups_table)
    assert header[:3] == ["group", "norm", "ratio"]
    assert cells(top_table)[0][:3] == ["tensor", "norm", "ratio"]
    by_group = {row[0]: row for row in rows}
    assert set(by_group) == {*members, "total"}
    for group in members:
        assert rel_err(float(by_group[group][2].rstrip("x")), expected(group)) <= 1e-5, group

    junit = gradclip("inspect", trainer_run, "--what", "update", "--format", "junit")
    cases = ET.fromstring(junit.out).iter("testcase")
    said = {case.get("name"): case.findtext("system-out") for case in cases}
    for group in members:
        text = said[group]
        assert text.startswith("update: norm "), text
        ratio = float(text.split("ratio ")[1].split("x")[0])
        assert rel_err(ratio, expected(group)) <= 1e-5, group
