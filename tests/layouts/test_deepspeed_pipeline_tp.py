"""DeepSpeed pipeline parallelism over tensor-parallel ranks: a ``PipelineModule`` of 2
stages x 2 tensor-parallel ranks, written by DeepSpeed's own 4-process CPU run
(``deepspeed_tp_run.py --pipeline``), without ZeRO and under ZeRO 1; and one stage x 2
tensor-parallel ranks x 2 data-parallel ranks without ZeRO.

Every number is checked against float64 of the values the engine itself holds at the
save (its parameters and ``optimizer.state`` without ZeRO, ``safe_get_full_*`` under
ZeRO 1), each rank's shards gathered along their split axis and every stage's gathered
from all ranks; the fixture is checked to be pipeline and tensor parallelism of one model
against the same model trained unsplit with plain AdamW. Missing, damaged and disagreeing
files are exit 3 with one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.support import rel_err, unwrapped
from tests.distributed.launch import same_under_torchrun
from tests.hardening.support import assert_refused, run_cli
from tests.layouts.test_deepspeed import _rewrite
from tests.layouts.test_deepspeed_tp import QUANTITIES, TOL, _expected, _inspect, _norm, _reference

LAYER = "layer_{:02d}-model_{:02d}-model_states.pt"
MODEL = "mp_rank_{:02d}_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_{:02d}_optim_states.pt"
# (fixture path under the run folder, reference, step)
CASES = {
    "zero0": ("pipe2_zero0", "pipe2_zero0.step2", 2),
    "zero0-step1": ("pipe2_zero0/global_step1", "pipe2_zero0.step1", 1),
    "zero1": ("pipe2_zero1", "pipe2_zero1.step2", 2),
    "zero0-one-stage": ("pipe1_dp2_zero0", "pipe1_dp2_zero0.step2", 2),
}
# Each stage's layers: the embeddings and a transformer layer, a transformer layer and the head.
LAYERS = ("0", "1", "2", "3")


def test_the_fixture_is_pipeline_and_tensor_parallelism_of_one_model(deepspeed_pp_tp_runs):
    """DeepSpeed wrote every stage's and tensor-parallel rank's files, numbered stage by
    stage, and the split, staged model trained as the whole one does: its moments are the
    unsplit AdamW run's, up to float32 rounding in the reduction order."""
    for case, (path, ref, step) in CASES.items():
        folder = deepspeed_pp_tp_runs / path
        tag = folder if folder.name.startswith("global_step") else folder / f"global_step{step}"
        stages = 1 if "one-stage" in case else 2
        ranks = range(2 * stages)  # stage x 2 + tensor-parallel rank
        optim = [OPTIM.format(r) for r in ranks] if case == "zero1" else []
        layers = [LAYER.format(i, t) for i in range(4) for t in range(2)]
        assert sorted(os.listdir(tag)) == sorted(
            layers + [MODEL.format(r) for r in ranks] + optim
        ), case
        for r in ranks:
            root = torch.load(tag / MODEL.format(r), weights_only=False)
            assert root["mp_world_size"] == len(ranks) and root["module"] is None
            assert root["dp_world_size"] == 4 // len(ranks)
            assert root["checkpoint_parallel_dimensions"] == {
                "pp_degree": stages,
                "tp_degree": 2,
            }
        reference = _reference(deepspeed_pp_tp_runs, ref)
        assert list(reference["exact"]) == reference["order"]
        for name, entry in reference["exact"].items():
            mirror = reference["mirror"][name]
            assert entry["step"] == float(mirror["step"]) == step
            for key in ("exp_avg", "exp_avg_sq"):
                assert (
                    rel_err(entry[key].double().norm().item(), mirror[key].double().norm().item())
                    <= 1e-4
                ), (case, name, key)
        split = reference["split"]
        assert sum(axis is not None for axis in split.values()) == 14
        assert split["1.self_attention.dense.bias"] is None
        assert split["3.output_layer.weight"] == 0


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_against_the_engines_own_values(deepspeed_pp_tp_runs, case, what):
    path, ref, step = CASES[case]
    reference = _reference(deepspeed_pp_tp_runs, ref)
    expected, weights = _expected(reference, what), _expected(reference, "weights")
    doc = _inspect(deepspeed_pp_tp_runs / path, "--what", what)
    assert (doc["format"], doc["step"], doc["what"]) == ("deepspeed", step, what)
    tensors = {t["name"]: t for t in doc["tensors"]}
    if case.startswith("zero0"):  # the layer files in the model's order
        assert list(tensors) == reference["order"]
    assert sorted(tensors) == sorted(reference["order"])
    for name, value in expected.items():
        row = tensors[name]
        assert row["shape"] == list(value.shape), name  # split ones: the full shape
        assert row["group"] == name.split(".")[0], name  # the global layer index
        assert rel_err(row["norm"], value.norm().item()) <= TOL, name
        assert rel_err(row["max_abs"], value.abs().max().item()) <= TOL, name
        if what != "weights":
            assert (
                rel_err(row["ratio"], value.norm().item() / weights[name].norm().item()) <= TOL
            ), name
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    assert doc["num_elements"] == sum(v.numel() for v in expected.values()) == 1776
    groups = {g["name"]: g["norm"] for g in doc["groups"]}
    assert sorted(groups) == list(LAYERS)
    for layer in LAYERS:
        members = [v for n, v in expected.items() if n.split(".")[0] == layer]
        assert rel_err(groups[layer], _norm(members)) <= TOL, layer


