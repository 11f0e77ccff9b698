"""A Hugging Face ``Trainer`` run under DeepSpeed ZeRO 2: ``checkpoint-N/`` holding the
Trainer's files beside DeepSpeed's ``latest`` and ``global_stepN/``.

The numbers are checked in float64 against what DeepSpeed itself assembles
(``safe_get_full_optimizer_state`` in the run, ``zero_to_fp32`` here) and
against the raw rank files read with ``torch.load``. One parameter is frozen:
its weights are measured, it has no moments.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.support import unwrapped
from tests.hardening.support import assert_refused, run_cli
from tests.layouts.deepspeed_trainer_run import BETAS, EPS, FROZEN, LR, STEPS
from tests.schemas import validate

RTOL = 1e-6  # the same float32 values on both sides: only the norms' rounding differs


def _inspect(path: Path, what: str) -> dict:
    result = run_cli("inspect", path, "--what", what, "--format", "json", "--no-progress")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    validate(doc, "inspect-1")
    return doc


def _expected(reference: dict, what: str, step: int) -> dict[str, torch.Tensor]:
    c1, c2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    out = {}
    for name, entry in reference.items():
        m = entry["exp_avg"].double() / c1
        v = entry["exp_avg_sq"].double() / c2
        out[name] = {"exp_avg": m, "grad_rms": v.sqrt(), "update": LR * m / (v.sqrt() + EPS),
                     "weights": entry["weight"].double()}[what]
    return out


def test_the_checkpoint_holds_both_frameworks_files(deepspeed_trainer_run):
    folder = deepspeed_trainer_run / f"checkpoint-{STEPS}"
    names = set(os.listdir(folder))
    assert {"trainer_state.json", "latest", f"global_step{STEPS}", "zero_to_fp32.py",
            "model.safetensors"} <= names
    assert "optimizer.pt" not in names  # the moments are DeepSpeed's


@pytest.mark.parametrize("what", ["exp_avg", "grad_rms", "update"])
def test_moments_match_deepspeeds_own_assembly(deepspeed_trainer_run, what):
    reference = torch.load(deepspeed_trainer_run / "reference.pt")
    assert FROZEN not in reference
    expected = _expected(reference, what, STEPS)
    weights = _expected(reference, "weights", STEPS)
    doc = _inspect(deepspeed_trainer_run / f"checkpoint-{STEPS}", what)
    assert doc["what"] == what and doc["format"] == "deepspeed" and doc["step"] == STEPS
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert list(tensors) == list(expected)  # the model's order, the frozen one absent
    for name, value in expected.items():
        assert tensors[name]["shape"] == list(value.shape)
        assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=RTOL), name
        ratio = value.norm().item() / weights[name].norm().item()
        assert tensors[name]["ratio"] == pytest.approx(ratio, rel=RTOL), name
    total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    assert doc["total_norm"] == pytest.approx(total, rel=RTOL)
    assert any(line.startswith("1 frozen parameter(s)") for line in doc["description"])


def test_weights_are_zero_to_fp32s_frozen_one_included(deepspeed_trainer_run):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from gradclip_cli.source.layouts import open_checkpoint

    folder = deepspeed_trainer_run / f"checkpoint-{STEPS}"
    theirs = get_fp32_state_dict_from_zero_checkpoint(os.fspath(folder))
    theirs.pop("lm_head.weight")  # tied to transformer.wte.weight (shared_params)
    assert FROZEN in theirs
    ours = open_checkpoint(folder)
    assert set(ours.weights) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours.weights[name].read(), tensor), name
    doc = _inspect(folder, "weights")
    tensors = {t["name"]: t for t in doc["tensors"]}
    frozen = theirs[FROZEN].double()
    assert tensors[FROZEN]["norm"] == pytest.approx(frozen.norm().item(), rel=RTOL)
    total = torch.cat([t.double().flatten() for t in theirs.values()]).norm().item()
    assert doc["total_norm"] == pytest.approx(total, rel=RTOL)
    assert doc["num_elements"] == sum(t.numel() for t in theirs.values())


def _raw_exp_avg_total(step_folder: Path, step: int) -> float:
    """The bias-corrected ``exp_avg`` total from the rank files' flat moments (their
    padding is zero), every group having taken ``step`` steps."""
    squares = 0.0
    for rank in range(2):
        root = torch.load(step_folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                          weights_only=False)
        for entry in root["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            assert float(entry["step"]) == step
            squares += float(entry["exp_avg"].double().square().sum())
    return math.sqrt(squares) / (1 - BETAS[0] ** step)


def test_trend_over_the_output_dir(deepspeed_trainer_run):
    r = run_cli("trend", deepspeed_trainer_run, "--what", "exp_avg", "--format", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    validate(doc, "trend-1")
    assert [p["step"] for p in doc["points"]] == list(range(1, STEPS + 1))
    for point in doc["points"]:
        step = point["step"]
        expected = _raw_exp_avg_total(
            deepspeed_trainer_run / f"checkpoint-{step}" / f"global_step{step}", step)
        assert point["total_norm"] == pytest.approx(expected, rel=RTOL), step
        assert "transformer.h.0" in point["groups"]


def test_the_table_names_the_trainer_and_deepspeed(deepspeed_trainer_run):
    r = run_cli("inspect", deepspeed_trainer_run / f"checkpoint-{STEPS}", "--no-progress")
    assert r.code == 0, r.err
    shown = unwrapped(r.out)
    assert f"Hugging Face Trainer checkpoint at global_step {STEPS}" in shown
    assert "DeepSpeed ZeRO stage 2 checkpoint" in shown


def test_the_trainers_step_is_the_step(deepspeed_trainer_run, tmp_path):
    """DeepSpeed's count and the Trainer's may differ (a resumed run); the Trainer's is the
    checkpoint's step, as without DeepSpeed, and the report says both."""
    folder = tmp_path / "resumed"
    shutil.copytree(deepspeed_trainer_run / f"checkpoint-{STEPS}", folder)
    state = json.loads((folder / "trainer_state.json").read_text())
    state["global_step"] = 40
    (folder / "trainer_state.json").write_text(json.dumps(state))
    doc = _inspect(folder, "exp_avg")
    assert doc["step"] == 40
    assert f"DeepSpeed counts {STEPS} steps (global_steps), the Trainer 40" in " ".join(
        doc["description"])


def test_a_trainer_state_that_contradicts_its_folder_is_refused(deepspeed_trainer_run,
                                                                 tmp_path):
    folder = tmp_path / f"checkpoint-{STEPS}"
    shutil.copytree(deepspeed_trainer_run / f"checkpoint-{STEPS}", folder)
    state = json.loads((folder / "trainer_state.json").read_text())
    state["global_step"] = 7
    (folder / "trainer_state.json").write_text(json.dumps(state))
    assert_refused(run_cli("inspect", folder, "--no-progress"), folder / "trainer_state.json",
                   "global_step 7")
