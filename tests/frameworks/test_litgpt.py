"""litgpt ``step-N/lit_model.pth``: a real save of litgpt's pretraining ``save_checkpoint``
(``litgpt_run.py``). Every number is checked against float64 from the raw file."""

from __future__ import annotations

import torch

from tests.cli.support import rel_err

from .support import TOL, norm, skip_without_frameworks

skip_without_frameworks()

STEP = "step-00000004"


def test_the_checkpoint_with_its_step(gradclip, litgpt_run):
    path = litgpt_run / STEP / "lit_model.pth"
    saved = torch.load(path, weights_only=True)
    assert (saved["iter_num"], saved["step_count"]) == (4, 2)
    names = list(saved["model"])
    group = saved["optimizer"]["param_groups"][0]
    expected = {}
    for pid, name in enumerate(names):
        s = saved["optimizer"]["state"][pid]
        expected[name] = s["exp_avg"].double() / (1 - group["betas"][0] ** float(s["step"]))
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "exp_avg" and doc["step"] == saved["step_count"] == 2
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    for row in doc["tensors"]:
        assert rel_err(row["norm"], norm([expected[row["name"]]])) <= TOL, row["name"]
        ratio = norm([expected[row["name"]]]) / norm([saved["model"][row["name"]]])
        assert rel_err(row["ratio"], ratio) <= TOL, row["name"]


def test_its_weight_export(gradclip, litgpt_run, tmp_path):
    """litgpt's weight export (``merge_lora``, ``convert_hf_checkpoint``) is
    ``torch.save(state_dict)`` as ``lit_model.pth``: the model from the real save."""
    saved = torch.load(litgpt_run / STEP / "lit_model.pth", weights_only=True)
    export = tmp_path / "final" / "lit_model.pth"
    export.parent.mkdir()
    torch.save(saved["model"], export)
    doc = gradclip("inspect", export, "--format", "json").json()
    assert doc["what"] == "weights"
    assert rel_err(doc["total_norm"], norm(saved["model"].values())) <= TOL
    assert gradclip("inspect", export, "--what", "grads").code == 3


def test_every_refusal_offers_only_what_works(gradclip, litgpt_run, tmp_path):
    from tests.cli.test_cli_roles import walk_refusals

    refusals, followed = walk_refusals(gradclip, [litgpt_run / STEP / "lit_model.pth"], tmp_path)
    assert refusals >= 2 and followed > 1
