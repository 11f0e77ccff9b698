"""DeepSpeed checkpoints of two tensor-parallel ranks (``mp_rank_00_*``, ``mp_rank_01_*``),
written by DeepSpeed's own 2-process CPU run with a model-parallel unit
(``deepspeed_tp_run.py``).

Every number is checked against float64 of the values DeepSpeed itself holds at the
save (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` on each rank,
the shards gathered along their split axis; replicated ones once); the fixture is
checked to be tensor parallelism of one model against the same model trained unsplit
with plain AdamW. Names the rule cannot place, and ranks that are not one checkpoint,
are exit 3 with one line naming the file.
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

from tests.cli.support import rel_err, unwrapped
from tests.distributed.launch import same_under_torchrun
from tests.hardening.support import assert_refused, run_cli
from tests.layouts.deepspeed_tp_run import BETAS, EPS, LR
from tests.layouts.test_deepspeed import _rewrite

QUANTITIES = ("exp_avg", "grad_rms", "update", "weights")
# The reader's arithmetic against float64 of the same stored float32 values.
TOL = 1e-6
MODEL = "mp_rank_{:02d}_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_{:02d}_optim_states.pt"
# (fixture path under the run folder, reference, step): the save folder (``latest``)
# and a tag folder, ZeRO 1, 2 and 3 and no ZeRO, Megatron-core's and legacy Megatron's
# names, and ZeRO 2 over two data-parallel ranks per model-parallel rank.
CASES = {
    "zero1_core": ("zero1_core", "zero1_core.step3", 3),
    "zero1_core-step2": ("zero1_core/global_step2", "zero1_core.step2", 2),
    "zero2_legacy": ("zero2_legacy", "zero2_legacy.step2", 2),
    "zero3_core": ("zero3_core", "zero3_core.step2", 2),
    "zero2_dp2": ("zero2_dp2", "zero2_dp2.step2", 2),  # and data parallelism 2
    "zero0_core": ("zero0_core", "zero0_core.step2", 2),  # without ZeRO: one file a rank
    "zero0_bf16": ("zero0_bf16", "zero0_bf16.step2", 2),  # and in bf16 mixed precision
}


def _reference(runs: Path, name: str) -> dict:
    return torch.load(runs / f"{name}.reference.pt")


def _expected(reference: dict, what: str) -> dict[str, torch.Tensor]:
    """``what`` of every full parameter, in float64, from DeepSpeed's own values."""
    out = {}
    for name, entry in reference["exact"].items():
        if what == "weights":
            out[name] = entry["weight"].double()
            continue
        step = entry["step"]
        m = entry["exp_avg"].double() / (1 - BETAS[0] ** step)
        v = entry["exp_avg_sq"].double() / (1 - BETAS[1] ** step)
        out[name] = {"exp_avg": m, "grad_rms": v.sqrt(), "update": LR * m / (v.sqrt() + EPS)}[what]
    return out


def _norm(tensors) -> float:
    return torch.cat([t.reshape(-1) for t in tensors]).norm().item()


