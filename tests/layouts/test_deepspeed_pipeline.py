"""DeepSpeed pipeline parallelism (``deepspeed.pipe.PipelineModule``), written by
DeepSpeed's own 2-rank CPU training (``deepspeed_runs.py``): two stages under ZeRO 1,
checked against the plain ``torch.optim.AdamW`` run beside it; one stage (two
data-parallel ranks) and two stages without ZeRO, whose weights are in the layer files,
checked against the engine's own state gathered from the stages.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.interface import StoredTensor
from gradclip_cli.source.layouts.deepspeed.pipeline import refuse_tied_layers
from tests.distributed.launch import same_under_torchrun
from tests.hardening.support import assert_refused, run_cli
from tests.layouts.test_deepspeed import RTOL, _expected, _inspect, _rewrite
from tests.layouts.test_deepspeed_zero0 import TAG, WHATS


@pytest.mark.parametrize("what", WHATS)
def test_pipeline_stages_match_a_plain_adamw_run(deepspeed_runs, what):
    """Two PipelineModule stages under ZeRO 1: each mp_rank_XX file a stage of its own
    parameters, read side by side (never as tensor-parallel shards)."""
    run = deepspeed_runs / "pipe2_zero1"
    reference = torch.load(deepspeed_runs / "pipe2_zero1.reference.pt")
    expected = _expected(reference, what)
    for path in (run, run / TAG):
        doc = _inspect(path, what)
        tensors = {t["name"]: t for t in doc["tensors"]}
        assert list(tensors) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        for name, value in expected.items():
            assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=RTOL), name
        total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
        assert doc["total_norm"] == pytest.approx(total, rel=RTOL)
    table = run_cli("inspect", run, "--no-progress", "--top", "0")
    text = " ".join(table.out.split())
    assert "2 pipeline stages (mp_rank_00, mp_rank_01) x 1 data-parallel rank(s)" in text
    assert "layer_XX-model_states.pt files are not read" in text


@pytest.mark.parametrize("run_name", ["pipe2_zero1", "pipe2_zero0"])
def test_a_layer_file_given_alone_is_its_weights(deepspeed_runs, run_name, tmp_path):
    """``layer_II-model_states.pt`` alone is the layer's ``state_dict()`` (DeepSpeed saves
    it without torch's _metadata): its name is the evidence, it is measured as weights and
    never as gradients, nor clipped. It was a flat mapping measured as gradients."""
    layers = sorted((deepspeed_runs / run_name / TAG).glob("layer_*-model_states.pt"))
    held = [(path, saved) for path in layers if (saved := torch.load(path, weights_only=True))]
    assert len(held) == 2  # the two Linear layers; the Tanh between them holds nothing
    for path, saved in held:
        doc = _inspect(path, "auto")
        assert doc["what"] == "weights", path
        total = torch.cat([t.double().flatten() for t in saved.values()]).norm().item()
        assert doc["total_norm"] == pytest.approx(total, rel=RTOL)
        assert_refused(run_cli("inspect", path, "--what", "grads"), path, "weights")
        out = tmp_path / path.name
        assert_refused(run_cli("clip", path, "--max-norm", "1e-9", "-o", out), path)
        assert not out.exists()


def test_pipeline_stages_under_torchrun(deepspeed_runs, tmp_path):
    jobs = [{"args": ["inspect", str(deepspeed_runs / "pipe2_zero1"), "--what", what,
                      "--format", "json", "--no-progress"]} for what in ("auto", "weights")]
    same_under_torchrun(jobs, tmp_path)


def test_a_layer_on_two_stages_is_refused(deepspeed_runs, tmp_path):
    """A layer tied across stages (both keep a copy): refused, not counted twice."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "pipe2_zero1", target)
    file = target / TAG / "mp_rank_01_model_states.pt"

    def edit(root):
        shapes = root["param_shapes"][0]
        root["param_shapes"][0] = type(shapes)(
            ("0.bias" if n == "2.bias" else n, s) for n, s in shapes.items())
    _rewrite(file, edit)
    assert_refused(run_cli("inspect", target), file, "holds 0.bias", "tied across pipeline stages")


