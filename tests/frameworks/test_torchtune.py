"""torchtune output folders: real runs of its ``full_finetune_single_device`` recipe
(``torchtune_run.py``), one with one AdamW and one with ``optimizer_in_bwd``.

References never go through gradclip: ``torch.load`` of the files the recipe
wrote (the model shard of each epoch and ``recipe_state.pt``), the optimizer's
ids taken in the model's parameter order (torchtune's recipe builds AdamW from
``model.parameters()``), and the moments' bias corrections and updates in float64.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.cli.support import rel_err

from .support import (
    QUANTITIES,
    TOL,
    RunsCode,
    adam_measured,
    matches_reference,
    norm,
    one_line_exit_3,
    same_under_torchrun,
    skip_without_frameworks,
)

skip_without_frameworks()

SHARD = "model-00001-of-00001.bin"
RECIPE = Path("recipe_state") / "recipe_state.pt"
STEPS = {0: 2, 1: 4, 2: 6}  # 2 optimizer steps per epoch


@pytest.fixture(scope="module", params=["run", "in_bwd"])
def run(request, torchtune_runs) -> Path:
    return torchtune_runs / request.param


def _shard(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    return torch.load(run / f"epoch_{epoch}" / SHARD, weights_only=True)


def _by_name(run: Path) -> tuple[dict, dict]:
    """``{fqn: state}`` and ``{fqn: hyperparameters}`` of recipe_state.pt's optimizer."""
    recipe = torch.load(run / RECIPE, weights_only=True)
    saved = recipe["optimizer"]
    if "state" in saved:  # one AdamW over model.parameters(): ids in the model's order
        names = list(_shard(run, 1))
        group_of = {pid: g for g in saved["param_groups"] for pid in g["params"]}
        return (
            {names[p]: s for p, s in saved["state"].items()},
            {names[p]: group_of[p] for p in saved["state"]},
        )
    # optimizer_in_bwd: one optimizer per parameter, keyed by its name
    return (
        {n: o["state"][0] for n, o in saved.items()},
        {n: o["param_groups"][0] for n, o in saved.items()},
    )


def test_the_fixture_is_torchtunes_output_folder(run):
    recipe = torch.load(run / RECIPE, weights_only=True)
    progress = ("epochs_run", "total_epochs", "max_steps_per_epoch")
    assert [recipe[k] for k in progress] == [2, 3, 2]
    state, _ = _by_name(run)
    assert set(state) == set(_shard(run, 1))
    assert {float(s["step"]) for s in state.values()} == {4.0}
    assert sorted(p.name for p in run.glob("epoch_*")) == ["epoch_0", "epoch_1", "epoch_2"]


@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_of_the_epoch_with_the_recipe_state(gradclip, run, what):
    expected = adam_measured(*_by_name(run), what)
    weights = _shard(run, 1)
    result = gradclip("inspect", run / "epoch_1", "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("torchtune", 4, what)
    matches_reference(doc, expected, weights)
    layer = [f for f in expected if f.startswith("layers.1.")]
    group = {g["name"]: g for g in doc["groups"]}["layers.1"]
    assert rel_err(group["norm"], norm(expected[f] for f in layer)) <= TOL
    assert (
        rel_err(group["ratio"], norm(expected[f] for f in layer) / norm(weights[f] for f in layer))
        <= TOL
    )


def _weights_of_epoch(gradclip, run: Path, epoch: int, weights: dict) -> dict:
    """inspect --what weights of ``epoch_N``: torchtune's step, and each tensor's norm
    against float64 of ``weights`` (the raw shard); the JSON report."""
    result = gradclip("inspect", run / f"epoch_{epoch}", "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"]) == ("torchtune", STEPS[epoch])
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(weights)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([weights[name]])) <= TOL, name
    return doc


@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_weights_and_step_of_every_epoch(gradclip, run, epoch):
    weights = _shard(run, epoch)
    doc = _weights_of_epoch(gradclip, run, epoch, weights)
    assert rel_err(doc["total_norm"], norm(weights.values())) <= TOL


def test_auto_measures_the_first_moment_where_the_optimizer_is(gradclip, run):
    paired = gradclip("inspect", run / "epoch_1", "--format", "json")
    assert paired.code == 0, paired.err
    assert paired.json()["what"] == "exp_avg"
    for epoch in (0, 2):  # recipe_state.pt is epoch_1's: these hold weights alone
        alone = gradclip("inspect", run / f"epoch_{epoch}", "--format", "json")
        assert alone.code == 0, alone.err
        assert alone.json()["what"] == "weights"


