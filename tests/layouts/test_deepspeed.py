"""DeepSpeed ZeRO checkpoints, written by DeepSpeed's own 2-rank CPU training.

Every number is checked against float64 computed here from an independent
reference: the same model trained with plain ``torch.optim.AdamW`` on the
same batches (``deepspeed_runs.py``), and, for the weights, DeepSpeed's own
``zero_to_fp32`` reader. Broken and hostile copies are exit 3 with one line
naming the file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradclip_cli.source.interface import Piece, StoredTensor
from tests.cli.support import unwrapped
from tests.hardening.support import assert_refused, run_cli
from tests.layouts.deepspeed_runs import BETAS, EPS, LR, STEPS

STAGES = (1, 2, 3)
FROZEN = ("4.weight", "4.bias")  # requires_grad=False in every run
TAG = "global_step2"
# The reference reduces gradients with all_reduce, ZeRO with reduce_scatter: the
# float32 results may differ in the last bits per step (2 steps, values ~1).
RTOL = 1e-5


def _optim(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _inspect(path: Path, what: str) -> dict:
    result = run_cli("inspect", path, "--what", what, "--format", "json", "--no-progress")
    assert result.code == 0, result.err
    return json.loads(result.out)


def _expected(reference: dict, what: str) -> dict[str, torch.Tensor]:
    """``what`` per parameter, in float64, from the plain AdamW run's state; the frozen
    parameters (no state) for the weights alone."""
    out = {}
    for name, entry in reference.items():
        if what == "weights":
            out[name] = entry["weight"].double()
            continue
        if name in FROZEN:
            assert "step" not in entry
            continue
        step = float(entry["step"])
        assert step == STEPS
        c1, c2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
        m = entry["exp_avg"].double() / c1
        v = entry["exp_avg_sq"].double() / c2
        out[name] = {"exp_avg": m, "grad_rms": v.sqrt(),
                     "update": LR * m / (v.sqrt() + EPS),
                     "weights": entry["weight"].double()}[what]
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("what", ["exp_avg", "grad_rms", "update", "weights"])
def test_numbers_match_a_plain_adamw_run(deepspeed_runs, stage, what):
    reference = torch.load(deepspeed_runs / f"zero{stage}.reference.pt")
    expected = _expected(reference, what)
    weights = _expected(reference, "weights")
    doc = _inspect(deepspeed_runs / f"zero{stage}", what)
    assert doc["what"] == what
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert list(tensors) == list(expected)  # the model's order, not param_shapes' groups
    assert (FROZEN[0] in tensors) == (what == "weights")
    for name, value in expected.items():
        assert tensors[name]["shape"] == list(value.shape)
        assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=RTOL)
        assert tensors[name]["max_abs"] == pytest.approx(value.abs().max().item(), rel=RTOL)
        if what != "weights":
            ratio = value.norm().item() / weights[name].norm().item()
            assert tensors[name]["ratio"] == pytest.approx(ratio, rel=RTOL)
    total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
    assert doc["total_norm"] == pytest.approx(total, rel=RTOL)
    assert doc["num_elements"] == sum(v.numel() for v in expected.values())


@pytest.mark.parametrize("stage", STAGES)
def test_weights_are_zero_to_fp32s(deepspeed_runs, stage):
    """The fp32 master weights, element for element, as DeepSpeed's own reader rebuilds them."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from gradclip_cli.source.layouts import open_checkpoint

    theirs = get_fp32_state_dict_from_zero_checkpoint(os.fspath(deepspeed_runs / f"zero{stage}"))
    ours = open_checkpoint(deepspeed_runs / f"zero{stage}")
    assert ours.kind == "deepspeed" and ours.step == STEPS
    # ZeRO 1 saves no frozen_param_* (zero_to_fp32 leaves them out); its whole module
    # state dict holds them.
    assert set(ours.weights) == set(theirs) | (set(FROZEN) if stage == 1 else set())
    for name, tensor in theirs.items():
        assert torch.equal(ours.weights[name].read(), tensor), name
    # The frozen layer never moved: the weights it started with, on every stage.
    reference = torch.load(deepspeed_runs / f"zero{stage}.reference.pt")
    for name in FROZEN:
        assert torch.equal(ours.weights[name].read(), reference[name]["weight"]), name
    # 0.weight (35 elements) starts in rank 0's partition and ends in rank 1's.
    split = ours.weights["0.weight"]
    assert {p.file.name for p in split.pieces} == {_optim(0), _optim(1)}
    frozen_files = {p.file.name for p in ours.weights["4.weight"].pieces}
    if stage == 3:  # 9 elements: 5 on rank 0, 4 and a padding element on rank 1
        assert frozen_files == {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)}
    else:
        assert frozen_files == {"mp_rank_00_model_states.pt"}
    line = "2 frozen parameter(s): weights without Adam moments"
    assert any(d.startswith(line) for d in ours.description)


