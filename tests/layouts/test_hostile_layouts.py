"""Hostile and broken layouts: each is exit 3 with one line naming the file.

The sets are real (``huggingface_hub.save_torch_state_dict``, a real Trainer
run), then damaged the way a hostile or broken copy would be. A name that
leads outside the folder is refused before anything there is opened: the
file it points at is a valid shard, so reading it would have succeeded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hardening.support import assert_clean_inspect, run_cli

FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture
def sharded(tmp_path) -> Path:
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(3)
    state = {f"layer.{i}.weight": torch.randn(20, 20, generator=g) for i in range(4)}
    folder = tmp_path / "set"
    folder.mkdir()
    save_torch_state_dict(state, folder, max_shard_size=4000)
    assert sorted(os.listdir(folder)) == [FIRST, SECOND, "model.safetensors.index.json"]
    return folder


def _edit_index(folder: Path, edit) -> None:
    index = folder / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    edit(document)
    index.write_text(json.dumps(document))


def _one_line(result, *fragments) -> str:
    assert result.code == 3, (result.code, result.err)
    assert len(result.err_lines) == 1, result.err
    assert result.out == ""
    for fragment in fragments:
        assert fragment in result.err_lines[0], result.err
    return result.err_lines[0]


def _point_first_at(target: str):
    def edit(document):
        for name, shard in document["weight_map"].items():
            if shard == FIRST:
                document["weight_map"][name] = target
    return edit


def test_extra_metadata_keys_are_tolerated(sharded):
    _edit_index(sharded, lambda d: (d["metadata"].update({"format": "pt", "x": [1, {}]}),
                                   d.update({"extra": True})))
    assert run_cli("inspect", sharded).code == 0


def test_parent_path_in_weight_map(sharded, tmp_path):
    shutil.copy(sharded / FIRST, tmp_path / FIRST)  # a valid shard, outside the folder
    _edit_index(sharded, _point_first_at(f"../{FIRST}"))
    _one_line(run_cli("inspect", sharded), "model.safetensors.index.json",
              f"'../{FIRST}'", "outside its folder; refused")


def test_absolute_path_in_weight_map(sharded, tmp_path):
    shutil.copy(sharded / FIRST, tmp_path / FIRST)
    _edit_index(sharded, _point_first_at(str(tmp_path / FIRST)))
    _one_line(run_cli("inspect", sharded), "model.safetensors.index.json", "outside its folder")


def test_symlink_out_of_the_folder(sharded, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(sharded / FIRST, outside)
    os.symlink(outside, sharded / FIRST)
    _one_line(run_cli("inspect", sharded), "leads outside its folder")


def test_control_characters_in_a_shard_name(sharded):
    _edit_index(sharded, _point_first_at("model-00001\nOK: total norm 0.safetensors"))
    _one_line(run_cli("inspect", sharded), "model.safetensors.index.json", "not a relative path")


def test_missing_shard(sharded):
    os.unlink(sharded / SECOND)
    _one_line(run_cli("inspect", sharded), f"{sharded / SECOND}: missing")


def test_truncated_shard(sharded):
    data = (sharded / SECOND).read_bytes()
    (sharded / SECOND).write_bytes(data[: len(data) - 100])
    _one_line(run_cli("inspect", sharded), str(sharded / SECOND))


def test_a_name_the_index_puts_elsewhere(sharded):
    moved = next(n for n, s in json.loads(
        (sharded / "model.safetensors.index.json").read_text())["weight_map"].items()
        if s == FIRST)
    _edit_index(sharded, lambda d: d["weight_map"].update({moved: SECOND}))
    _one_line(run_cli("inspect", sharded), str(sharded / FIRST), "puts in " + SECOND)


def test_a_name_in_two_shards(sharded):
    from safetensors import safe_open

    from tests.safetensors_files import save_safetensors

    with open(sharded / "model.safetensors.index.json") as file:
        weight_map = json.load(file)["weight_map"]
    tensors = {}
    with safe_open(str(sharded / SECOND), framework="pt") as shard:
        for name in shard.keys():
            tensors[name] = shard.get_tensor(name)
    stolen = next(n for n, s in weight_map.items() if s == FIRST)
    tensors[stolen] = torch.zeros(20, 20)
    save_safetensors(sharded / SECOND, tensors)
    _one_line(run_cli("inspect", sharded), str(sharded / SECOND), repr(stolen))


def test_a_name_the_index_does_not_list(sharded):
    _edit_index(sharded, lambda d: d["weight_map"].pop(
        next(n for n, s in d["weight_map"].items() if s == SECOND)))
    _one_line(run_cli("inspect", sharded), str(sharded / SECOND), "does not list")


@pytest.mark.parametrize("weight_map", [[], {"a": 3}, {"a": None}, {"a": ""}, {}])
def test_weight_map_that_is_not_one(sharded, weight_map):
    _edit_index(sharded, lambda d: d.update({"weight_map": weight_map}))
    _one_line(run_cli("inspect", sharded / "model.safetensors.index.json"),
              "model.safetensors.index.json")


@pytest.fixture
def trainer_copy(trainer_run, tmp_path) -> Path:
    copy = tmp_path / "checkpoint-4"
    shutil.copytree(trainer_run, copy)
    return copy


@pytest.mark.parametrize("text, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"global_step": "4"}', "global_step is '4'"),
    ('{"global_step": -1}', "global_step is -1"),
    ('{"global_step": 7}', "says global_step 7, but the folder is checkpoint-4"),
])
def test_trainer_state_that_is_not_what_it_claims(trainer_copy, text, why):
    (trainer_copy / "trainer_state.json").write_text(text)
    _one_line(run_cli("inspect", trainer_copy), str(trainer_copy / "trainer_state.json"), why)


def test_trainer_optimizer_that_runs_code(trainer_copy, tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state": {}, "param_groups": [], "x": Payload()}, trainer_copy / "optimizer.pt")
    _one_line(run_cli("inspect", trainer_copy), str(trainer_copy / "optimizer.pt"),
              "--trust-pickle")
    assert not marker.exists()


def test_trainer_optimizer_state_of_another_model(trainer_copy):
    state = torch.load(trainer_copy / "optimizer.pt", weights_only=True)
    state["state"][0]["exp_avg"] = torch.zeros(5, 5)
    state["state"][0]["exp_avg_sq"] = torch.zeros(5, 5)
    torch.save(state, trainer_copy / "optimizer.pt")
    _one_line(run_cli("inspect", trainer_copy), str(trainer_copy / "optimizer.pt"),
              "cannot map optimizer state to parameter names")


@settings(max_examples=int(os.environ.get("GRADCLIP_FUZZ_EXAMPLES", "100")) // 2,
          deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_index(sharded, tmp_path, data):
    """Mutated index bytes: exit 0/1 with JSON, or exit 3 with one line naming the file."""
    index = sharded / "model.safetensors.index.json"
    original = index.read_bytes()
    raw = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.sampled_from(b'{}[]":,./\\0a ' + bytes([0xff])))
    index.write_bytes(bytes(raw))
    try:
        assert_clean_inspect(run_cli("inspect", sharded, "--format", "json"), sharded)
    finally:
        index.write_bytes(original)