def _inspect(path: Path, *args: str) -> dict:
    result = run_cli("inspect", path, *args, "--format", "json", "--no-progress")
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_the_fixture_is_tensor_parallelism_of_one_model(deepspeed_tp_runs):
    """DeepSpeed wrote both model-parallel ranks' files, and the split model trained as the
    whole one does: its moments are the unsplit AdamW run's, up to float32 rounding in the
    reduction order (one k bias has a zero gradient in exact arithmetic, so its weights
    drift on noise: moments only)."""
    for run, (path, ref, step) in CASES.items():
        folder = deepspeed_tp_runs / path
        tag = folder if folder.name.startswith("global_step") else folder / f"global_step{step}"
        model = ("zero_pp_rank_0_" + MODEL) if run.startswith("zero3") else MODEL
        dp = (0, 1) if run.endswith("dp2") else (0,)
        optim = [OPTIM.format(r).replace("rank_0_", f"rank_{d}_", 1) for r in (0, 1) for d in dp]
        optim = [] if run.startswith("zero0") else optim  # the optimizer is in the model file
        assert sorted(os.listdir(tag)) == sorted([model.format(r) for r in (0, 1)] + optim), run
        reference = _reference(deepspeed_tp_runs, ref)
        if run.endswith("bf16"):  # bf16 arithmetic is no match for the fp32 mirror
            assert {e["step"] for e in reference["exact"].values()} == {step + 1}
            continue
        for name, entry in reference["exact"].items():
            mirror = reference["mirror"][name]
            assert entry["step"] == float(mirror["step"]) == step
            for key in ("exp_avg", "exp_avg_sq"):
                assert (
                    rel_err(entry[key].double().norm().item(), mirror[key].double().norm().item())
                    <= 1e-4
                ), (run, name, key)
        split = reference["split"]
        assert sum(axis is not None for axis in split.values()) == 14  # 6 a layer, 2 more
        assert (
            split[
                "decoder.layers.0.self_attention.linear_proj.bias"
                if "legacy" not in run
                else "language_model.encoder.layers.0.self_attention.dense.bias"
            ]
            is None
        )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_against_deepspeeds_own_values(deepspeed_tp_runs, case, what):
    path, ref, step = CASES[case]
    reference = _reference(deepspeed_tp_runs, ref)
    expected, weights = _expected(reference, what), _expected(reference, "weights")
    doc = _inspect(deepspeed_tp_runs / path, "--what", what)
    assert (doc["format"], doc["step"], doc["what"]) == ("deepspeed", step, what)
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert list(tensors) == reference["order"]  # the model's order
    for name, value in expected.items():
        row = tensors[name]
        assert row["shape"] == list(value.shape), name  # split ones: the full shape
        assert rel_err(row["norm"], value.norm().item()) <= TOL, name
        assert rel_err(row["max_abs"], value.abs().max().item()) <= TOL, name
        if what != "weights":
            assert (
                rel_err(row["ratio"], value.norm().item() / weights[name].norm().item()) <= TOL
            ), name
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    assert doc["num_elements"] == sum(v.numel() for v in expected.values())
    groups = {g["name"]: g for g in doc["groups"]}
    prefix = "decoder.layers" if "legacy" not in case else "language_model.encoder.layers"
    for layer in (0, 1):  # each layer a group of its own
        members = [v for n, v in expected.items() if n.startswith(f"{prefix}.{layer}.")]
        assert len(members) == 12
        assert rel_err(groups[f"{prefix}.{layer}"]["norm"], _norm(members)) <= TOL


def test_the_report_names_the_model_parallel_rank_files(deepspeed_tp_runs):
    doc = _inspect(deepspeed_tp_runs / "zero1_core")
    assert doc["what"] == "exp_avg"
    assert doc["measured"]["evidence"] == (
        f"a DeepSpeed checkpoint of 2 model-parallel ranks: {OPTIM.format(0)}, {OPTIM.format(1)}"
    )
    weights = _inspect(deepspeed_tp_runs / "zero1_core", "--what", "weights")
    assert weights["measured"]["evidence"] == (
        f"a DeepSpeed checkpoint of 2 model-parallel ranks: {MODEL.format(0)}, "
        f"{MODEL.format(1)}, fp32 master weights in {OPTIM.format(0)}, {OPTIM.format(1)}"
    )
    table = run_cli("inspect", deepspeed_tp_runs / "zero2_legacy", "--no-progress")
    assert table.code == 0, table.err
    text = unwrapped(table.out)
    assert "DeepSpeed ZeRO stage 2 checkpoint at global step 2" in text
    assert "2 model-parallel ranks (mp_rank_00, mp_rank_01) x 1 data-parallel rank(s)" in text
    assert "14 tensors split across the model-parallel ranks" in text
    assert "15 replicated (counted once, from mp_rank_00" in text


def test_the_report_without_zero_names_each_ranks_file(deepspeed_tp_runs):
    doc = _inspect(deepspeed_tp_runs / "zero0_core", "--what", "weights")
    assert doc["measured"]["evidence"] == (
        "a DeepSpeed checkpoint without ZeRO of 2 model-parallel ranks: "
        f"{MODEL.format(0)}, {MODEL.format(1)}' module"
    )
    table = run_cli("inspect", deepspeed_tp_runs / "zero0_core", "--no-progress")
    assert table.code == 0, table.err
    text = unwrapped(table.out)
    assert "DeepSpeed checkpoint without ZeRO (stage 0) at global step 2" in text
    assert "2 model-parallel ranks (mp_rank_00, mp_rank_01) x 1 data-parallel rank(s)" in text
    assert "Adam moments of 29 parameters" in text
    assert "14 tensors split across the model-parallel ranks" in text
    mixed = _inspect(deepspeed_tp_runs / "zero0_bf16", "--what", "weights")
    assert mixed["measured"]["evidence"] == (
        "a DeepSpeed checkpoint without ZeRO of 2 model-parallel ranks: fp32 master weights "
        "in each file's 'optimizer' (fp32_groups)"
    )
    assert {t["dtype"] for t in mixed["tensors"]} == {"float32"}
    table = run_cli("inspect", deepspeed_tp_runs / "zero0_bf16", "--no-progress")
    text = unwrapped(table.out)
    assert "bfloat16 module, fp32 master weights and Adam moments of 29 parameters" in text
    assert "Adam's step is 3: DeepSpeed's fp16/bf16 optimizer took one step" in text


