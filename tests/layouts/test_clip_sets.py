"""``clip`` of a sharded set: every shard plus the index written back as a set, switched whole.

The set is written by ``huggingface_hub.save_torch_state_dict``; the clipped
copy is checked shard by shard in float64 against the input, and a kill -9
at any moment of ``--in-place`` leaves the folder holding the old set or the
new one, never some shards of each.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.cli.support import rel_err

from .kill_clip import kill_during_clip


def _read_set(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), framework="pt") as file:
            tensors.update({n: file.get_tensor(n) for n in file.keys()})
    return tensors


def _norm(tensors) -> float:
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm())


def _make_set(folder: Path, per_tensor: int, count: int, shard_bytes: int) -> dict:
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(5)
    grads = {f"h.{i}.w": torch.randn(per_tensor, generator=g) * (i + 1) for i in range(count)}
    grads["h.0.half"] = torch.randn(64, generator=g).half()
    folder.mkdir()
    save_torch_state_dict(grads, folder, max_shard_size=shard_bytes,
                          metadata={"producer": "test"})
    (folder / "README.txt").write_text("not a shard: copied as it is\n")
    return grads


def _digests(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
            for n in sorted(os.listdir(folder))}


@pytest.mark.parametrize("in_place", [False, True], ids=["output", "in-place"])
def test_clip_writes_the_whole_set(gradclip, tmp_path, in_place):
    folder = tmp_path / "grads"
    grads = _make_set(folder, 300, 6, 2000)
    before = _digests(folder)
    assert sum(n.endswith(".safetensors") for n in before) == 6
    args = ["--in-place"] if in_place else ["-o", tmp_path / "clipped"]
    result = gradclip("clip", folder, "--max-norm", "1", "--format", "json", *args)
    assert result.code == 0, result.err
    doc = result.json()
    target = folder if in_place else tmp_path / "clipped"
    assert doc["output"] == str(target)
    total = _norm(grads.values())
    coef = 1.0 / (total + 1e-6)
    assert rel_err(doc["total_norm_before"], total) <= 1e-6
    assert rel_err(doc["clip_coef"], coef) <= 1e-6
    after = _read_set(target)
    assert list(after) == list(_read_set(folder if not in_place else target))
    for name, original in grads.items():
        assert after[name].dtype == original.dtype and after[name].shape == original.shape
        tol = 1e-3 if original.dtype == torch.float16 else 1e-6
        assert torch.allclose(after[name].double(), original.double() * coef, rtol=tol,
                              atol=tol * float(original.abs().max()) * coef)
    written = _digests(target)
    assert set(written) == set(before)  # same files, no leftovers
    assert written["model.safetensors.index.json"] == before["model.safetensors.index.json"]
    assert written["README.txt"] == before["README.txt"]
    with safe_open(str(target / "model-00001-of-00006.safetensors"), framework="pt") as file:
        assert file.metadata() == {"format": "pt"}  # as huggingface_hub wrote it
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    if not in_place:
        assert _digests(folder) == before  # the input is untouched
    check = gradclip("inspect", target, "--max-norm", "1")
    assert check.code == 0, check.out


def test_clip_of_a_set_refuses_an_existing_output(gradclip, tmp_path):
    folder = tmp_path / "grads"
    _make_set(folder, 100, 3, 1000)
    (tmp_path / "taken").mkdir()
    result = gradclip("clip", folder, "--max-norm", "1", "-o", tmp_path / "taken")
    assert result.code == 2
    assert "exists; a clipped set is written as a new folder" in result.err


def test_kill_9_during_clip_of_a_set(tmp_path):
    """Killed while the new set is written, and after: the folder is whole, old or new."""
    folder = tmp_path / "grads"
    grads = _make_set(folder, 500_000, 8, 4_000_000)  # 8 shards, 16 MB
    seen = kill_during_clip(folder, lambda f: _norm(_read_set(f).values()), half=4)
    assert seen[0].startswith("temp-appears: old set")
    assert "new set" in seen[-1]
    assert len(grads) == 9


def _set_with_subfolders(folder: Path) -> dict[str, torch.Tensor]:
    """A set whose folder holds more than top-level files: a shard in a subfolder, a
    subfolder of other files, a relative and an absolute link."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(9)
    grads = {"a": torch.randn(40, generator=g) * 3, "b": torch.randn(30, generator=g) * 5}
    (folder / "sub").mkdir(parents=True)
    save_file({"a": grads["a"]}, str(folder / "sub" / "s1.safetensors"))
    save_file({"b": grads["b"]}, str(folder / "s2.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "sub/s1.safetensors", "b": "s2.safetensors"}}))
    (folder / "runs" / "deep").mkdir(parents=True)
    (folder / "runs" / "deep" / "events.log").write_text("step 1\n")
    os.chmod(folder / "runs", 0o750)
    (folder / "latest_log").symlink_to("runs/deep/events.log")
    (folder.parent / "notes.txt").write_text("kept beside the set\n")
    (folder / "notes.txt").symlink_to(folder.parent / "notes.txt")
    return grads


@pytest.mark.parametrize("in_place", [False, True], ids=["output", "in-place"])
def test_clip_of_a_set_keeps_subfolders_and_links(gradclip, tmp_path, in_place):
    folder = tmp_path / "grads"
    grads = _set_with_subfolders(folder)
    target = folder if in_place else tmp_path / "clipped"
    args = ["--in-place"] if in_place else ["-o", target]
    result = gradclip("clip", folder, "--max-norm", "1", *args)
    assert result.code == 0, result.err
    assert (target / "runs" / "deep" / "events.log").read_text() == "step 1\n"
    assert oct(os.stat(target / "runs").st_mode & 0o777) == oct(0o750)
    assert os.readlink(target / "latest_log") == "runs/deep/events.log"
    assert os.readlink(target / "notes.txt") == str(tmp_path / "notes.txt")
    coef = 1.0 / (_norm(grads.values()) + 1e-6)
    with safe_open(str(target / "sub" / "s1.safetensors"), framework="pt") as file:
        assert torch.allclose(file.get_tensor("a").double(), grads["a"].double() * coef,
                              rtol=1e-6)
    assert gradclip("inspect", target, "--max-norm", "1").code == 0
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_clip_of_a_set_with_a_fifo_in_its_folder_is_refused(gradclip, tmp_path):
    """A FIFO cannot be copied into the new folder, and --in-place would drop it."""
    folder = tmp_path / "grads"
    _make_set(folder, 100, 3, 1000)
    os.mkfifo(folder / "pipe")
    before = _digests_of_files(folder)
    result = gradclip("clip", folder, "--max-norm", "1", "--in-place")
    assert result.code == 3
    assert f"{folder / 'pipe'} is a FIFO" in result.err
    assert "nothing was changed" in result.err
    assert _digests_of_files(folder) == before and (folder / "pipe").is_fifo()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def _digests_of_files(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
            for n in sorted(os.listdir(folder)) if (folder / n).is_file()}



def test_clip_of_a_set_into_its_own_folder_is_refused(gradclip, tmp_path):
    folder = tmp_path / "grads"
    _make_set(folder, 100, 3, 1000)
    before = _digests(folder)
    result = gradclip("clip", folder, "--max-norm", "1", "-o", folder / "clipped")
    assert result.code == 2
    assert "inside the input folder" in result.err
    assert _digests(folder) == before


def test_in_place_through_a_link_to_the_set_keeps_the_link(gradclip, tmp_path):
    """As for one file: the link stays a link, and the folder it names is replaced."""
    folder = tmp_path / "real" / "grads"
    folder.parent.mkdir()
    _make_set(folder, 100, 3, 1000)
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "grads"
    link.symlink_to(folder)
    result = gradclip("clip", link, "--max-norm", "0.5", "--in-place")
    assert result.code == 0, result.err
    assert link.is_symlink() and os.readlink(link) == str(folder)
    assert os.listdir(tmp_path / "links") == ["grads"]
    assert sorted(os.listdir(tmp_path / "real")) == ["grads"]
    assert gradclip("inspect", folder, "--max-norm", "0.5").code == 0


def _sharded_grads(tmp_path: Path, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """Six gradients saved by huggingface_hub as a set of several shards with its index,
    in ``tmp_path / "grads"``; the folder and the gradients."""
    from huggingface_hub import save_torch_state_dict

    folder = tmp_path / "grads"
    folder.mkdir()
    g = torch.Generator().manual_seed(seed)
    grads = {f"h.{i}.w": torch.randn(300, generator=g) * (i + 1) for i in range(6)}
    save_torch_state_dict(grads, folder, filename_pattern="grads{suffix}.safetensors",
                          max_shard_size=2000)
    return folder, grads


def _assert_shard_clip_refused(gradclip, shard: Path, folder: Path, tmp_path: Path,
                               remedy: str) -> None:
    """clip of ``shard`` alone: exit 2, one line ending in ``remedy``, nothing written."""
    before = _digests(folder)
    result = gradclip("clip", shard, "--max-norm", "1", "-o", tmp_path / "one.safetensors")
    assert result.code == 2 and result.out == ""
    (line,) = result.err.splitlines()
    assert line == (f"gradclip: {shard}: one shard of the set in {folder}: clip scales by the "
                    "total norm of every gradient of the set, which this file alone does not "
                    f"hold; {remedy}")
    assert sorted(os.listdir(tmp_path)) == ["grads"] and _digests(folder) == before


def test_clip_of_one_shard_alone_is_refused_and_its_suggestion_clips_the_set(gradclip, tmp_path):
    """One shard's norm is not the set's: scaled by it, the set would not be clipped to
    --max-norm. Exit 2, nothing written; the command it offers clips the whole set."""
    folder, grads = _sharded_grads(tmp_path, seed=6)
    index = json.loads((folder / "grads.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    shard = folder / files[0]
    _assert_shard_clip_refused(gradclip, shard, folder, tmp_path,
                               f"clip the set: gradclip clip {folder}")
    followed = gradclip("clip", folder, "--max-norm", "1", "-o", tmp_path / "clipped",
                        "--format", "json")
    assert followed.code == 0, followed.err
    clipped = {}
    for name in files:
        with safe_open(str(tmp_path / "clipped" / name), framework="pt") as file:
            clipped.update({n: file.get_tensor(n) for n in file.keys()})
    assert clipped.keys() == grads.keys()
    assert rel_err(_norm(clipped.values()), 1.0) < 1e-6
    inspected = gradclip("inspect", shard, "--format", "json")
    assert inspected.code == 0  # inspect measures the one shard, and says so
    assert inspected.json()["num_tensors"] < len(grads)


def test_a_set_whose_index_is_gone_is_no_run_and_its_shards_say_what_they_cover(
        gradclip, tmp_path):
    """A sharded set without its index (a save cut before the index, a copy by '*'):
    the folder is one checkpoint's parts, not a run of per-step files (their numbers
    count shards); a shard given alone says it covers itself only, and clip refuses
    to scale it by its own norm, offering no command that cannot work."""
    folder, _ = _sharded_grads(tmp_path, seed=7)
    (folder / "grads.safetensors.index.json").unlink()
    files = sorted(os.listdir(folder))
    assert len(files) > 1
    shard = folder / files[0]

    refused = gradclip("inspect", folder)
    assert refused.code == 3 and refused.out == ""
    (line,) = refused.err.splitlines()
    assert "run's folder" not in line and "trend" not in line
    assert line.startswith(f"gradclip: {folder}: the shards of one sharded checkpoint")
    assert line.endswith(f"to measure one shard alone, 'gradclip inspect {shard}'")

    followed = gradclip("inspect", shard, "--format", "json")
    assert followed.code == 0, followed.err
    doc = followed.json()
    with safe_open(str(shard), framework="pt") as file:
        held = [file.get_tensor(n) for n in file.keys()]
    assert rel_err(float(doc["total_norm"]), _norm(held)) < 1e-6
    count = len(files)
    assert (f"covers shard {files[0]} only: its name counts it one of {count} shards, and no "
            "index beside it lists the set") in doc["description"]

    _assert_shard_clip_refused(gradclip, shard, folder, tmp_path,
                               "the set's index is not there to read it by (a '*.index.json')")
