"""accelerate's FSDP checkpoints: ``pytorch_model_fsdp_0/`` + ``optimizer_0/``, both DCP.

The run is written once per session on two spawned FSDP2 gloo ranks by
accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` and
transformers' ``TrainerState`` (``accelerate_fsdp_ranks.py``). References
never go through gradclip: torch's own ``dcp_to_torch_save`` reassembles each
DCP folder, and the norms, bias corrections and updates are computed here in
float64.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.support import load_dcp, rel_err, unwrapped

from .accelerate_fsdp_ranks import STEPS
from .test_dcp import adam_measured

TOL = 1e-6  # the contract's accuracy; the references are float64


@pytest.fixture(scope="module")
def references(accelerate_fsdp_run, tmp_path_factory) -> dict[int, tuple[dict, dict]]:
    """step -> (model state, optimizer state), as torch's DCP reader reassembles them."""
    tmp = tmp_path_factory.mktemp("accelerate_ref")
    out = {}
    for step in range(1, STEPS + 1):
        folder = accelerate_fsdp_run / f"checkpoint-{step}"
        model = load_dcp(folder / "pytorch_model_fsdp_0", tmp / f"model{step}.pt")["model"]
        optim = load_dcp(folder / "optimizer_0", tmp / f"optim{step}.pt")["optimizer"]
        out[step] = (model, optim)
    return out


def _norm(tensors) -> float:
    tensors = list(tensors)
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm())


def _expected(model: dict, optim: dict, what: str) -> dict[str, torch.Tensor]:
    if what == "weights":
        return {n: t.double() for n, t in model.items()}
    return adam_measured(optim, what)


def test_fixture_is_accelerates_sharded_layout(accelerate_fsdp_run):
    from torch.distributed.checkpoint import FileSystemReader

    folder = accelerate_fsdp_run / f"checkpoint-{STEPS}"
    assert sorted(os.listdir(folder)) == ["optimizer_0", "pytorch_model_fsdp_0",
                                          "trainer_state.json"]
    meta = FileSystemReader(folder / "optimizer_0").read_metadata()
    chunks = meta.state_dict_metadata["optimizer.state.2.weight.exp_avg"].chunks
    assert [tuple(c.sizes) for c in chunks] == [(2, 10), (1, 10)]  # sharded by FSDP2


@pytest.mark.parametrize("what", ["auto", "exp_avg", "grad_rms", "update", "weights"])
def test_every_number_against_torch_reassembled(gradclip, accelerate_fsdp_run, references,
                                                what):
    model, optim = references[STEPS]
    measured = "exp_avg" if what == "auto" else what
    expected = _expected(model, optim, measured)
    weights = {n: t.double() for n, t in model.items()}
    result = gradclip("inspect", accelerate_fsdp_run / f"checkpoint-{STEPS}", "--what", what,
                      "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == measured and doc["format"] == "accelerate-fsdp"
    assert doc["step"] == STEPS
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    assert doc["num_elements"] == sum(t.numel() for t in expected.values())
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected) == set(weights)
    for name, row in rows.items():
        assert rel_err(row["norm"], _norm([expected[name]])) <= TOL, name
        assert row["shape"] == list(expected[name].shape)
        if measured != "weights":
            assert rel_err(row["ratio"], _norm([expected[name]]) / _norm([weights[name]])) \
                <= TOL, name


def test_table_names_the_layout_and_its_folders(gradclip, accelerate_fsdp_run):
    folder = accelerate_fsdp_run / f"checkpoint-{STEPS}"
    result = gradclip("inspect", folder, "--no-progress")
    assert result.code == 0, result.err
    shown = unwrapped(result.out)
    assert "accelerate-fsdp, step 2, 4 tensors, 103 elements" in shown
    assert "what: exp_avg" in shown
    assert (f"accelerate FSDP checkpoint at global_step {STEPS}: pytorch_model_fsdp_0/ "
            "(4 weights), optimizer_0/ (optimizer state)") in result.out