def test_a_split_parameter_is_its_shards_side_by_side(deepspeed_pp_tp_runs):
    """Without ZeRO the whole tensor is the engine's own, gathered along its split axis: the
    two tensor-parallel ranks' layer files where it is split, rank 0's where replicated, each
    of its stage."""
    from gradclip_cli.source.layouts import open_checkpoint

    reference = _reference(deepspeed_pp_tp_runs, "pipe2_zero0.step2")
    contents = open_checkpoint(deepspeed_pp_tp_runs / "pipe2_zero0")
    for name, entry in reference["exact"].items():
        stored = contents.weights[name]
        assert torch.equal(stored.read(), entry["weight"]), name
        index = int(name.split(".")[0])
        ranks = (0, 1) if reference["split"][name] is not None else (0,)
        assert {p.file.name for p in stored.pieces} == {LAYER.format(index, t) for t in ranks}


def test_the_report_says_what_it_read(deepspeed_pp_tp_runs):
    plain = unwrapped(run_cli("inspect", deepspeed_pp_tp_runs / "pipe2_zero0", "--no-progress",
                              "--top", "0").out)
    assert "DeepSpeed pipeline checkpoint without ZeRO (stage 0) at global step 2" in plain
    assert (
        "2 pipeline stages x 2 tensor-parallel ranks (mp_rank_00 .. mp_rank_03) x 1 "
        "data-parallel rank(s)" in plain
    )
    assert (
        "weights of 29 parameters in 8 layer files (layer_00-model_00-model_states.pt .. "
        "layer_03-model_01-model_states.pt), Adam moments of 29" in plain
    )
    assert "14 tensors split across the tensor-parallel ranks" in plain
    assert "15 replicated (counted once, from each stage's tensor-parallel rank 0" in plain
    zero1 = unwrapped(run_cli("inspect", deepspeed_pp_tp_runs / "pipe2_zero1", "--no-progress",
                              "--top", "0").out)
    assert "DeepSpeed ZeRO stage 1 checkpoint at global step 2" in zero1
    assert (
        "2 pipeline stages x 2 tensor-parallel ranks (mp_rank_00 .. mp_rank_03) x 1 "
        "data-parallel rank(s), DeepSpeed" in zero1
    )
    assert "fp32 master weights and Adam moments of 29 parameters" in zero1
    one = unwrapped(run_cli("inspect", deepspeed_pp_tp_runs / "pipe1_dp2_zero0",
                            "--no-progress", "--top", "0").out)
    assert "2 model-parallel ranks (mp_rank_00, mp_rank_01) x 2 data-parallel rank(s)" in one
    assert "15 replicated (counted once, from mp_rank_00" in one
    assert "14 tensors split across the tensor-parallel ranks" in zero1
    doc = _inspect(deepspeed_pp_tp_runs / "pipe2_zero1")
    assert doc["measured"]["evidence"] == (
        "a DeepSpeed checkpoint of 2 pipeline stages x 2 tensor-parallel ranks: "
        f"{OPTIM.format(0)} .. {OPTIM.format(3)}"
    )


def test_trend_over_the_save_folder(deepspeed_pp_tp_runs):
    result = run_cli("trend", deepspeed_pp_tp_runs / "pipe2_zero0", "--what", "update",
                     "--format", "json")
    assert result.code == 0, result.err
    points = json.loads(result.out)["points"]
    assert [p["step"] for p in points] == [1, 2]
    for point, ref in zip(points, ("pipe2_zero0.step1", "pipe2_zero0.step2")):
        expected = _expected(_reference(deepspeed_pp_tp_runs, ref), "update")
        assert rel_err(point["total_norm"], _norm(expected.values())) <= TOL
        for layer in LAYERS:
            members = [v for n, v in expected.items() if n.split(".")[0] == layer]
            assert rel_err(point["groups"][layer], _norm(members)) <= TOL


def test_two_ranks_print_the_one_process_report(deepspeed_pp_tp_runs, tmp_path):
    jobs = [
        {"args": ["inspect", str(deepspeed_pp_tp_runs / run), "--what", what, "--format", fmt,
                  "--no-progress"]}
        for run in ("pipe2_zero0", "pipe2_zero1")
        for what in ("auto", "weights")
        for fmt in ("table", "json")
    ]
    same_under_torchrun(jobs, tmp_path)


# ------------------------------------------------------------------ broken and hostile


