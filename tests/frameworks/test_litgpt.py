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