def test_no_gradients_says_what_to_measure(gradclip, accelerate_fsdp_run):
    folder = accelerate_fsdp_run / f"checkpoint-{STEPS}"
    result = gradclip("inspect", folder, "--what", "grads")
    assert result.code == 3
    assert result.err_lines == [
        f"gradclip: {folder}: --what grads: an accelerate FSDP checkpoint holds no gradients; "
        "it holds AdamW state (exp_avg, exp_avg_sq); available: --what exp_avg, "
        "--what grad_rms, --what update, --what weights"]
    result = gradclip("clip", folder, "--max-norm", "1")
    assert result.code == 3 and len(result.err_lines) == 1
    assert sorted(os.listdir(folder.parent)) == ["checkpoint-1", "checkpoint-2"]


def test_each_part_is_a_dcp_checkpoint_of_its_own(gradclip, accelerate_fsdp_run, references):
    model, optim = references[STEPS]
    folder = accelerate_fsdp_run / f"checkpoint-{STEPS}"
    doc = gradclip("inspect", folder / "optimizer_0", "--what", "exp_avg",
                   "--format", "json").json()
    assert doc["format"] == "dcp"
    assert rel_err(doc["total_norm"], _norm(_expected(model, optim, "exp_avg").values())) <= TOL
    doc = gradclip("inspect", folder / "pytorch_model_fsdp_0", "--what", "weights",
                   "--format", "json").json()
    assert rel_err(doc["total_norm"], _norm(model.values())) <= TOL


def test_trend_over_the_run(gradclip, accelerate_fsdp_run, references):
    result = gradclip("trend", accelerate_fsdp_run, "--what", "exp_avg", "--format", "json")
    assert result.code == 0, result.err
    points = result.json()["points"]
    assert [p["step"] for p in points] == list(range(1, STEPS + 1))
    for point in points:
        model, optim = references[point["step"]]
        expected = _norm(_expected(model, optim, "exp_avg").values())
        assert rel_err(point["total_norm"], expected) <= TOL
    # One checkpoint folder is one point, not a run of its numbered parts.
    result = gradclip("trend", accelerate_fsdp_run / "checkpoint-1", "--what", "exp_avg",
                      "--format", "json")
    assert result.code == 0, result.err
    assert [p["step"] for p in result.json()["points"]] == [1]


# --------------------------------------------------------------------- hostile copies


@pytest.fixture
def copy(accelerate_fsdp_run, tmp_path) -> Path:
    target = tmp_path / f"checkpoint-{STEPS}"
    shutil.copytree(accelerate_fsdp_run / f"checkpoint-{STEPS}", target)
    return target


def _refused(gradclip, folder: Path, *phrases: str) -> str:
    result = gradclip("inspect", folder, "--what", "exp_avg")
    assert result.code == 3, result.out
    assert len(result.err_lines) == 1, result.err
    line = result.err_lines[0]
    for phrase in phrases:
        assert phrase in line, line
    return line


@pytest.mark.parametrize("part", ["optimizer_0", "pytorch_model_fsdp_0"])
def test_a_part_linked_outside_the_folder(gradclip, copy, tmp_path, part):
    outside = tmp_path / "elsewhere"
    shutil.move(copy / part, outside)
    os.symlink(outside, copy / part)
    line = _refused(gradclip, copy, "leads outside its folder", "refused")
    assert line.startswith(f"gradclip: {copy}: ")


def test_two_models(gradclip, copy):
    shutil.copytree(copy / "pytorch_model_fsdp_0", copy / "pytorch_model_fsdp_1")
    _refused(gradclip, copy, "holds 2 FSDP models", "pytorch_model_fsdp_0, pytorch_model_fsdp_1")


def test_an_optimizer_folder_without_optimizer_state(gradclip, copy):
    shutil.rmtree(copy / "optimizer_0")
    shutil.copytree(copy / "pytorch_model_fsdp_0", copy / "optimizer_0")
    _refused(gradclip, copy, f"{copy / 'optimizer_0' / '.metadata'}: holds no optimizer state")


def test_trainer_state_that_lies(gradclip, copy):
    state = copy / "trainer_state.json"
    state.write_text(state.read_text().replace(f'"global_step": {STEPS}', '"global_step": 7'))
    _refused(gradclip, copy, f"{state}: says global_step 7", f"checkpoint-{STEPS}")


def test_truncated_optimizer_shard(gradclip, copy):
    shard = copy / "optimizer_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    _refused(gradclip, copy, f"{shard}: truncated")