def test_bf16_mixed_precision_rank_files(deepspeed_runs):
    """``bf16_zero_pp_rank_*`` files: weights as ``zero_to_fp32`` rebuilds them; the total
    ``exp_avg`` norm is that of every rank's flat moments (their padding is zero)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from gradclip_cli.source.layouts import open_checkpoint

    folder = deepspeed_runs / "zero2_bf16"
    assert sorted(p.name for p in (folder / TAG).glob("bf16_*")) == [
        f"bf16_{_optim(0)}", f"bf16_{_optim(1)}"]
    theirs = get_fp32_state_dict_from_zero_checkpoint(os.fspath(folder))
    ours = open_checkpoint(folder)
    assert set(ours.weights) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours.weights[name].read(), tensor), name
    squares = 0.0
    for rank in range(2):
        root = torch.load(folder / TAG / f"bf16_{_optim(rank)}", weights_only=False)
        for entry in root["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            assert float(entry["step"]) == STEPS
            squares += float(entry["exp_avg"].double().square().sum())
    doc = _inspect(folder, "exp_avg")
    expected = math.sqrt(squares) / (1 - BETAS[0] ** STEPS)
    assert doc["total_norm"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("stage", STAGES)
def test_auto_reports_exp_avg_by_name_and_step(deepspeed_runs, stage):
    doc = _inspect(deepspeed_runs / f"zero{stage}", "auto")
    assert doc["what"] == "exp_avg"
    assert [t["name"] for t in doc["tensors"]] != []
    step_folder = _inspect(deepspeed_runs / f"zero{stage}" / TAG, "auto")
    assert step_folder["total_norm"] == doc["total_norm"]
    table = run_cli("inspect", deepspeed_runs / f"zero{stage}", "--no-progress")
    assert table.code == 0, table.err
    assert f"DeepSpeed ZeRO stage {stage} checkpoint at global step {STEPS}" in unwrapped(
        table.out)


def test_grads_explains_what_is_there(deepspeed_runs):
    result = run_cli("inspect", deepspeed_runs / "zero2", "--what", "grads", "--no-progress")
    line = assert_refused(result, deepspeed_runs / "zero2", "no gradients")
    assert "--what exp_avg" in line


def test_reading_never_imports_deepspeed(deepspeed_runs):
    code = ("import sys; from gradclip_cli.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
            "sys.exit(code)\n")
    for stage in STAGES:
        run = subprocess.run([sys.executable, "-c", code, "inspect",
                              os.fspath(deepspeed_runs / f"zero{stage}"), "--what", "update",
                              "--no-progress", "--format", "json"],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["what"] == "update"


@pytest.mark.parametrize(("run", "name"), [
    ("zero2", _optim(0)), ("zero3", _optim(1)),
    ("zero3", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ("pipe2_zero1", "mp_rank_01_model_states.pt")])
@pytest.mark.parametrize("trust", [(), ("--trust-pickle",)])
def test_a_file_of_a_split_checkpoint_alone_is_refused_naming_its_folder(
        deepspeed_runs, run, name, trust):
    """One rank's file holds a slice of the flat partitions (its optimizer file), empty
    placeholders for the weights (ZeRO 3's model state file) or no module at all (a
    pipeline stage's file beside the layer files): it was read as a plain file,
    ZeRO 3's weights reported as norm 0 with exit 0 and, under --trust-pickle, an optimizer
    file's master weights offered as a --key of gradients. The refusal names the folder,
    and the folder, as it says, reads."""
    folder = deepspeed_runs / run / TAG
    file = folder / name
    for fmt in ("table", "json"):
        result = run_cli("inspect", file, *trust, "--no-progress", "--format", fmt)
        assert result.code == 3, (result.code, result.err)
        line = result.err_lines[-1]
        assert str(file) in line and line.endswith(f"give the folder: {folder}"), line
        assert "--key" not in line and "--trust-pickle" not in line, line
        if fmt == "json":
            assert json.loads(result.out)["error"] == line.removeprefix("gradclip: ")
    assert _inspect(folder, "weights")["what"] == "weights"


@pytest.mark.parametrize(("run", "name", "holds"), [
    ("zero2", _optim(0), "one rank's ZeRO optimizer partition"),
    ("zero3", _optim(1), "one rank's ZeRO optimizer partition"),
    ("zero3", "zero_pp_rank_0_mp_rank_00_model_states.pt", "ZeRO 3's empty placeholders"),
    ("pipe2_zero1", "mp_rank_01_model_states.pt", "one of 2 model-parallel ranks' shards")])
@pytest.mark.parametrize("trust", [(), ("--trust-pickle",)])
def test_a_rank_file_copied_out_of_its_folder_is_refused_by_its_content(
        deepspeed_runs, tmp_path, run, name, holds, trust):
    """The same rank files, copied away from the folder's other files (renamed, or alone
    under their own name): recognised by what they hold, not where they lie. ZeRO 3's
    model state file was read as weights of norm 0 with exit 0, and under --trust-pickle
    an optimizer file's flat master weights were offered as a --key of gradients (followed,
    their norm was reported as a gradient norm, exit 0)."""
    source = deepspeed_runs / run / TAG / name
    (tmp_path / "alone").mkdir()
    for file in (tmp_path / "model.pt", tmp_path / "alone" / name):
        shutil.copyfile(source, file)
        for fmt in ("table", "json"):
            result = run_cli("inspect", file, *trust, "--no-progress", "--format", fmt)
            assert result.code == 3, (result.code, result.err, result.out)
            line = result.err_lines[-1]
            # Alone under its own name, a stage's file is its folder's (incomplete) ranks.
            named = file.parent if file.name == "mp_rank_01_model_states.pt" else file
            assert str(named) in line, line
            assert file.name != "model.pt" or "DeepSpeed" in line and holds in line, line
            assert "--key" not in line and "--trust-pickle" not in line, line
            if fmt == "json":
                assert json.loads(result.out)["error"] == line.removeprefix("gradclip: ")
        for what in ("weights", "exp_avg"):
            result = run_cli("inspect", file, *trust, "--no-progress", "--what", what)
            assert result.code == 3 and str(named) in result.err_lines[-1], result.err


def test_zero1_module_file_alone_holds_the_whole_module(deepspeed_runs):
    """ZeRO 1/2's mp_rank_00_model_states.pt holds every weight whole: read as one file."""
    file = deepspeed_runs / "zero1" / TAG / "mp_rank_00_model_states.pt"
    doc = _inspect(file, "weights")
    expected = _expected(torch.load(deepspeed_runs / "zero1.reference.pt"), "weights")
    assert {t["name"] for t in doc["tensors"]} == set(expected)
    total = math.sqrt(sum(float(v.norm()) ** 2 for v in expected.values()))
    assert doc["total_norm"] == pytest.approx(total, rel=RTOL)


