"""Optimizer state measured under its ids (``state.N``) always says why (issue 41, item 9).

docs/reference/contract.md: "Where no mapping can be made (no model beside the state, or a
model file whose names are sorted), the state is measured under its ids
(``state.N``), never under guessed names, and the report says why". Every
layout that can produce ``state.N`` is built by the library that writes it
(accelerate's ``save_state``, a real Trainer run, ``torch.save`` of an
optimizer's ``state_dict()``), and each report carries the one wording
(``source/what.py``'s ``named_by_id``) with its own reason. The totals are
checked against float64 sums of the saved moments: the ids change no number.
"""

from __future__ import annotations

import shutil

import torch

from tests.cli.support import rel_err

PREFIX = "optimizer state named by parameter id (state.N): "
SUFFIX = ("and the optimizer stored no param_names (one given model.named_parameters() stores "
          "them); names are never guessed")


def exp_avg_norm(state_dict: dict) -> float:
    b1 = state_dict["param_groups"][0]["betas"][0]
    total = 0.0
    for s in state_dict["state"].values():
        total += float((s["exp_avg"].double() / (1 - b1 ** float(s["step"]))).square().sum())
    return total**0.5


def the_note(doc: dict) -> str:
    [note] = [line for line in doc["description"] if line.startswith(PREFIX)]
    assert note.endswith(SUFFIX), note
    return note


def assert_under_ids(doc: dict, saved: dict) -> None:
    assert doc["what"] == "exp_avg"
    assert sorted(t["name"] for t in doc["tensors"]) == sorted(f"state.{i}" for i in saved["state"])
    assert rel_err(doc["total_norm"], exp_avg_norm(saved)) <= 1e-6


def test_a_bare_optimizer_bin_says_there_is_no_model(gradclip, accelerate_state, tmp_path):
    shutil.copy(accelerate_state / "optimizer.bin", tmp_path / "optimizer.bin")
    saved = torch.load(tmp_path / "optimizer.bin", weights_only=True)
    doc = gradclip("inspect", tmp_path / "optimizer.bin", "--format", "json").json()
    assert_under_ids(doc, saved)
    assert the_note(doc) == (f"{PREFIX}no model weights beside the optimizer state to take the "
                             f"names from, {SUFFIX}")
    # Every format carries it: the table's header too.
    table = gradclip("inspect", tmp_path / "optimizer.bin")
    assert "named by parameter id (state.N): no model weights" in " ".join(table.out.split())


def test_an_optimizer_entry_of_a_training_state_says_there_is_no_model(gradclip, tmp_path):
    # A plain loop's own training state (torchtune's recipe_state.pt has this shape:
    # an "optimizer" entry beside counters, no model).
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save({"optimizer": opt.state_dict(), "epochs_run": 1, "seed": 0}, tmp_path / "state.pt")
    doc = gradclip("inspect", tmp_path / "state.pt", "--format", "json").json()
    assert_under_ids(doc, opt.state_dict())
    assert "no model weights beside the optimizer state" in the_note(doc)


def test_accelerate_save_state_says_the_safetensors_sorts_its_names(gradclip, accelerate_state):
    saved = torch.load(accelerate_state / "optimizer.bin", weights_only=True)
    doc = gradclip("inspect", accelerate_state, "--format", "json").json()
    assert_under_ids(doc, saved)
    assert the_note(doc) == f"{PREFIX}model.safetensors sorts its names, {SUFFIX}"
    # Weights are named as stored: no note where no state is measured.
    weights = gradclip("inspect", accelerate_state, "--what", "weights", "--format", "json")
    assert not any(line.startswith(PREFIX) for line in weights.json()["description"])


def test_a_trainer_checkpoint_without_its_config_is_measured_under_ids_not_refused(
    gradclip, trainer_run, tmp_path
):
    # Without config.json the model's order is unknown (model.safetensors sorts its
    # names): the contract's ids and the reason, where this was a refusal (exit 3).
    folder = tmp_path / "checkpoint-4"
    shutil.copytree(trainer_run, folder)
    (folder / "config.json").unlink()
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    result = gradclip("inspect", folder, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert_under_ids(doc, saved)
    assert the_note(doc) == (f"{PREFIX}the model's weights are stored sorted by name, not in "
                             f"the model's order, {SUFFIX}")


def test_a_mapped_state_carries_no_such_note(gradclip, trainer_run):
    doc = gradclip("inspect", trainer_run, "--format", "json").json()
    assert doc["what"] == "exp_avg"
    assert not any(t["name"].startswith("state.") for t in doc["tensors"])
    assert not any(line.startswith(PREFIX) for line in doc["description"])


def tampered(accelerate_state, tmp_path, name, shape):
    """The save_state folder with one tensor of model.safetensors given another shape
    (rewritten with safetensors' own writer)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "state"
    shutil.copytree(accelerate_state, folder)
    weights = load_file(folder / "model.safetensors")
    weights[name] = torch.zeros(shape)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_weight_whose_shape_no_state_has_is_a_contradiction_naming_both_files(
    gradclip, accelerate_state, tmp_path
):
    # The Linear's weight [2, 48] rewritten as [2, 47]: under ids the order is unknown,
    # but no order makes the optimizer's [2, 48] moment a parameter of this model.
    folder = tampered(accelerate_state, tmp_path, "3.weight", (2, 47))
    saved = torch.load(folder / "optimizer.bin", weights_only=True)
    [pid] = [i for i, s in saved["state"].items() if tuple(s["exp_avg"].shape) == (2, 48)]
    for what in ("exp_avg", "auto", "update"):
        r = gradclip("inspect", folder, "--what", what)
        assert r.code == 3 and len(r.err_lines) == 1, r.err
        assert r.err_lines[0] == (
            f"gradclip: {folder / 'optimizer.bin'}: state.{pid}'s exp_avg has shape [2, 48], "
            "which no parameter of model.safetensors has (model.safetensors holds 3.weight as "
            "[2, 47]): the optimizer state and the model weights of this checkpoint "
            "contradict each other; available: --what weights")
    # The weights alone are measured as they are: nothing maps state to them.
    assert gradclip("inspect", folder, "--what", "weights").code == 0


def test_a_shape_held_fewer_times_than_the_state_holds_it_is_a_contradiction(
    gradclip, accelerate_state, tmp_path
):
    # BatchNorm's weight [3] rewritten as [4]: the state holds three [3] moments (the
    # conv's bias, the norm's weight and bias), the weights two [3] parameters (its
    # running statistics are buffers, not parameters).
    folder = tampered(accelerate_state, tmp_path, "1.weight", (4,))
    r = gradclip("inspect", folder, "--format", "json")
    assert r.code == 3
    error = r.json()["error"]
    assert "has shape [3], as 3 state tensors do, which only 2 parameter(s) of " \
           "model.safetensors have (model.safetensors holds 1.weight as [4])" in error
    assert error.startswith(f"{folder / 'optimizer.bin'}: state.")
