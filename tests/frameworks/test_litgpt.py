"""litgpt ``out/pretrain/step-NNNNNNNN/``: real saves of litgpt's pretraining
``save_checkpoint`` (``litgpt_run.py``). Every number is checked against float64 from
the raw file (``torch.load``): the optimizer's ids in the model's order."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.cli.support import rel_err

from .support import TOL, norm, skip_without_frameworks

skip_without_frameworks()


def _folder(litgpt_run, step: int):
    return litgpt_run / f"step-{step:08d}"


def _first_moments(saved: dict) -> dict[str, torch.Tensor]:
    names = list(saved["model"])
    group = saved["optimizer"]["param_groups"][0]
    out = {}
    for pid, name in enumerate(names):
        s = saved["optimizer"]["state"][pid]
        out[name] = s["exp_avg"].double() / (1 - group["betas"][0] ** float(s["step"]))
    return out


def test_the_fixture_is_litgpts_layout(litgpt_run):
    assert sorted(p.name for p in litgpt_run.iterdir()) == ["step-00000001", "step-00000002"]
    saved = torch.load(_folder(litgpt_run, 2) / "lit_model.pth", weights_only=True)
    assert (saved["iter_num"], saved["step_count"]) == (4, 2)  # 2 micro-batches a step
    assert (_folder(litgpt_run, 2) / "model_config.yaml").is_file()


@pytest.mark.parametrize("given", ["folder", "file"])
def test_the_checkpoint_with_its_step(gradclip, litgpt_run, given):
    folder = _folder(litgpt_run, 2)
    saved = torch.load(folder / "lit_model.pth", weights_only=True)
    expected = _first_moments(saved)
    path = folder if given == "folder" else folder / "lit_model.pth"
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "exp_avg" and doc["step"] == saved["step_count"] == 2
    if given == "folder":
        assert doc["format"] == "litgpt"
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    for row in doc["tensors"]:
        assert rel_err(row["norm"], norm([expected[row["name"]]])) <= TOL, row["name"]
        ratio = norm([expected[row["name"]]]) / norm([saved["model"][row["name"]]])
        assert rel_err(row["ratio"], ratio) <= TOL, row["name"]


def test_trend_over_the_out_folder(gradclip, litgpt_run):
    result = gradclip("trend", litgpt_run, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == "exp_avg"
    assert [p["step"] for p in doc["points"]] == [1, 2]
    for point, step in zip(doc["points"], (1, 2)):
        saved = torch.load(_folder(litgpt_run, step) / "lit_model.pth", weights_only=True)
        assert rel_err(point["total_norm"], norm(_first_moments(saved).values())) <= TOL


def test_its_weight_export(gradclip, litgpt_run, tmp_path):
    """litgpt's weight export (``merge_lora``, ``convert_hf_checkpoint``, a finetune's
    ``final/``) is ``torch.save(state_dict)`` as ``lit_model.pth`` beside
    ``model_config.yaml``: here the model of the real save, with its real config."""
    folder = _folder(litgpt_run, 2)
    saved = torch.load(folder / "lit_model.pth", weights_only=True)
    export = tmp_path / "final"
    export.mkdir()
    torch.save(saved["model"], export / "lit_model.pth")
    shutil.copy(folder / "model_config.yaml", export / "model_config.yaml")
    for path in (export, export / "lit_model.pth"):
        doc = gradclip("inspect", path, "--format", "json").json()
        assert doc["what"] == "weights"
        assert rel_err(doc["total_norm"], norm(saved["model"].values())) <= TOL
        assert gradclip("inspect", path, "--what", "grads").code == 3


def test_every_refusal_offers_only_what_works(gradclip, litgpt_run, tmp_path):
    from tests.cli.support import walk_refusals

    folder = _folder(litgpt_run, 2)
    refusals, followed = walk_refusals(gradclip, [folder, folder / "lit_model.pth"], tmp_path)
    assert refusals >= 4 and followed > 2


# ------------------------------------------------------------------ finetune_lora


def _adapter(litgpt_lora_run, folder: str) -> dict[str, torch.Tensor]:
    return torch.load(litgpt_lora_run / folder / "lit_model.pth.lora", weights_only=True)["model"]


def test_the_lora_fixture_is_litgpts_finetune_output(litgpt_lora_run):
    names = sorted(p.name for p in litgpt_lora_run.iterdir() if p.name.startswith(("step", "fin")))
    assert names == ["final", "step-000001", "step-000002"]
    for folder in ("step-000001", "step-000002"):
        files = {p.name for p in (litgpt_lora_run / folder).iterdir()}
        assert {"lit_model.pth.lora", "model_config.yaml"} <= files
        assert "lit_model.pth" not in files  # the adapter alone, no model, no optimizer
    adapter = _adapter(litgpt_lora_run, "step-000002")
    assert adapter and all(".lora_" in name for name in adapter)


@pytest.mark.parametrize("given", ["folder", "file"])
def test_a_lora_step_measures_the_adapters_weights(gradclip, litgpt_lora_run, given):
    """A ``step-N/`` of ``finetune_lora`` holds the adapter's weights alone: measured as
    the adapter's, at the folder's step, never called the model's."""
    folder = litgpt_lora_run / "step-000002"
    adapter = _adapter(litgpt_lora_run, "step-000002")
    path = folder if given == "folder" else folder / "lit_model.pth.lora"
    result = gradclip("inspect", path, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["what"], doc["step"], doc["format"]) == ("weights", 2, "litgpt-lora")
    assert "LoRA adapter" in doc["measured"]["explain"]
    assert "model weights" not in doc["measured"]["explain"]
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(adapter)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([adapter[name]])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(adapter.values())) <= TOL
    table = gradclip("inspect", path)
    assert table.code == 0 and "LoRA adapter" in table.out
    refused = gradclip("inspect", path, "--what", "exp_avg")
    assert refused.code == 3 and "--what weights" in refused.err
    assert path.name in refused.err


def test_trend_over_the_lora_out_folder(gradclip, litgpt_lora_run):
    result = gradclip("trend", litgpt_lora_run, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == "weights"
    assert [p["step"] for p in doc["points"]] == [1, 2]
    for point, folder in zip(doc["points"], ("step-000001", "step-000002")):
        expected = norm(_adapter(litgpt_lora_run, folder).values())
        assert rel_err(point["total_norm"], expected) <= TOL


def test_the_lora_final_folder_is_the_merged_model(gradclip, litgpt_lora_run):
    merged = torch.load(litgpt_lora_run / "final" / "lit_model.pth", weights_only=True)
    doc = gradclip("inspect", litgpt_lora_run / "final", "--format", "json").json()
    assert doc["what"] == "weights" and doc["format"] == "litgpt"
    assert rel_err(doc["total_norm"], norm(merged.values())) <= TOL


def test_every_lora_refusal_offers_only_what_works(gradclip, litgpt_lora_run, tmp_path):
    from tests.cli.support import walk_refusals

    folder = litgpt_lora_run / "step-000002"
    refusals, followed = walk_refusals(gradclip, [folder, folder / "lit_model.pth.lora"], tmp_path)
    assert refusals >= 2 and followed >= 2
