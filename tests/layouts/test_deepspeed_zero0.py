"""DeepSpeed checkpoints saved without ZeRO (stage 0), written by DeepSpeed's own 2-rank
CPU training (``deepspeed_runs.py``): fp32, bf16 and fp16.

fp32 is checked against the plain ``torch.optim.AdamW`` run beside it; bf16 and fp16
(DeepSpeed's ``FP16_UnfusedOptimizer``: fp32 master weights in ``fp32_groups``, the
moments in its wrapped AdamW's state dict) against the file's own values as torch loads
them (DeepSpeed's classes allowed), in float64. The module holds a buffer (``scale``) of a
bias's shape and a frozen layer (``4.*``) whose bias has another bias's shape.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import same_under_torchrun
from tests.hardening.support import assert_clean_inspect, assert_refused, run_cli
from tests.layouts.deepspeed_runs import BETAS, EPS, LR, STEPS
from tests.layouts.test_deepspeed import FROZEN, RTOL, _expected, _inspect, _rewrite

TAG = "global_step2"
MODEL = "mp_rank_00_model_states.pt"
WHATS = ("exp_avg", "grad_rms", "update", "weights")
MIXED = ("zero0_bf16", "zero0_fp16")
# The order the runs give the optimizer its trainable parameters, group by group.
TRAINED = (("0.weight", "2.weight"), ("0.bias", "2.bias"))


def _paths(run: Path) -> list[Path]:
    """The three ways to name one checkpoint: the run folder, its step folder, the file."""
    return [run, run / TAG, run / TAG / MODEL]


@pytest.mark.parametrize("what", WHATS)
def test_the_file_copied_out_of_its_folder_keeps_the_buffer_apart(deepspeed_runs, tmp_path,
                                                                 what):
    """The model state file renamed, away from its folder, is read as a file: its
    ``buffer_names`` still say ``scale`` is a buffer. It was measured as a weight (the
    weight total 1.9x the parameters', exit 0)."""
    file = tmp_path / "model.pt"
    shutil.copyfile(deepspeed_runs / "zero0" / TAG / MODEL, file)
    expected = _expected(torch.load(deepspeed_runs / "zero0.reference.pt"), what)
    doc = _inspect(file, what)
    assert {t["name"] for t in doc["tensors"]} == set(expected)
    total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    assert doc["total_norm"] == pytest.approx(total, rel=RTOL)
    assert doc["roles"].get("buffer") == 1


@pytest.mark.parametrize("run", MIXED)
def test_the_mixed_precision_file_alone_says_what_its_optimizer_holds(deepspeed_runs,
                                                                      tmp_path, run):
    """fp16/bf16 without ZeRO, the model state file renamed away from its folder: its
    'optimizer' is DeepSpeed's FP16_UnfusedOptimizer state around the moments, which a
    file alone is not read as. The refusal said it "holds no optimizer state"; it says
    what it holds, and both ways out it offers work: --what weights, and the file under
    its own name in a folder of its own (read as the folder is)."""
    file = tmp_path / "model.pt"
    shutil.copyfile(deepspeed_runs / run / TAG / MODEL, file)
    line = assert_refused(run_cli("inspect", file, "--what", "exp_avg"), file)
    assert "no optimizer state" not in line
    assert "FP16_UnfusedOptimizer" in line and "optimizer_state_dict" in line
    assert "available: --what weights" in line and "a folder of its own" in line
    assert _inspect(file, "weights")["what"] == "weights"
    alone = tmp_path / "alone" / MODEL
    alone.parent.mkdir()
    shutil.copyfile(file, alone)
    expected, _ = _mixed_expected(deepspeed_runs / run, "exp_avg")
    total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    assert _inspect(alone, "exp_avg")["total_norm"] == pytest.approx(total, rel=RTOL)


def test_the_fused_fp16_optimizer_file_alone_says_what_it_holds(deepspeed_runs, tmp_path):
    """FP16_Optimizer's flat groups, which not even the folder is read with: the refusal
    names them and offers the weights alone."""
    file = tmp_path / "model.pt"
    shutil.copyfile(deepspeed_runs / "zero0_fp16" / TAG / MODEL, file)

    def edit(root):
        wrapper = root["optimizer"]
        wrapper["fp32_groups_flat"] = [torch.cat([t.flatten() for t in g])
                                       for g in wrapper.pop("fp32_groups")]
    _rewrite(file, edit)
    line = assert_refused(run_cli("inspect", file, "--what", "exp_avg"), file)
    assert "no optimizer state" not in line and "a folder of its own" not in line
    assert "FP16_Optimizer" in line and "fp32_groups_flat" in line
    assert "available: --what weights" in line
    assert _inspect(file, "weights")["what"] == "weights"


@pytest.mark.parametrize("run", MIXED)
def test_the_mixed_precision_file_alone_offers_no_master_weights_as_gradients(
        deepspeed_runs, tmp_path, run):
    """Its 'optimizer' wrapper keeps the fp32 master weights in fp32_groups: they were
    offered as --key candidates for gradients, and the key measured them as a gradient
    norm with exit 0. No candidate is offered, such a key is refused, and the ways out
    it names work."""
    file = tmp_path / "model.pt"
    shutil.copyfile(deepspeed_runs / run / TAG / MODEL, file)
    line = assert_refused(run_cli("inspect", file, "--what", "grads"), file)
    assert "fp32_groups" not in line and "candidates for --key" not in line
    assert "available: --what weights" in line
    for key in ("optimizer.fp32_groups", "optimizer.fp32_groups.0"):
        line = assert_refused(run_cli("inspect", file, "--key", key), file)
        assert line.endswith(f"--key '{key}' is in 'optimizer.fp32_groups', a mixed-precision "
                             "optimizer's fp32 master weights: not gradients; the model's "
                             "weights are measured with --what weights")
    assert _inspect(file, "weights")["what"] == "weights"
    line = assert_refused(run_cli("inspect", file, "--key", "optimizer"), file)
    assert line.endswith("(gradclip inspect --key optimizer.optimizer_state_dict)")
    result = run_cli("inspect", file, "--key", "optimizer.optimizer_state_dict",
                     "--format", "json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["what"] != "grads"


@pytest.mark.parametrize("what", WHATS)
def test_fp32_numbers_match_a_plain_adamw_run(deepspeed_runs, what):
    reference = torch.load(deepspeed_runs / "zero0.reference.pt")
    expected = _expected(reference, what)
    weights = _expected(reference, "weights")
    for path in _paths(deepspeed_runs / "zero0"):
        doc = _inspect(path, what)
        assert doc["what"] == what
        tensors = {t["name"]: t for t in doc["tensors"]}
        assert list(tensors) == list(expected)  # the model's order; never the buffer
        assert (FROZEN[0] in tensors) == (what == "weights")
        for name, value in expected.items():
            assert tensors[name]["shape"] == list(value.shape)
            assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=RTOL), name
            if what != "weights":
                ratio = value.norm().item() / weights[name].norm().item()
                assert tensors[name]["ratio"] == pytest.approx(ratio, rel=RTOL)
        total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
        assert doc["total_norm"] == pytest.approx(total, rel=RTOL)
        assert [g["name"] for g in doc["groups"]] == (
            ["0", "2", "4"] if what == "weights" else ["0", "2"])


def _mixed_expected(run: Path, what: str) -> tuple[dict[str, torch.Tensor], float]:
    """``what`` per parameter in float64 from the file as torch loads it, and Adam's step."""
    root = torch.load(run / TAG / MODEL, weights_only=False)
    wrapper = root["optimizer"]
    osd = wrapper["optimizer_state_dict"]
    found, steps = {}, set()
    for g, names in enumerate(TRAINED):
        group = osd["param_groups"][g]
        for name, pid, master in zip(names, group["params"], wrapper["fp32_groups"][g]):
            entry = osd["state"][pid]
            step = float(entry["step"])
            steps.add(step)
            beta1, beta2 = group["betas"]
            m = entry["exp_avg"].double() / (1 - beta1 ** step)
            v = entry["exp_avg_sq"].double() / (1 - beta2 ** step)
            found[name] = {"exp_avg": m, "grad_rms": v.sqrt(),
                           "update": group["lr"] * m / (v.sqrt() + group["eps"]),
                           "weights": master.double()}[what]
    (step,) = steps
    module = root["module"]
    order = [n for n in module if n != "scale"]
    if what == "weights":  # the frozen layer: its 16-bit module weights, no master
        found.update({n: module[n].double() for n in FROZEN})
    return {n: found[n] for n in order if n in found}, step


@pytest.mark.parametrize("run", MIXED)
@pytest.mark.parametrize("what", WHATS)
def test_mixed_precision_numbers_are_the_files_own(deepspeed_runs, run, what):
    expected, step = _mixed_expected(deepspeed_runs / run, what)
    # DeepSpeed's fp16/bf16 optimizer steps once with zero gradients to create its state.
    assert step == STEPS + 1
    for path in _paths(deepspeed_runs / run):
        doc = _inspect(path, what)
        tensors = {t["name"]: t for t in doc["tensors"]}
        assert list(tensors) == list(expected)
        for name, value in expected.items():
            assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=1e-6), name
            assert tensors[name]["max_abs"] == pytest.approx(value.abs().max().item(),
                                                             rel=1e-6)
        total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
        assert doc["total_norm"] == pytest.approx(total, rel=1e-6)
    weights = {t["name"]: t["dtype"] for t in _inspect(deepspeed_runs / run, "weights")["tensors"]}
    low = "bfloat16" if run.endswith("bf16") else "float16"
    assert weights == {"0.weight": "float32", "0.bias": "float32", "2.weight": "float32",
                       "2.bias": "float32", "4.weight": low, "4.bias": low}


