"""DeepSpeed universal checkpoints, written by DeepSpeed's own converter (``ds_to_universal``)
from the real ZeRO 1, 2 and 3 checkpoints of ``deepspeed_runs.py``.

fp32 runs are checked against the plain ``torch.optim.AdamW`` run beside them (as the ZeRO
checkpoints themselves are); the bf16 run against the converter's own files as torch
loads them, in float64. Broken and hostile copies are exit 3 with one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import same_under_torchrun
from tests.hardening.support import assert_refused, run_cli
from tests.layouts.deepspeed_runs import BETAS, EPS, LR
from tests.layouts.test_deepspeed import FROZEN, RTOL, _expected

TAG = "global_step2"
OUT = "global_step2_universal"
WHATS = ("exp_avg", "grad_rms", "update", "weights")
CONVERTED = ("zero1", "zero2", "zero3", "zero2_bf16")


@pytest.fixture(scope="session")
def universal_runs(deepspeed_runs, tmp_path_factory) -> Path:
    """``RUN/global_step2_universal/`` and ``RUN/latest_universal`` for each converted run,
    written by ``python -m deepspeed.checkpoint.ds_to_universal`` (``--inject_missing_state``:
    the runs' model is not Megatron's, whose universal info the converter otherwise needs)."""
    out = tmp_path_factory.mktemp("universal")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for run in CONVERTED:
        done = subprocess.run(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
             "--input_folder", os.fspath(deepspeed_runs / run / TAG),
             "--output_folder", os.fspath(out / run / OUT), "--inject_missing_state",
             "--num_extract_workers", "1", "--num_merge_workers", "1"],
            env=env, capture_output=True, text=True, timeout=1200,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return out


def _inspect(path: Path, what: str) -> dict:
    result = run_cli("inspect", path, "--what", what, "--format", "json", "--no-progress")
    assert result.code == 0, result.err
    return json.loads(result.out)


def _files_expected(folder: Path, what: str) -> dict[str, torch.Tensor]:
    """``what`` per parameter in float64 from the converter's files as torch loads them."""
    def load(name: str, quantity: str) -> torch.Tensor:
        value = torch.load(folder / "zero" / name / f"{quantity}.pt", weights_only=True)
        return value["param"] if isinstance(value, dict) else value

    model = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)
    names = [n for group in model["param_shapes"] for n in group]
    if what == "weights":
        return {n: load(n, "fp32").double() for n in model["module"] if n != "scale"}
    out = {}
    for name in names:
        step = float(torch.load(folder / "zero" / name / "step.pt", weights_only=True))
        m = load(name, "exp_avg").double() / (1 - BETAS[0] ** step)
        v = load(name, "exp_avg_sq").double() / (1 - BETAS[1] ** step)
        out[name] = {"exp_avg": m, "grad_rms": v.sqrt(), "update": LR * m / (v.sqrt() + EPS)}[
            what]
    return out


def _assert_numbers(doc: dict, expected: dict[str, torch.Tensor], rtol: float) -> None:
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        assert tensors[name]["shape"] == list(value.shape), name
        assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=rtol), name
        assert tensors[name]["max_abs"] == pytest.approx(value.abs().max().item(), rel=rtol)
    total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    assert doc["total_norm"] == pytest.approx(total, rel=rtol)