# Without ZeRO the files hold the engine's own float32 state: what is read is those values,
# measured in float64 by both sides.
EXACT = 1e-6
PLAIN = ("pipe1_zero0", "pipe2_zero0")
LAYERS = ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("run_name", PLAIN)
@pytest.mark.parametrize("what", WHATS)
def test_a_pipeline_without_zero_matches_the_engine(deepspeed_runs, run_name, what):
    """Weights from the layer files (``layer_II-model_states.pt``, named by the global layer
    index), moments from each stage's optimizer, grouped by layer."""
    run = deepspeed_runs / run_name
    reference = torch.load(deepspeed_runs / f"{run_name}.reference.pt")
    assert list(reference) == LAYERS
    expected = _expected(reference, what)
    for path in (run, run / TAG, run / TAG / "mp_rank_00_model_states.pt"):
        doc = _inspect(path, what)
        assert doc["format"] == "deepspeed" and doc["step"] == 2
        tensors = {t["name"]: t for t in doc["tensors"]}
        assert list(tensors) == LAYERS
        for name, value in expected.items():
            assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=EXACT), name
            assert tensors[name]["group"] == name.split(".")[0]
        groups = {g["name"]: g["norm"] for g in doc["groups"]}
        assert list(groups) == ["0", "2"]
        for layer in groups:
            norm = torch.cat([v.flatten() for n, v in expected.items()
                              if n.startswith(f"{layer}.")]).norm().item()
            assert groups[layer] == pytest.approx(norm, rel=EXACT)
        total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
        assert doc["total_norm"] == pytest.approx(total, rel=EXACT)


@pytest.mark.parametrize("run_name", PLAIN)
def test_a_pipeline_without_zero_says_what_it_read(deepspeed_runs, run_name):
    stages = "mp_rank_00, mp_rank_01" if run_name == "pipe2_zero0" else "mp_rank_00"
    dp = 1 if run_name == "pipe2_zero0" else 2
    result = run_cli("inspect", deepspeed_runs / run_name, "--no-progress", "--top", "0")
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    assert "DeepSpeed pipeline checkpoint without ZeRO (stage 0) at global step 2" in text
    assert f"({stages}) x {dp} data-parallel rank(s)" in text
    assert "weights of 4 parameters in 3 layer files" in text
    assert "Adam moments of 4" in text


@pytest.fixture(params=PLAIN)
def plain_copy(deepspeed_runs, tmp_path, request) -> Path:
    target = tmp_path / request.param
    shutil.copytree(deepspeed_runs / request.param, target)
    return target


def _last_stage(run: Path) -> Path:
    stage = 1 if run.name == "pipe2_zero0" else 0
    return run / TAG / f"mp_rank_{stage:02d}_model_states.pt"


def test_a_missing_layer_file_is_refused(plain_copy):
    (plain_copy / TAG / "layer_02-model_states.pt").unlink()
    assert_refused(run_cli("inspect", plain_copy), _last_stage(plain_copy),
                   "layer files", "disagree")


def test_a_damaged_layer_file_is_refused(plain_copy):
    file = plain_copy / TAG / "layer_00-model_states.pt"
    file.write_bytes(file.read_bytes()[:200])
    assert_refused(run_cli("inspect", plain_copy), file)


def test_a_layer_of_another_shape_is_refused(plain_copy):
    file = plain_copy / TAG / "layer_02-model_states.pt"
    _rewrite(file, lambda root: root.update(weight=torch.zeros(3, 6)))
    assert_refused(run_cli("inspect", plain_copy), _last_stage(plain_copy),
                   "cannot map optimizer state")


def test_an_optimizer_of_another_model_is_refused(plain_copy):
    """A moment whose shape is no parameter's of the stage's layers."""
    file = _last_stage(plain_copy)

    def edit(root):
        state = root["optimizer"]["state"]
        last = max(state)
        state[last]["exp_avg"] = torch.zeros(5)
        state[last]["exp_avg_sq"] = torch.zeros(5)
    _rewrite(file, edit)
    assert_refused(run_cli("inspect", plain_copy), file, "cannot map optimizer state")