# ------------------------------------------------------------------ broken and hostile


@pytest.fixture
def copy(deepspeed_runs, tmp_path) -> Path:
    """A private copy of the ZeRO-2 checkpoint (parent folder with ``latest``)."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "zero2", target)
    return target


def test_latest_naming_a_parent_path_is_refused(copy, tmp_path):
    shutil.copytree(copy / TAG, tmp_path / "x")  # a valid checkpoint, outside the folder
    (copy / "latest").write_text("../x")
    assert_refused(run_cli("inspect", copy), copy / "latest", "'../x'", "outside its folder")


def test_latest_naming_a_missing_tag_is_refused(copy):
    (copy / "latest").write_text("global_step9\n")
    assert_refused(run_cli("inspect", copy), copy / "latest", "'global_step9'",
                   "not a folder here")


def test_latest_through_a_symlink_out_is_refused(copy, tmp_path):
    shutil.copytree(copy / TAG, tmp_path / "outside")
    (copy / "elsewhere").symlink_to(tmp_path / "outside")
    (copy / "latest").write_text("elsewhere")
    assert_refused(run_cli("inspect", copy), copy / "latest", "leads outside its folder")


def test_a_rank_file_linked_from_outside_is_refused(copy, tmp_path):
    outside = tmp_path / "outside.pt"
    (copy / TAG / _optim(1)).rename(outside)  # a valid rank file, now outside the folder
    (copy / TAG / _optim(1)).symlink_to(outside)
    assert_refused(run_cli("inspect", copy), copy / TAG, "leads outside its folder")


def test_missing_rank_file(copy):
    (copy / TAG / _optim(1)).unlink()
    assert_refused(run_cli("inspect", copy), copy / TAG / _optim(1), "missing")


def test_truncated_rank_file(copy):
    file = copy / TAG / _optim(1)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    assert_refused(run_cli("inspect", copy), file)


def _rewrite(file: Path, edit) -> None:
    """Load a DeepSpeed file with DeepSpeed's classes (the test may), edit, save back."""
    pytest.importorskip("deepspeed")
    root = torch.load(file, weights_only=False)
    edit(root)
    torch.save(root, file)


