"""DCP's Hugging Face layout: safetensors shards with ``DCP_SHARDING_INFO``, from real ranks.

Written once per session by two spawned gloo ranks (FSDP2,
``HuggingFaceStorageWriter(save_distributed=True)``, ``dcp_hf_ranks.py``);
the reference is every parameter's ``full_tensor()``, saved by rank 0, and
the norms are computed here in float64. Hostile copies rewrite the real
shards' headers with the safetensors library.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.cli.support import rel_err

TOL = 1e-6


@pytest.fixture
def hf_dcp(dcp_hf_checkpoint) -> tuple[Path, dict]:
    return dcp_hf_checkpoint, torch.load(dcp_hf_checkpoint.parent / "reference.pt",
                                         weights_only=True)


def _norm(tensors) -> float:
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm())


def test_fixture_is_sharded_across_the_ranks_files(hf_dcp):
    folder, reference = hf_dcp
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 2
    with safe_open(str(files[1]), framework="pt") as f:
        info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        assert info["2.weight"]["saved_offsets"] == [2, 0]  # 3 rows: 2 on rank 0, 1 here
        assert f.get_slice("2.weight").get_shape() == [1, 10]


@pytest.mark.parametrize("p", ["2", "1", "inf"])
def test_every_number_against_the_whole_tensors(gradclip, hf_dcp, p):
    folder, reference = hf_dcp
    result = gradclip("inspect", folder, "--what", "weights", "--norm-type", p,
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["format"] == "dcp-hf" and doc["num_elements"] == 103
    order = float(p)

    def norm(tensors) -> float:
        flat = torch.cat([t.double().reshape(-1) for t in tensors])
        return float(flat.abs().max()) if order == float("inf") else float(flat.norm(order))

    assert rel_err(doc["total_norm"], norm(reference.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(reference)
    for name, tensor in reference.items():
        assert rows[name]["shape"] == list(tensor.shape), name
        assert rel_err(rows[name]["norm"], norm([tensor])) <= TOL, name


def _copy(hf_dcp, tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint"
    shutil.copytree(hf_dcp[0], folder)
    return folder


def _rewrite(file: Path, edit) -> None:
    """Write ``file`` again through the safetensors library, its metadata changed by ``edit``."""
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = dict(f.metadata())
    edit(metadata, tensors)
    save_file(tensors, str(file), metadata=metadata)


def _offsets(name: str, offsets):
    def edit(metadata, tensors):
        info = json.loads(metadata["DCP_SHARDING_INFO"])
        info[name]["saved_offsets"] = offsets
        metadata["DCP_SHARDING_INFO"] = json.dumps(info)
    return edit


@pytest.mark.parametrize("edit, words", [
    (_offsets("0.weight", [0, 0]), "other values"),  # claims rank 0's piece's place
    (_offsets("0.weight", [3, 0]), "overlap"),
    (_offsets("0.weight", [6, 0]), "gap"),
    (_offsets("0.weight", [5]), "dimensions"),
    (_offsets("0.weight", [-5, 0]), "offsets >= 0"),
    (lambda m, t: m.update(DCP_SHARDING_INFO="{not json"), "not JSON"),
    (lambda m, t: m.update(DCP_SHARDING_INFO="[" * 100_000 + "]" * 100_000),
     "DCP_SHARDING_INFO: not JSON: nested too deeply"),
    (lambda m, t: m.update(DCP_SHARDING_INFO='{"0.weight": {"saved_offsets": [' + "9" * 5000
                           + ', 0]}}'), "an integer of 5000 digits"),
    (lambda m, t: m.pop("DCP_SHARDING_INFO"), "no DCP_SHARDING_INFO"),
    (lambda m, t: t.update(extra=torch.ones(2)), "disagree"),
    (lambda m, t: t.update({"0.bias": t["0.bias"].double()}), "float64 here"),
])
def test_hostile_shards_are_refused_naming_the_file(gradclip, hf_dcp, tmp_path, edit, words):
    folder = _copy(hf_dcp, tmp_path)
    second = sorted(folder.glob("*.safetensors"))[1]
    _rewrite(second, edit)
    result = gradclip("inspect", folder, "--format", "json")
    assert result.code == 3, result.out
    error = result.json()["error"]
    assert words in error and str(folder) in error, error
    assert result.err.count("\n") == 1


def test_a_shard_linked_from_outside_is_refused(gradclip, hf_dcp, tmp_path):
    folder = _copy(hf_dcp, tmp_path)
    second = sorted(folder.glob("*.safetensors"))[1]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(second, outside)
    second.symlink_to(outside)
    result = gradclip("inspect", folder)
    assert result.code == 3 and str(second.name) in result.err



def test_one_shard_alone_says_it_covers_that_shard_only(gradclip, hf_dcp):
    """One rank's shard given alone was reported as if it held the whole tensors (``2.weight``
    1 x 10 of 3 x 10) with nothing said: the report says it covers that shard only and
    names the folder, and its numbers are that file's pieces."""
    folder, _ = hf_dcp
    for file in sorted(folder.glob("*.safetensors")):
        result = gradclip("inspect", file, "--format", "json")
        assert result.code == 0, result.err
        doc = result.json()
        assert (f"covers shard {file.name} only, its pieces of each tensor "
                f"(DCP_SHARDING_INFO); the whole checkpoint is the folder {folder}"
                in doc["description"]), doc["description"]
        with safe_open(str(file), framework="pt") as f:
            pieces = [f.get_tensor(k) for k in f.keys()]
        assert rel_err(doc["total_norm"], _norm(pieces)) <= TOL
        table = gradclip("inspect", file)
        assert f"covers shard {file.name} only" in " ".join(table.out.split())