@pytest.mark.parametrize("run", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("what", WHATS)
def test_fp32_numbers_match_a_plain_adamw_run(deepspeed_runs, universal_runs, run, what):
    expected = _expected(torch.load(deepspeed_runs / f"{run}.reference.pt"), what)
    if run == "zero3" and what == "weights":  # no master is written for its frozen layer
        expected = {n: v for n, v in expected.items() if n not in FROZEN}
    for path in (universal_runs / run, universal_runs / run / OUT):
        doc = _inspect(path, what)
        assert doc["what"] == what
        _assert_numbers(doc, expected, RTOL)


@pytest.mark.parametrize("what", WHATS)
def test_the_same_numbers_as_the_zero_checkpoint_it_was_converted_from(
        deepspeed_runs, universal_runs, what):
    for run in ("zero1", "zero2", "zero2_bf16"):
        before = _inspect(deepspeed_runs / run, what)
        after = _inspect(universal_runs / run, what)
        assert after["total_norm"] == pytest.approx(before["total_norm"], rel=1e-6), run
        assert [g["name"] for g in after["groups"]] == [g["name"] for g in before["groups"]]


@pytest.mark.parametrize("what", WHATS)
def test_bf16_numbers_are_the_converters_files(universal_runs, what):
    doc = _inspect(universal_runs / "zero2_bf16", what)
    _assert_numbers(doc, _files_expected(universal_runs / "zero2_bf16" / OUT, what), 1e-6)


def test_what_it_says(universal_runs):
    result = run_cli("inspect", universal_runs / "zero2", "--no-progress")
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    assert "DeepSpeed universal checkpoint at global step 2" in text
    assert "named by latest_universal" in text
    assert "4 trained parameters with Adam's moments, 2 frozen" in text
    doc = _inspect(universal_runs / "zero2", "auto")
    assert doc["what"] == "exp_avg"  # no gradients: Adam's moments, as auto says
    zero3 = run_cli("inspect", universal_runs / "zero3", "--what", "weights", "--no-progress")
    assert "2 frozen parameters (4.weight, 4.bias) have no fp32.pt" in " ".join(
        zero3.out.split())


def test_gradients_are_refused_with_what_it_holds(universal_runs):
    result = run_cli("inspect", universal_runs / "zero2", "--what", "grads", "--no-progress")
    line = assert_refused(result, universal_runs / "zero2", "holds no gradients")
    assert "--what exp_avg" in line


def test_two_ranks_print_the_one_process_report(universal_runs, tmp_path):
    jobs = [{"args": ["inspect", str(universal_runs / run), "--what", what, "--format", fmt,
                      "--no-progress"]}
            for run in ("zero2", "zero2_bf16", "zero3") for what in ("auto", "weights")
            for fmt in ("table", "json")]
    same_under_torchrun(jobs, tmp_path)


# ------------------------------------------------------------------ broken and hostile


@pytest.fixture
def copy(universal_runs, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(universal_runs / "zero2_bf16", target)
    return target


def _save(file: Path, value) -> None:
    torch.save(value, file)


def test_a_missing_moment_file(copy):
    file = copy / OUT / "zero" / "0.weight" / "exp_avg.pt"
    file.unlink()
    assert_refused(run_cli("inspect", copy, "--what", "exp_avg"), file, "missing")


def test_a_moment_of_another_shape(copy):
    file = copy / OUT / "zero" / "2.weight" / "exp_avg_sq.pt"
    _save(file, {"param": torch.zeros(4, 4), "cat_dim": 0})
    assert_refused(run_cli("inspect", copy, "--what", "grad_rms"), file, "shape [4, 4]",
                   "2.weight")


def test_a_master_that_does_not_round_to_the_module(copy):
    file = copy / OUT / "zero" / "0.bias" / "fp32.pt"
    value = torch.load(file, weights_only=True)
    value["param"] = value["param"] + 1.0
    _save(file, value)
    assert_refused(run_cli("inspect", copy, "--what", "weights"), file,
                   "the masters and the module disagree")


def test_a_step_that_is_not_a_count(copy):
    file = copy / OUT / "zero" / "0.bias" / "step.pt"
    _save(file, torch.tensor([1.0, 2.0]))
    assert_refused(run_cli("inspect", copy, "--what", "exp_avg"), file, "no step count")


@pytest.mark.parametrize("tag", ["../elsewhere", "/etc", "missing"])
def test_latest_universal_naming_no_folder_inside(copy, tag):
    latest = copy / "latest_universal"
    latest.write_text(tag)
    result = run_cli("inspect", copy)
    assert result.code == 3, result.err
    assert len(result.err_lines) == 1 and str(latest) in result.err_lines[0]


def test_a_parameter_name_leading_outside(copy, tmp_path):
    """A name from param_shapes is data: ``..`` never leaves the folder."""
    file = copy / OUT / "mp_rank_00_model_states.pt"
    model = torch.load(file, weights_only=False)
    shapes = model["param_shapes"][0]
    model["param_shapes"][0] = type(shapes)(
        (("../../x" if n == "0.weight" else n), s) for n, s in shapes.items())
    _save(file, model)
    assert_refused(run_cli("inspect", copy, "--what", "exp_avg"), copy / OUT / "zero",
                   "outside its folder")


def test_groups_that_do_not_match_the_optimizers(copy):
    file = copy / OUT / "mp_rank_00_model_states.pt"
    model = torch.load(file, weights_only=False)
    model["param_shapes"] = model["param_shapes"][:1]
    _save(file, model)
    assert_refused(run_cli("inspect", copy, "--what", "exp_avg"), file, "lists 1 groups")


def test_a_key_is_refused(copy):
    result = run_cli("inspect", copy, "--key", "grads")
    assert result.code in (2, 3), result.err
    assert "universal" in result.err