@pytest.mark.parametrize("run", ("zero0",) + MIXED)
def test_header_step_and_auto(deepspeed_runs, run):
    table = run_cli("inspect", deepspeed_runs / run, "--no-progress", "--top", "0")
    assert table.code == 0, table.err
    text = " ".join(table.out.split())
    assert f"DeepSpeed checkpoint without ZeRO (stage 0) at global step {STEPS}" in text
    assert "2 parameter(s) without optimizer state (frozen)" in text
    assert "buffers" not in text or "scale" in text
    doc = _inspect(deepspeed_runs / run, "auto")
    assert doc["what"] == "exp_avg"
    if run in MIXED:
        assert "fp32 master weights and Adam moments of 4 parameters" in text
        assert f"Adam's step is {STEPS + 1}" in text


def test_trend_over_the_run_folder(deepspeed_runs):
    result = run_cli("trend", deepspeed_runs / "zero0", "--format", "json", "--no-progress")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert [p["step"] for p in doc["points"]] == [1, 2]
    last = _inspect(deepspeed_runs / "zero0", "exp_avg")
    assert doc["what"] == "exp_avg"
    assert doc["points"][-1]["total_norm"] == pytest.approx(last["total_norm"], rel=1e-12)


def test_two_ranks_print_the_one_process_report(deepspeed_runs, tmp_path):
    jobs = [{"args": ["inspect", str(deepspeed_runs / run), "--what", what, "--format", fmt,
                      "--no-progress"]}
            for run in ("zero0", "zero0_fp16") for what in ("auto", "weights")
            for fmt in ("table", "json")]
    same_under_torchrun(jobs, tmp_path)


