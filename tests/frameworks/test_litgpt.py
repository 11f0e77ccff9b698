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


# ------------------------------------------------------- finetune_lora, _adapter, _adapter_v2

# Whose weights each method's file holds, as the report says it, and the tensors it keeps.
WHOSE = {"lora": "the LoRA adapter's", "adapter": "the LLaMA-Adapter's",
         "adapter_v2": "the LLaMA-Adapter v2's"}
KIND = {"lora": "litgpt-lora", "adapter": "litgpt-adapter", "adapter_v2": "litgpt-adapter-v2"}
KEPT = {"lora": (".lora_",), "adapter": ("adapter_wte", "gating_factor"),
        "adapter_v2": ("adapter_", "gating_factor", "norm_", "ln_f")}


def _adapter(run, method: str, folder: str) -> dict[str, torch.Tensor]:
    return torch.load(run / folder / f"lit_model.pth.{method}", weights_only=True)["model"]


def test_the_adapter_fixture_is_litgpts_finetune_output(litgpt_adapter_run):
    run, method = litgpt_adapter_run
    names = sorted(p.name for p in run.iterdir() if p.name.startswith(("step", "fin")))
    assert names == ["final", "step-000001", "step-000002"]
    for folder in names:
        files = {p.name for p in (run / folder).iterdir()}
        assert {f"lit_model.pth.{method}", "model_config.yaml"} <= files
        # the adapter alone, no model, no optimizer; LoRA's final/ merges it into the model
        assert ("lit_model.pth" in files) == (method == "lora" and folder == "final")
    adapter = _adapter(run, method, "step-000002")
    assert adapter and all(any(k in name for k in KEPT[method]) for name in adapter)
    assert not any(name.endswith(("qkv.weight", "wte.weight")) and "adapter" not in name
                   for name in adapter)


def _says_the_adapters(doc: dict, method: str) -> None:
    explain = doc["measured"]["explain"]
    assert explain.startswith(f"{WHOSE[method]} weights, not the model's"), explain
    assert "model weights" not in explain


@pytest.mark.parametrize("given", ["folder", "file", "final", "copied"])
def test_an_adapter_checkpoint_measures_the_adapters_weights(gradclip, litgpt_adapter_run,
                                                             given, tmp_path):
    """A ``step-N/`` of ``finetune_lora``/``_adapter``/``_adapter_v2``, its file alone, the
    adapter in ``final/``, and the file copied away from its folder (no ``model_config.yaml``
    beside it): the adapter's weights alone, measured as the adapter's, at the folder's step
    (``final/`` and a copy have none), never called the model's."""
    run, method = litgpt_adapter_run
    folder = run / ("final" if given == "final" else "step-000002")
    adapter = _adapter(run, method, folder.name)
    file = folder / f"lit_model.pth.{method}"
    path = folder if given == "folder" else file  # LoRA's final/ folder is the merged model
    if given == "copied":
        path = tmp_path / file.name
        shutil.copyfile(file, path)
    result = gradclip("inspect", path, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    step = None if given in ("final", "copied") else 2
    assert (doc["what"], doc.get("step"), doc["format"]) == ("weights", step, KIND[method])
    _says_the_adapters(doc, method)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(adapter)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([adapter[name]])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(adapter.values())) <= TOL
    table = gradclip("inspect", path)
    assert table.code == 0 and f"{WHOSE[method]} weights, not the model's" in table.out
    for what in ("grads", "exp_avg"):
        refused = gradclip("inspect", path, "--what", what)
        assert refused.code == 3 and "--what weights" in refused.err, refused.err
        assert path.name in refused.err


def test_an_adapter_checkpoint_is_never_clipped(gradclip, litgpt_adapter_run, tmp_path):
    """No gradients: clip refuses, offering nothing (clip never offers weights), and writes
    nothing."""
    run, method = litgpt_adapter_run
    folder = run / "step-000002"
    for path in (folder, folder / f"lit_model.pth.{method}"):
        out = tmp_path / "clipped.pt"
        refused = gradclip("clip", path, "--max-norm", "1", "-o", out)
        assert refused.code == 3 and not out.exists()
        assert f"saves no gradients ({WHOSE[method]} weights)" in refused.err
        assert "--" not in refused.err.replace("--max-norm", "")


def test_trend_and_compare_over_an_adapter_run(gradclip, litgpt_adapter_run):
    run, method = litgpt_adapter_run
    result = gradclip("trend", run, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == "weights"
    assert [p["step"] for p in doc["points"]] == [1, 2]
    expected = [norm(_adapter(run, method, f"step-00000{s}").values()) for s in (1, 2)]
    for point, total in zip(doc["points"], expected):
        assert rel_err(point["total_norm"], total) <= TOL
    result = gradclip("compare", run / "step-000001", run / "step-000002", "--format", "json")
    assert result.code == 0, result.err
    total = result.json()["total"]
    assert rel_err(total["a"], expected[0]) <= TOL and rel_err(total["b"], expected[1]) <= TOL


def test_the_lora_final_folder_is_the_merged_model(gradclip, litgpt_adapter_run):
    run, method = litgpt_adapter_run
    if method != "lora":
        pytest.skip("only LoRA's final/ holds a merged model")
    merged = torch.load(run / "final" / "lit_model.pth", weights_only=True)
    doc = gradclip("inspect", run / "final", "--format", "json").json()
    assert doc["what"] == "weights" and doc["format"] == "litgpt"
    assert rel_err(doc["total_norm"], norm(merged.values())) <= TOL


def test_every_adapter_refusal_offers_only_what_works(gradclip, litgpt_adapter_run, tmp_path):
    from tests.cli.support import walk_refusals

    run, method = litgpt_adapter_run
    folder = run / "step-000002"
    paths = [folder, folder / f"lit_model.pth.{method}", run / "final"]
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    assert refusals >= 6 and followed >= 6


# ------------------------------------------------------------------ finetune_full


def test_a_full_finetune_is_read_as_litgpts_training_state(gradclip, litgpt_full_run):
    """``finetune_full``'s ``step-N/lit_model.pth`` (model, optimizer, scheduler, iter_num,
    step_count) is the litgpt layout's, as pretraining's; its ``final/`` the model alone."""
    run = litgpt_full_run
    saved = torch.load(run / "step-000002" / "lit_model.pth", weights_only=True)
    assert {"model", "optimizer", "scheduler", "step_count"} <= set(saved)
    expected = _first_moments(saved)
    doc = gradclip("inspect", run / "step-000002", "--format", "json").json()
    assert (doc["what"], doc["step"], doc["format"]) == ("exp_avg", saved["step_count"], "litgpt")
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    final = torch.load(run / "final" / "lit_model.pth", weights_only=True)["model"]
    doc = gradclip("inspect", run / "final", "--format", "json").json()
    assert (doc["what"], doc["format"]) == ("weights", "litgpt")
    assert "adapter" not in doc["measured"]["explain"]
    assert rel_err(doc["total_norm"], norm(final.values())) <= TOL
    trend = gradclip("trend", run, "--format", "json")
    assert trend.code == 0, trend.err
    assert [(p["step"], trend.json()["what"]) for p in trend.json()["points"]] == [
        (1, "exp_avg"), (2, "exp_avg")]