def test_the_output_folder_is_its_newest_epoch(gradclip, run):
    result = gradclip("inspect", run, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["what"], doc["step"]) == ("weights", 6)
    assert rel_err(doc["total_norm"], norm(_shard(run, 2).values())) <= TOL
    table = gradclip("inspect", run)
    assert "epoch_2" in table.out and "is epoch_1's (epochs_run 2)" in table.out
    refused = gradclip("inspect", run, "--what", "exp_avg")
    assert refused.code == 3 and len(refused.err_lines) == 1, refused.err
    assert refused.err_lines[0].endswith("available: --what weights"), refused.err


def test_a_run_stopped_before_its_last_epoch(gradclip, run, tmp_path):
    """The folder as it stood after epoch 1's save (the run stopped in its last epoch):
    the newest epoch and the recipe state are one checkpoint, as torchtune resumes it."""
    stopped = tmp_path / "stopped"
    shutil.copytree(run, stopped, ignore=lambda d, names: ["epoch_2"] if d == str(run) else [])
    expected = adam_measured(*_by_name(run), "update")
    result = gradclip("inspect", stopped, "--what", "update", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["step"] == 4
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL


def test_trend_over_the_output_folder(gradclip, run):
    result = gradclip("trend", run, "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    points = result.json()["points"]
    assert [p["step"] for p in points] == [2, 4, 6]
    for point, epoch in zip(points, (0, 1, 2)):
        assert point["source"].endswith(f"epoch_{epoch}")
        assert rel_err(point["total_norm"], norm(_shard(run, epoch).values())) <= TOL


def test_no_gradients_says_what_it_holds(gradclip, run, tmp_path):
    grads = gradclip("inspect", run / "epoch_1", "--what", "grads")
    one_line_exit_3(
        grads,
        "a torchtune checkpoint saves no gradients",
        "--what exp_avg, --what grad_rms, --what update, --what weights",
    )
    keyed = gradclip("inspect", run / "epoch_1", "--key", "optimizer")
    one_line_exit_3(keyed, "--key 'optimizer'", "saves no gradients")
    clip = gradclip("clip", run / "epoch_1", "--max-norm", "1", "-o", tmp_path / "out")
    assert clip.code == 3 and "--what" not in clip.err, clip.err


def test_every_refusal_offers_only_what_works(gradclip, torchtune_runs, tmp_path):
    from tests.cli.support import walk_refusals

    paths = [
        torchtune_runs / "run",
        torchtune_runs / "run" / "epoch_1",
        torchtune_runs / "in_bwd" / "epoch_1",
        torchtune_runs / "in_bwd" / "epoch_0",
    ]
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    assert refusals >= 2 * len(paths) and followed > len(paths)


# ------------------------------------------------------------------------ LoRA


@pytest.mark.parametrize("what", QUANTITIES)
def test_lora_adapter_moments_named_by_the_lora_models_order(gradclip, torchtune_runs, what):
    """The optimizer was given every parameter of the LoRA model (torchtune's
    ``named_parameters()`` order, ``reference/lora_names.json``); only the adapter's have
    state. Their names come from that order, their ratio from ``adapter_model.pt``."""
    run = torchtune_runs / "lora"
    names = json.loads((torchtune_runs / "reference" / "lora_names.json").read_text())
    saved = torch.load(run / RECIPE, weights_only=True)["optimizer"]
    assert len(saved["param_groups"][0]["params"]) == len(names)
    group = saved["param_groups"][0]
    state = {names[p]: s for p, s in saved["state"].items()}
    expected = adam_measured(state, {n: group for n in state}, what)
    adapter = torch.load(run / "epoch_0" / "adapter_model.pt", weights_only=True)
    assert set(expected) == set(adapter)  # the trained parameters are the adapter's
    doc = gradclip("inspect", run / "epoch_0", "--what", what, "--format", "json").json()
    assert (doc["step"], doc["what"]) == (2, what)
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
        assert rel_err(row["ratio"], norm([expected[name]]) / norm([adapter[name]])) <= TOL, name
    weights = _shard(run, 0)  # the model with the adapter merged in
    doc = gradclip("inspect", run / "epoch_0", "--what", "weights", "--format", "json").json()
    assert rel_err(doc["total_norm"], norm(weights.values())) <= TOL


# ------------------------------------------------- LoRA, adapter weights only


def test_the_adapter_only_fixture_holds_no_model_shard(torchtune_runs):
    run = torchtune_runs / "lora_adapter"
    for epoch in (0, 1):
        files = {p.name for p in (run / f"epoch_{epoch}").iterdir()}
        assert {"adapter_model.pt", "adapter_model.safetensors", "adapter_config.json"} <= files
        assert not any(n.startswith("model-") for n in files)
    assert torch.load(run / RECIPE, weights_only=True)["epochs_run"] == 1


def test_adapter_only_epochs_measure_the_adapters_weights(gradclip, torchtune_runs):
    """``save_adapter_weights_only``: an epoch holds the adapter alone. Its weights are
    measured as the adapter's, never called the model's; the output folder's epochs make
    a trend of them, at torchtune's steps."""
    run = torchtune_runs / "lora_adapter"
    for epoch, step in ((0, 2), (1, 4)):
        adapter = torch.load(run / f"epoch_{epoch}" / "adapter_model.pt", weights_only=True)
        result = gradclip("inspect", run / f"epoch_{epoch}", "--what", "weights",
                          "--format", "json")
        assert result.code == 0, result.err
        doc = result.json()
        assert (doc["format"], doc["step"]) == ("torchtune", step)
        assert "LoRA adapter" in doc["measured"]["explain"]
        assert "model weights" not in doc["measured"]["explain"]
        rows = {t["name"]: t for t in doc["tensors"]}
        assert set(rows) == set(adapter)
        for name, row in rows.items():
            assert rel_err(row["norm"], norm([adapter[name]])) <= TOL, name
        assert rel_err(doc["total_norm"], norm(adapter.values())) <= TOL
    trend = gradclip("trend", run, "--what", "weights", "--format", "json")
    assert trend.code == 0, trend.err
    assert [p["step"] for p in trend.json()["points"]] == [2, 4]


@pytest.mark.parametrize("what", QUANTITIES)
def test_adapter_only_epoch_measures_its_optimizer_under_its_ids(gradclip, torchtune_runs, what):
    """The optimizer was given every parameter of the LoRA model; an adapter-only epoch
    holds no model to name them by: measured exactly under the ids, the report saying why."""
    run = torchtune_runs / "lora_adapter"
    saved = torch.load(run / RECIPE, weights_only=True)["optimizer"]
    group = saved["param_groups"][0]
    state = {f"state.{p}": s for p, s in saved["state"].items()}
    expected = adam_measured(state, {n: group for n in state}, what)
    result = gradclip("inspect", run / "epoch_0", "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["step"], doc["what"]) == (2, what)
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
    assert any("adapter" in line and "ids" in line for line in doc["description"])


@pytest.mark.parametrize("name", ["adapter_model.pt", "adapter_model.safetensors"])
def test_an_adapter_file_alone_is_the_adapters_weights(gradclip, torchtune_runs, name):
    """The adapter's file given alone (torchtune's names in ``.pt``, PEFT's in
    ``.safetensors``): its tensors are the adapter's weights, never called the model's."""
    file = torchtune_runs / "lora_adapter" / "epoch_0" / name
    if name.endswith(".pt"):
        adapter = torch.load(file, weights_only=True)
    else:
        with safe_open(str(file), "pt") as f:
            adapter = {k: f.get_tensor(k) for k in f.keys()}
    result = gradclip("inspect", file, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == "weights"
    assert "adapter" in doc["measured"]["explain"]
    assert "model weights" not in doc["measured"]["explain"]
    assert rel_err(doc["total_norm"], norm(adapter.values())) <= TOL
    assert {t["name"] for t in doc["tensors"]} == set(adapter)


def test_trend_of_adapter_only_epochs_names_the_adapters_weights(gradclip, torchtune_runs):
    """``--what auto`` meets the optimizer's moments at epoch 0 and the adapter's weights
    alone at epoch 1: refused, the weights called the adapter's, and the offer works."""
    run = torchtune_runs / "lora_adapter"
    result = gradclip("trend", run)
    assert result.code == 2 and len(result.err_lines) == 1, result.err
    assert "adapter's weights" in result.err and "model weights" not in result.err
    assert "--what weights" in result.err
    assert gradclip("trend", run, "--what", "weights").code == 0


def test_every_adapter_only_refusal_offers_only_what_works(gradclip, torchtune_runs, tmp_path):
    from tests.cli.support import walk_refusals

    run = torchtune_runs / "lora_adapter"
    paths = [run / "epoch_0", run / "epoch_1", run]
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    assert refusals >= 2 * len(paths) and followed >= len(paths)


# ------------------------------------------------------- FullModelHFCheckpointer


def _hf_shard(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    with safe_open(str(run / f"epoch_{epoch}" / "model-00001-of-00001.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("epoch", [0, 1])
def test_hugging_face_shards_give_weights_and_step(gradclip, torchtune_runs, epoch):
    run = torchtune_runs / "hf"
    weights = _hf_shard(run, epoch)
    assert "model.layers.0.self_attn.q_proj.weight" in weights  # Hugging Face's names
    _weights_of_epoch(gradclip, run, epoch, weights)
    trend = gradclip("trend", run, "--what", "weights", "--format", "json")
    assert [p["step"] for p in trend.json()["points"]] == [2, 4]


def test_hugging_face_shards_measure_the_optimizer_under_its_ids(gradclip, torchtune_runs):
    """The optimizer's ids follow torchtune's model, the shards hold Hugging Face's names
    sorted: no order maps one to the other, so the state is measured under its ids (the
    total does not depend on names) and the report says why, never a guessed name."""
    run = torchtune_runs / "hf"
    recipe = torch.load(run / RECIPE, weights_only=True)
    state = recipe["optimizer"]
    b1 = state["param_groups"][0]["betas"][0]
    expected = [s["exp_avg"].double() / (1 - b1 ** float(s["step"]))
                for s in state["state"].values()]
    result = gradclip("inspect", run / "epoch_0", "--what", "exp_avg", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert rel_err(doc["total_norm"], norm(expected)) <= TOL
    assert all(t["name"].startswith("state.") for t in doc["tensors"])
    assert any("stored no param_names" in line for line in doc["description"])


# --------------------------------------------------------------------- hostile copies


@pytest.fixture
def copy(torchtune_runs, tmp_path) -> Path:
    target = tmp_path / "out"
    shutil.copytree(torchtune_runs / "run", target)
    return target


def test_truncated_recipe_state(gradclip, copy):
    recipe = copy / RECIPE
    recipe.write_bytes(recipe.read_bytes()[: recipe.stat().st_size // 2])
    one_line_exit_3(gradclip("inspect", copy / "epoch_1"), "recipe_state.pt")


def test_recipe_state_outside_the_folder(gradclip, copy, tmp_path):
    outside = tmp_path / "elsewhere.pt"
    (copy / RECIPE).rename(outside)
    (copy / RECIPE).symlink_to(outside)
    one_line_exit_3(gradclip("inspect", copy / "epoch_1"), "outside its folder")


def test_recipe_state_that_runs_code_is_refused(gradclip, copy, tmp_path):
    marker = tmp_path / "ran"
    recipe = torch.load(copy / RECIPE, weights_only=True)
    recipe["dataloader"] = RunsCode(marker)
    torch.save(recipe, copy / RECIPE)
    one_line_exit_3(gradclip("inspect", copy / "epoch_1"), "--trust-pickle", "recipe_state.pt")
    assert not marker.exists()


def test_recipe_state_with_no_epoch_count(gradclip, copy):
    recipe = torch.load(copy / RECIPE, weights_only=True)
    recipe["epochs_run"] = "two"
    torch.save(recipe, copy / RECIPE)
    one_line_exit_3(gradclip("inspect", copy / "epoch_1"), "epochs_run", "recipe_state.pt")


def test_truncated_model_shard(gradclip, copy):
    shard = copy / "epoch_1" / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    one_line_exit_3(gradclip("inspect", copy / "epoch_1", "--what", "weights"), SHARD)


def test_an_unfinished_hugging_face_save_is_refused(gradclip, torchtune_runs, tmp_path):
    """``FullModelHFCheckpointer`` writes ``model-0000K-of-0000M.safetensors`` one by one and
    its index last: a save stopped before its last shard leaves the first ones and no index.
    The epoch is refused naming the missing shard (the shards present were measured as the
    whole model, exit 0). Here the real shard of a save is split in two as the
    checkpointer splits a model, and the second never written."""
    from safetensors.torch import save_file

    out = tmp_path / "out"
    shutil.copytree(torchtune_runs / "hf", out)
    epoch = out / "epoch_1"
    weights = _hf_shard(out, 1)
    names = list(weights)
    half = {k: weights[k] for k in names[: len(names) // 2]}
    save_file(half, epoch / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    (epoch / "model-00001-of-00001.safetensors").unlink()
    (epoch / "model.safetensors.index.json").unlink()
    for what in ("weights", "exp_avg"):
        result = gradclip("inspect", epoch, "--what", what)
        one_line_exit_3(result, "model-00002-of-00002.safetensors", "missing")


# --------------------------------------------------------------------- under torchrun


def test_byte_for_byte_under_torchrun(torchtune_runs, tmp_path):
    run = torchtune_runs / "run"
    jobs = [
        {"args": ["inspect", str(run / "epoch_1"), "--what", what, "--format", fmt]}
        for what in ("exp_avg", "update", "weights")
        for fmt in ("table", "json")
    ]
    jobs.append({"args": ["trend", str(run), "--what", "weights", "--format", "json"]})
    same_under_torchrun(jobs, tmp_path)