@pytest.mark.parametrize("case", ["zero1_core", "zero2_dp2", "zero0_core"])
def test_a_split_parameter_is_its_shards_side_by_side(deepspeed_tp_runs, case):
    """The whole tensor a reader rebuilds is DeepSpeed's own, gathered along its split axis:
    from both model-parallel ranks' files where it is split, mp_rank_00's where replicated.
    Over two data-parallel ranks, ZeRO cuts linear_fc2's shard between two files."""
    from gradclip_cli.source.layouts import open_checkpoint

    path, ref, _ = CASES[case]
    reference = _reference(deepspeed_tp_runs, ref)
    contents = open_checkpoint(deepspeed_tp_runs / path)
    for name, entry in reference["exact"].items():
        stored = contents.weights[name]
        assert torch.equal(stored.read(), entry["weight"]), name
        ranks = {p.file.name.rpartition("mp_rank_")[2][:2] for p in stored.pieces}
        assert ranks == ({"00", "01"} if reference["split"][name] is not None else {"00"}), name


def test_a_model_without_megatrons_names_is_refused(deepspeed_tp_runs):
    """``blocks.0.attn.qkv``: whether it is split or replicated, its name does not say, and
    a replicated one would count twice: no norm at all rather than a wrong one."""
    folder = deepspeed_tp_runs / "zero1_plain"
    for what in ("auto", "weights"):
        assert_refused(
            run_cli("inspect", folder, "--what", what, "--no-progress"),
            folder / "global_step2" / MODEL.format(0),
            "wte.weight",
            "is not a layer Megatron's naming says how to split",
            "cannot tell how it is split",
        )


@pytest.mark.parametrize("what", ["auto", "weights"])
def test_a_rank_file_copied_out_of_its_folder_is_refused(deepspeed_tp_runs, tmp_path, what):
    """Without ZeRO, tensor-parallel rank 1's model state file read in its folder is the
    folder; copied out (renamed), its own shards were reported as the model's with exit 0.
    Its ``mp_world_size`` says it is one of two ranks: refused, naming the file."""
    file = tmp_path / "model.pt"
    shutil.copyfile(deepspeed_tp_runs / "zero0_core" / "global_step2" / MODEL.format(1), file)
    assert_refused(run_cli("inspect", file, "--what", what, "--no-progress"), file,
                   "one of 2 model-parallel ranks' shards", "give that folder")


def test_clip_refuses_and_writes_nothing(deepspeed_tp_runs, tmp_path):
    out = tmp_path / "out"
    result = run_cli("clip", deepspeed_tp_runs / "zero1_core", "--max-norm", "0.1", "-o", out)
    assert_refused(result, deepspeed_tp_runs / "zero1_core", "holds no gradients")
    assert not out.exists()


def test_grads_are_refused_offering_what_is_there(deepspeed_tp_runs):
    folder = deepspeed_tp_runs / "zero2_legacy"
    result = run_cli("inspect", folder, "--what", "grads", "--no-progress")
    line = assert_refused(result, folder, "no gradients")
    assert "--what exp_avg" in line
    offered = run_cli("inspect", folder, "--what", "exp_avg", "--no-progress")
    assert offered.code == 0, offered.err


def test_trend_over_the_save_folder(deepspeed_tp_runs):
    result = run_cli(
        "trend", deepspeed_tp_runs / "zero1_core", "--what", "exp_avg", "--format", "json"
    )
    assert result.code == 0, result.err
    points = json.loads(result.out)["points"]
    assert [p["step"] for p in points] == [2, 3]
    for point, ref in zip(points, ("zero1_core.step2", "zero1_core.step3")):
        expected = _expected(_reference(deepspeed_tp_runs, ref), "exp_avg")
        assert rel_err(point["total_norm"], _norm(expected.values())) <= TOL