@pytest.fixture
def plain_copy(deepspeed_pp_tp_runs, tmp_path) -> Path:
    """A private copy of the pipeline without ZeRO (its step 2 folder)."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_pp_tp_runs / "pipe2_zero0" / "global_step2", target)
    return target


@pytest.fixture
def zero1_copy(deepspeed_pp_tp_runs, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(deepspeed_pp_tp_runs / "pipe2_zero1" / "global_step2", target)
    return target


def test_a_missing_shard_file(plain_copy):
    (plain_copy / LAYER.format(1, 1)).unlink()
    assert_refused(run_cli("inspect", plain_copy), plain_copy / LAYER.format(1, 1), "missing",
                   LAYER.format(1, 0))


def test_a_truncated_shard_file(plain_copy):
    file = plain_copy / LAYER.format(2, 1)
    file.write_bytes(file.read_bytes()[:300])
    assert_refused(run_cli("inspect", plain_copy), file)


def test_a_tensor_parallel_rank_missing_altogether(plain_copy):
    """Rank 1's layer files gone: the stage files say there are two."""
    for index in range(4):
        (plain_copy / LAYER.format(index, 1)).unlink()
    assert_refused(run_cli("inspect", plain_copy), plain_copy / MODEL.format(0),
                   "pp_degree is 2", "4 pipeline stage file(s)")


def test_a_stage_file_missing(plain_copy):
    (plain_copy / MODEL.format(3)).unlink()
    assert_refused(run_cli("inspect", plain_copy), plain_copy / MODEL.format(0),
                   "mp_world_size is 4", "3 model state files",
                   "layer files of 2 tensor-parallel ranks")


@pytest.mark.parametrize("what", ["step", "lr", "global_steps", "tp_degree"])
def test_ranks_that_disagree(plain_copy, what):
    """The last stage's second tensor-parallel rank (``mp_rank_03``) edited."""
    file = plain_copy / MODEL.format(3)

    def edit(root):
        optimizer = root["optimizer"]
        if what == "step":
            for entry in optimizer["state"].values():
                entry["step"] = entry["step"] + 1
        elif what == "lr":
            optimizer["param_groups"][0]["lr"] = 1.0
        elif what == "global_steps":
            root["global_steps"] = 7
        else:
            root["checkpoint_parallel_dimensions"]["tp_degree"] = 4

    _rewrite(file, edit)
    said = {"step": "Adam's step", "lr": "lr, betas, eps", "global_steps": "global_steps",
            "tp_degree": "tp_degree is 4"}[what]
    assert_refused(run_cli("inspect", plain_copy), file, said)


def test_a_shard_of_another_shape(plain_copy):
    """Rank 1's qkv shard of layer 2 cut short: the ranks are not one model."""
    file = plain_copy / LAYER.format(2, 1)
    name = "self_attention.query_key_value.weight"
    _rewrite(file, lambda root: root.update({name: root[name][:6].clone()}))
    assert_refused(run_cli("inspect", plain_copy), plain_copy / MODEL.format(3),
                   "cannot map optimizer state")


def test_a_name_the_rule_cannot_place(plain_copy):
    """The final norm named as Megatron-DeepSpeed's ``GPTModelPipe`` names its own
    (``LayerSpec(LayerNorm)``: ``3.weight``): split or replicated, its name does not say."""
    for t in (0, 1):
        def edit(root):
            for kind in ("weight", "bias"):
                root[kind] = root.pop(f"final_layernorm.{kind}")
        _rewrite(plain_copy / LAYER.format(3, t), edit)
    assert_refused(run_cli("inspect", plain_copy), plain_copy / LAYER.format(3, 0), "3.weight",
                   "cannot tell how it is split")


def test_zero1_a_missing_optimizer_file(zero1_copy):
    (zero1_copy / OPTIM.format(3)).unlink()
    assert_refused(run_cli("inspect", zero1_copy), zero1_copy / OPTIM.format(3), "missing")


def test_zero1_a_truncated_model_file(zero1_copy):
    file = zero1_copy / MODEL.format(2)
    file.write_bytes(file.read_bytes()[:1000])
    assert_refused(run_cli("inspect", zero1_copy), file)


@pytest.mark.parametrize("what", ["step", "tp_degree", "global_steps"])
def test_zero1_ranks_that_disagree(zero1_copy, what):
    file = zero1_copy / (OPTIM if what == "step" else MODEL).format(3)

    def edit(root):
        if what == "step":
            base = root["optimizer_state_dict"]["base_optimizer_state"]
            for entry in base["state"].values():
                entry["step"] = entry["step"] + 1
        elif what == "tp_degree":
            root["checkpoint_parallel_dimensions"]["tp_degree"] = 4
        else:
            root["global_steps"] = 7

    _rewrite(file, edit)
    said = {"step": "Adam's step", "tp_degree": "checkpoint_parallel_dimensions is",
            "global_steps": "global_steps"}[what]
    assert_refused(run_cli("inspect", zero1_copy), file, said, "not one checkpoint")