@pytest.mark.parametrize("stage, words", [(0, ("cannot map optimizer state",)),
                                          (1, ("4", "3 parameters", "disagree"))])
def test_an_optimizer_missing_a_parameter_is_refused(deepspeed_runs, tmp_path, stage, words):
    """Two stages: one stage's optimizer lists one parameter fewer than its layers hold.
    The stages then split the layers' parameters elsewhere (the first stage's) or leave one
    over (the last's): either is refused, never a parameter read as frozen."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "pipe2_zero0", target)

    def edit(root):
        groups = root["optimizer"]["param_groups"]
        dropped = groups[0]["params"].pop()
        root["optimizer"]["state"].pop(dropped, None)
    _rewrite(target / TAG / f"mp_rank_{stage:02d}_model_states.pt", edit)
    assert_refused(run_cli("inspect", target), target / TAG / "mp_rank_01_model_states.pt",
                   *words)


def test_a_layer_saved_twice_is_refused(plain_copy):
    """A module tied across layers (TiedLayerSpec) is saved by each layer using it: equal
    weight matrices in two layer files are refused, not counted twice."""
    first = torch.load(plain_copy / TAG / "layer_00-model_states.pt")
    file = plain_copy / TAG / "layer_02-model_states.pt"
    _rewrite(file, lambda root: root.update(weight=first["weight"].clone()))
    assert_refused(run_cli("inspect", plain_copy), file, "2.weight", "0.weight", "tied")


def test_a_layer_saved_twice_holding_nan_is_refused(plain_copy):
    """A tied module's copies are one tensor where their bits are identical, a NaN included:
    a tied layer that diverged is refused as any tied layer. (``torch.equal``, a NaN unequal
    to itself, let its copies through, to be counted twice.)"""
    tied = torch.load(plain_copy / TAG / "layer_00-model_states.pt")["weight"].clone()
    tied[0, 0] = float("nan")
    for index in ("00", "02"):
        _rewrite(plain_copy / TAG / f"layer_{index}-model_states.pt",
                 lambda root: root.update(weight=tied.clone()))
    file = plain_copy / TAG / "layer_02-model_states.pt"
    assert_refused(run_cli("inspect", plain_copy), file, "2.weight", "equal to 0.weight", "tied")


def _layers(first: torch.Tensor, second: torch.Tensor) -> dict[str, StoredTensor]:
    """Layers 0 and 2's weights."""
    return {n: StoredTensor.whole(n, v) for n, v in (("0.weight", first), ("2.weight", second))}


def test_tied_copies_are_identical_bits():
    """The rule alone, on tensors at hand: identical bits (a NaN's too) are one tied module;
    a NaN on one side only, or another NaN payload, are two layers."""
    weight = torch.arange(12.0).reshape(3, 4)
    weight[1, 2] = float("nan")
    with pytest.raises(InputError, match="holds 2.weight, equal to 0.weight"):
        refuse_tied_layers(_layers(weight, weight.clone()))
    one_side = weight.clone()
    one_side[1, 2] = 6.0
    refuse_tied_layers(_layers(weight, one_side))
    payload = weight.clone()
    payload.view(torch.int32)[1, 2] ^= 1  # still a NaN, other bits
    assert payload[1, 2].isnan()
    refuse_tied_layers(_layers(weight, payload))
    refuse_tied_layers(_layers(weight, weight.to(torch.float64)))  # another dtype


def test_a_stage_missing_is_refused(deepspeed_runs, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "pipe2_zero0", target)
    (target / TAG / "mp_rank_00_model_states.pt").unlink()
    assert_refused(run_cli("inspect", target), target / TAG, "no mp_rank_00")


def test_a_stage_count_that_disagrees_is_refused(deepspeed_runs, tmp_path):
    """The last stage's file gone: the first one's pp_degree says there are two."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "pipe2_zero0", target)
    (target / TAG / "mp_rank_01_model_states.pt").unlink()
    assert_refused(run_cli("inspect", target), target / TAG / "mp_rank_00_model_states.pt",
                   "mp_world_size is 2", "1 pipeline stage file(s)")