def test_reading_never_imports_deepspeed(deepspeed_tp_runs):
    code = (
        "import sys; from gradclip_cli.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
        "sys.exit(code)\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "inspect",
            os.fspath(deepspeed_tp_runs / "zero2_legacy"),
            "--what",
            "update",
            "--format",
            "json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["what"] == "update"


def test_two_ranks_print_the_one_process_report(deepspeed_tp_runs, tmp_path):
    jobs = [
        {
            "args": [
                "inspect",
                str(deepspeed_tp_runs / run),
                "--what",
                what,
                "--format",
                fmt,
                "--no-progress",
            ]
        }
        for run in ("zero1_core", "zero0_core")
        for what in ("auto", "update")
        for fmt in ("table", "json")
    ]
    same_under_torchrun(jobs, tmp_path)


# ------------------------------------------------------------------ broken and hostile


@pytest.fixture
def copy(deepspeed_tp_runs, tmp_path) -> Path:
    """A private copy of the ZeRO 2 legacy-named checkpoint (save folder with ``latest``)."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_tp_runs / "zero2_legacy", target)
    return target / "global_step2"


def test_a_truncated_second_rank_file(copy):
    file = copy / OPTIM.format(1)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    assert_refused(run_cli("inspect", copy), file)


def test_a_missing_second_rank_model_file(copy):
    (copy / MODEL.format(1)).unlink()
    assert_refused(run_cli("inspect", copy), copy / MODEL.format(1), "missing")


def test_the_second_rank_missing_altogether(copy):
    """mp_rank_00's files alone: they say there are two ranks."""
    for file in (MODEL.format(1), OPTIM.format(1)):
        (copy / file).unlink()
    assert_refused(
        run_cli("inspect", copy),
        copy / MODEL.format(0),
        "mp_world_size is 2, but global_step2/ holds 1 model-parallel rank(s)",
    )


def test_a_gap_in_the_ranks(copy):
    """mp_rank_01's files renamed mp_rank_02."""
    (copy / MODEL.format(1)).rename(copy / MODEL.format(2))
    (copy / OPTIM.format(1)).rename(copy / OPTIM.format(2))
    assert_refused(run_cli("inspect", copy), copy, "but no mp_rank_01", "incomplete")


@pytest.mark.parametrize("key", ["mp_world_size", "tp_degree", "args"])
def test_ranks_that_disagree_on_the_world_size(copy, key):
    file = copy / MODEL.format(1)

    def edit(root):
        if key == "mp_world_size":
            root["mp_world_size"] = 4
        elif key == "tp_degree":
            root["checkpoint_parallel_dimensions"]["tp_degree"] = 4
        else:
            root["args"].tensor_model_parallel_size = 4

    _rewrite(file, edit)
    said = {"args": "args.tensor_model_parallel_size"}.get(key, key)
    assert_refused(run_cli("inspect", copy), file, f"{said} is 4", "holds 2 model-parallel rank(s)")


def test_a_rank_of_another_step(copy):
    file = copy / MODEL.format(1)
    _rewrite(file, lambda root: root.update(global_steps=7))
    assert_refused(run_cli("inspect", copy), file, "global_steps", "not one checkpoint")


def test_shapes_that_contradict_the_names(copy):
    """args.hidden_size says 16; the embedding's rows are 8 wide: not Megatron's split."""
    file = copy / MODEL.format(0)

    def edit(root):
        root["args"].hidden_size = 16

    _rewrite(file, edit)
    assert_refused(
        run_cli("inspect", copy),
        file,
        "word_embeddings.weight (shape [16, 8])",
        "is not a column-parallel weight of input size 16",
    )


def test_the_hidden_size_from_the_norms_without_args(copy, deepspeed_tp_runs):
    """A DeepSpeed model of Megatron's layers saved without Megatron's args: its norms give
    the hidden size the split is checked by; the numbers are the same."""
    for r in (0, 1):
        _rewrite(copy / MODEL.format(r), lambda root: root.pop("args"))
    expected = _expected(_reference(deepspeed_tp_runs, "zero2_legacy.step2"), "update")
    doc = _inspect(copy, "--what", "update")
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL


def test_ranks_of_different_models(copy):
    file = copy / MODEL.format(1)

    def edit(root):
        shapes = root["param_shapes"][0]
        root["param_shapes"][0] = {
            ("language_model.output_layer.w" if "output_layer" in k else k): v
            for k, v in shapes.items()
        }

    _rewrite(file, edit)
    assert_refused(run_cli("inspect", copy), file, "parameters differ", "not one model")


@pytest.mark.parametrize("seed", range(8))
def test_damaged_second_rank_files_are_a_report_or_one_line(deepspeed_tp_runs, tmp_path, seed):
    """Bytes flipped anywhere in an mp_rank_01 file (the pickle, the directory, the data),
    under ZeRO 1, 2 and 3 and without ZeRO."""
    import random

    from tests.hardening.support import assert_clean_inspect

    rng = random.Random(seed)
    target = tmp_path / "run"
    shutil.copytree(
        deepspeed_tp_runs / ("zero1_core", "zero2_legacy", "zero3_core", "zero0_core")[seed % 4],
        target,
    )
    tag = target / (target / "latest").read_text().strip()
    file = rng.choice(sorted(tag.glob("*mp_rank_01_*.pt")))
    data = bytearray(file.read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    file.write_bytes(bytes(data))
    assert_clean_inspect(run_cli("inspect", target, "--format", "json", "--no-progress"), target)


@pytest.mark.parametrize("what", ["step", "lr"])
def test_ranks_whose_optimizers_disagree(copy, what):
    file = copy / OPTIM.format(1)

    def edit(root):
        base = root["optimizer_state_dict"]["base_optimizer_state"]
        if what == "step":
            for entry in base["state"].values():
                entry["step"] = entry["step"] + 1
        else:
            base["param_groups"][0]["lr"] = 1.0

    _rewrite(file, edit)
    said = "Adam's step" if what == "step" else "lr, betas, eps"
    assert_refused(run_cli("inspect", copy), file, said, "not one checkpoint")


# Without ZeRO: each rank's one file holds its module and its optimizer.


@pytest.fixture
def plain_copy(deepspeed_tp_runs, tmp_path) -> Path:
    """A private copy of the checkpoint without ZeRO (its tag folder)."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_tp_runs / "zero0_core", target)
    return target / "global_step2"


def test_without_zero_the_second_rank_missing(plain_copy):
    """mp_rank_00's file alone: it says there are two ranks."""
    (plain_copy / MODEL.format(1)).unlink()
    assert_refused(
        run_cli("inspect", plain_copy),
        plain_copy / MODEL.format(0),
        "mp_world_size is 2, but the folder holds mp_rank_00 alone",
        "missing",
    )


def test_without_zero_a_gap_in_the_ranks(plain_copy):
    (plain_copy / MODEL.format(1)).rename(plain_copy / MODEL.format(2))
    assert_refused(run_cli("inspect", plain_copy), plain_copy, "but no mp_rank_01", "incomplete")


def test_without_zero_a_truncated_second_rank(plain_copy):
    file = plain_copy / MODEL.format(1)
    file.write_bytes(file.read_bytes()[:1000])
    assert_refused(run_cli("inspect", plain_copy), file)


@pytest.mark.parametrize("what", ["step", "lr", "shape", "global_steps"])
def test_without_zero_ranks_that_are_not_one_checkpoint(plain_copy, what):
    file = plain_copy / MODEL.format(1)

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
            name = "decoder.layers.0.mlp.linear_fc1.weight"
            root["module"][name] = root["module"][name][:4].clone()

    _rewrite(file, edit)
    said = {"step": "Adam's step", "lr": "lr, betas, eps", "shape": "cannot map optimizer state",
            "global_steps": "global_steps"}[what]
    assert_refused(run_cli("inspect", plain_copy), file, said)


def test_without_zero_a_rank_without_its_optimizer(plain_copy):
    file = plain_copy / MODEL.format(1)
    _rewrite(file, lambda root: root.update(optimizer=None))
    assert_refused(run_cli("inspect", plain_copy), file, "holds no optimizer state")


@pytest.mark.parametrize("rank", [0, 1])
def test_one_model_parallel_ranks_file_alone_names_the_folder(deepspeed_tp_runs, rank):
    """Under ZeRO each tensor-parallel rank's mp_rank_XX_model_states.pt holds that rank's
    shards: given alone it was measured as the model's whole weights, exit 0. The refusal
    names the folder, and the folder, as it says, reads."""
    folder = deepspeed_tp_runs / "zero1_core" / "global_step2"
    file = folder / f"mp_rank_{rank:02d}_model_states.pt"
    line = assert_refused(run_cli("inspect", file, "--no-progress"), file)
    assert line.endswith(f"give the folder: {folder}"), line
    assert _inspect(folder, "--what", "weights")["what"] == "weights"