def test_clip_refuses_as_for_any_deepspeed_checkpoint(deepspeed_runs):
    for run in ("zero0", "zero2"):
        result = run_cli("clip", deepspeed_runs / run, "--max-norm", "1", "--no-progress")
        assert_refused(result, deepspeed_runs / run, "a DeepSpeed checkpoint holds no gradients")


def test_grads_explains_what_is_there(deepspeed_runs):
    result = run_cli("inspect", deepspeed_runs / "zero0", "--what", "grads", "--no-progress")
    line = assert_refused(result, deepspeed_runs / "zero0", "no gradients")
    assert "--what exp_avg" in line


def test_the_hyperparameters_are_the_runs(deepspeed_runs):
    root = torch.load(deepspeed_runs / "zero0" / TAG / MODEL, weights_only=False)
    group = root["optimizer"]["param_groups"][0]
    assert (group["lr"], tuple(group["betas"]), group["eps"]) == (LR, BETAS, EPS)


# ------------------------------------------------------------------ broken and hostile


@pytest.fixture
def copy(deepspeed_runs, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "zero0_bf16", target)
    return target


def test_no_buffer_names(copy):
    file = copy / TAG / MODEL
    _rewrite(file, lambda root: root.pop("buffer_names"))
    assert_refused(run_cli("inspect", copy), file, "buffer_names")


def test_fp32_groups_of_the_wrong_length(copy):
    file = copy / TAG / MODEL
    _rewrite(file, lambda root: root["optimizer"]["fp32_groups"][1].pop())
    assert_refused(run_cli("inspect", copy), file, "fp32_groups[1]")


def test_a_master_of_the_wrong_shape(copy):
    file = copy / TAG / MODEL

    def edit(root):
        root["optimizer"]["fp32_groups"][0][1] = torch.zeros(4)
    _rewrite(file, edit)
    assert_refused(run_cli("inspect", copy), file, "the masters and the module disagree")