def test_param_shapes_that_do_not_fit_the_partitions(copy):
    def grow(root):
        root["param_shapes"][0]["2.weight"] = torch.Size([3, 9])
    _rewrite(copy / TAG / "mp_rank_00_model_states.pt", grow)
    assert_refused(run_cli("inspect", copy), copy / TAG / _optim(0), "param_shapes")


def test_a_partition_shorter_than_the_others(copy):
    file = copy / TAG / _optim(1)

    def cut(root):
        flats = root["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        flats[0] = flats[0][:-3].clone()
    _rewrite(file, cut)
    assert_refused(run_cli("inspect", copy), file, "partitions every group equally")


def test_a_moment_of_the_wrong_size(copy):
    file = copy / TAG / _optim(0)

    def cut(root):
        state = root["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        state["exp_avg"] = state["exp_avg"][:5].clone()
    _rewrite(file, cut)
    assert_refused(run_cli("inspect", copy), file, "exp_avg holds 5 elements")


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_code_payload_in_a_rank_file_never_runs(copy, tmp_path):
    marker = tmp_path / "ran"
    file = copy / TAG / _optim(1)
    _rewrite(file, lambda root: root["optimizer_state_dict"].update(extra=_Payload(marker)))
    line = assert_refused(run_cli("inspect", copy), file, "refused")
    assert "system" in line
    assert not marker.exists()


def test_a_frozen_part_of_the_wrong_size(deepspeed_runs, tmp_path):
    """ZeRO 3 cuts every frozen parameter into equal flat parts, one per rank."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "zero3", target)
    file = target / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt"

    def cut(root):
        root["frozen_param_fragments"]["4.weight"] = torch.zeros(4)
    _rewrite(file, cut)
    assert_refused(run_cli("inspect", target, "--what", "weights"), file, "4.weight",
                   "not a flat part of 5")


def test_frozen_fragments_missing(copy):
    file = copy / TAG / "mp_rank_00_model_states.pt"
    _rewrite(file, lambda root: root.pop("frozen_param_fragments"))
    assert_refused(run_cli("inspect", copy), file, "no frozen_param_fragments")


def test_frozen_parameters_without_frozen_param_records(copy, deepspeed_runs):
    """As ZeRO 1 saves them (and DeepSpeed did before it saved them apart): only in the
    whole module state dict, told from buffers and tied names by what DeepSpeed lists."""
    file = copy / TAG / "mp_rank_00_model_states.pt"

    def strip(root):
        root["frozen_param_shapes"] = root["frozen_param_fragments"] = None
    _rewrite(file, strip)
    reference = torch.load(deepspeed_runs / "zero2.reference.pt")
    doc = _inspect(copy, "weights")
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert list(tensors) == list(reference)
    for name in FROZEN:
        expected = reference[name]["weight"].double().norm().item()
        assert tensors[name]["norm"] == pytest.approx(expected, rel=1e-6), name


def test_an_extra_rank_beyond_partition_count(copy):
    shutil.copy(copy / TAG / _optim(1), copy / TAG / _optim(2))
    assert_refused(run_cli("inspect", copy), copy / TAG / _optim(2), "beyond")


# ------------------------------------------------------------------ the flat pieces


def test_flat_pieces_assemble_in_row_major_order():
    full = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    flat = full.flatten()
    pieces = [Piece((28,), (7,), lambda: flat[28:]), Piece((0,), (28,), lambda: flat[:28])]
    stored = StoredTensor("w", (7, 5), torch.float32, pieces, flat=True)
    assert stored.held is None
    assert torch.equal(stored.read(), full)
    assert math.prod(stored.shape) == sum(p.numel for p in stored.pieces)


@pytest.mark.parametrize("seed", range(12))
def test_damaged_rank_files_are_a_report_or_one_line(deepspeed_runs, tmp_path, seed):
    """Bytes flipped anywhere in a rank file (the pickle, the directory, the data)."""
    import random

    from tests.hardening.support import assert_clean_inspect

    rng = random.Random(seed)
    stage = STAGES[seed % len(STAGES)]
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / f"zero{stage}", target)
    file = rng.choice(sorted((target / TAG).glob("*.pt")))
    data = bytearray(file.read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    file.write_bytes(bytes(data))
    # Exit 0/1 with a report, or exit 3 with one line naming a file of the checkpoint
    # (a damaged value may be caught when another rank's file disagrees with it).
    result = run_cli("inspect", target, "--format", "json", "--no-progress")
    assert_clean_inspect(result, target)


def test_an_fp16_dynamic_loss_scaler_is_read_as_plain_values(tmp_path):
    """fp16 training (not available on the CPU) pickles DeepSpeed's DynamicLossScaler in
    each rank file; the real object, saved as DeepSpeed saves it, reads as a stand-in."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from gradclip_cli.source import load_checkpoint
    from gradclip_cli.source.files.deepspeed_pickle import GLOBALS, DynamicLossScalerState
    from gradclip_cli.source.files.weights_pickle import allowing

    scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=1000, min_scale=1.0,
                               delayed_shift=2, consecutive_hysteresis=False,
                               dtype=torch.float16)
    path = tmp_path / "optim.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler, "t": torch.ones(3)}}, path)
    with allowing(GLOBALS):
        root = load_checkpoint(path).root
    got = root["optimizer_state_dict"]["loss_scaler"]
    assert type(got) is DynamicLossScalerState
    assert got.state == vars(scaler)
    assert torch.equal(root["optimizer_state_dict"]["t"], torch.ones(3))


# ------------------------------------------------------------------ DeepSpeedCPUAdam


@pytest.mark.slow
@pytest.mark.parametrize("what", ["exp_avg", "grad_rms", "update", "weights"])
def test_cpu_adam_offload_reads_as_adamw(deepspeed_cpu_adam, what):
    """ZeRO-Offload's ``DeepSpeedCPUAdam`` keeps AdamW's state under AdamW's names, with
    ``step`` a plain int (torch's is a tensor) and ``bias_correction`` in its groups:
    the numbers are the plain AdamW run's, the weights ``zero_to_fp32``'s."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = deepspeed_cpu_adam / "zero2_cpu_adam"
    root = torch.load(folder / TAG / _optim(0), weights_only=False)
    base = root["optimizer_state_dict"]["base_optimizer_state"]
    assert all(type(entry["step"]) is int for entry in base["state"].values())
    assert all(group["bias_correction"] for group in base["param_groups"])
    reference = torch.load(deepspeed_cpu_adam / "zero2_cpu_adam.reference.pt")
    expected = _expected(reference, what)
    doc = _inspect(folder, what)
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert list(tensors) == list(expected)
    for name, value in expected.items():
        assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=RTOL), name
    if what == "weights":
        from gradclip_cli.source.layouts import open_checkpoint

        theirs = get_fp32_state_dict_from_zero_checkpoint(os.fspath(folder))
        ours = open_checkpoint(folder)
        for name, tensor in theirs.items():
            assert torch.equal(ours.weights[name].read(), tensor), name