def _poison(root, *, module: bool, master: bool) -> None:
    """A NaN at [0, 0] of the first trained weight: in the module's 16-bit tensor, in its
    fp32 master (fp32_groups[0][0]), or both, as a run that diverged saves them."""
    name = TRAINED[0][0]
    with torch.no_grad():  # the masters are saved as leaves that require grad
        if module:
            root["module"][name][0, 0] = float("nan")
        if master:
            root["optimizer"]["fp32_groups"][0][0][0, 0] = float("nan")


def test_a_diverged_run_s_nan_master_and_weight_are_a_finding_not_a_refusal(copy):
    """master_copy's NaN policy: a NaN master that rounds to the module's NaN is the same
    weight, so the checkpoint of a run that diverged reads, and its NaN is reported as
    what it is, a non-finite weight."""
    file = copy / TAG / MODEL
    _rewrite(file, lambda root: _poison(root, module=True, master=True))
    result = run_cli("inspect", copy, "--what", "weights", "--format", "json", "--no-progress")
    assert result.code == 1, result.err
    doc = json.loads(result.out)
    assert (doc["what"], doc["status"], doc["nonfinite"]["nan"]) == ("weights", "nonfinite", 1)
    tensor = next(t for t in doc["tensors"] if t["name"] == TRAINED[0][0])
    assert tensor["nonfinite"]["nan"] == 1
    # The moments are untouched and measured as before.
    assert run_cli("inspect", copy, "--what", "exp_avg", "--no-progress").code == 0


@pytest.mark.parametrize("where", ["master", "module"])
def test_a_nan_on_one_side_only_is_a_disagreement(copy, where):
    file = copy / TAG / MODEL
    _rewrite(file, lambda root: _poison(root, module=where == "module",
                                        master=where == "master"))
    assert_refused(run_cli("inspect", copy, "--what", "weights"), file,
                   "the masters and the module disagree")


def test_fused_fp16_optimizers_flat_groups_are_refused(copy):
    """DeepSpeed's fused FP16_Optimizer (CUDA only) keeps one flat buffer per group."""
    file = copy / TAG / MODEL

    def edit(root):
        wrapper = root["optimizer"]
        wrapper["fp32_groups_flat"] = [torch.cat([t.flatten() for t in g])
                                       for g in wrapper.pop("fp32_groups")]
    _rewrite(file, edit)
    assert_refused(run_cli("inspect", copy), file, "FP16_Optimizer", "does not read")


def test_a_zero_checkpoint_without_its_optimizer_files(deepspeed_runs, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "zero2", target)
    for file in (target / TAG).glob("zero_pp_rank_*"):
        file.unlink()
    assert_refused(run_cli("inspect", target), target / TAG / MODEL,
                   "optimizer's files are missing")


def test_frozen_and_trained_alike_without_value_evidence_is_refused(copy):
    """With the frozen 4.bias equal to the trained 2.bias (both of 3 elements), the
    masters round to both: which one the optimizer holds cannot be told, exit 3, not a
    guess."""
    file = copy / TAG / MODEL

    def edit(root):
        root["module"]["4.bias"] = root["module"]["2.bias"].clone()
    _rewrite(file, edit)
    assert_refused(run_cli("inspect", copy), file, "more than one way")


@pytest.mark.parametrize("seed", range(6))
def test_damaged_files_are_a_report_or_one_line(deepspeed_runs, tmp_path, seed):
    rng = random.Random(seed)
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / ("zero0", *MIXED)[seed % 3], target)
    file = target / TAG / MODEL
    data = bytearray(file.read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    file.write_bytes(bytes(data))
    assert_clean_inspect(run_cli("inspect", target, "--format", "json", "--no-progress"),
                         target)


def test_a_folder_with_deepspeeds_marks_says_what_is_missing(deepspeed_runs, tmp_path):
    """Not the list of every kind a folder could be (DeepSpeed's among them), but what this
    DeepSpeed folder lacks."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "zero2", target)
    (target / TAG / MODEL).unlink()  # the ZeRO optimizer files alone
    for path in (target / TAG, target):
        line = assert_refused(run_cli("inspect", path), path)
        assert "expected" not in line and "gradclip knows" not in line, line
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in assert_refused(
        run_cli("inspect", target / TAG), target / TAG, "not a checkpoint's set of rank files")
    assert_refused(run_cli("inspect", target), target / "latest", "'global_step2'",
                   "holds no DeepSpeed rank files")
