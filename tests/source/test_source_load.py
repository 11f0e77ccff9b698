"""Loading each checkpoint kind: values, formats, ties, mmap, and the file never changing."""

from __future__ import annotations

import argparse
import hashlib
import mmap
import struct
import sys
from pathlib import Path

import pytest
import torch

from gradclip_cli.errors import UnsafeCheckpointError
from gradclip_cli.source import load_checkpoint
from tests.safetensors_files import save_safetensors


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sample() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "layer.weight": torch.randn(4, 3),
        "layer.bias": torch.randn(3).half(),
        "embed": torch.randn(5, 2).to(torch.bfloat16),
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "steps": torch.arange(4),
    }


def assert_same(loaded: dict, saved: dict) -> None:
    assert list(loaded) == list(saved)
    for name, tensor in saved.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_torch_zip_loads_what_was_saved(tmp_path):
    path = tmp_path / "grads.pt"
    torch.save(sample(), path)
    ckpt = load_checkpoint(path)
    assert ckpt.format == "torch-zip" and ckpt.path == path and not ckpt.trusted_pickle
    assert_same(ckpt.root, sample())


def test_torch_legacy_loads_what_was_saved(tmp_path):
    path = tmp_path / "grads.pth"
    torch.save(sample(), path, _use_new_zipfile_serialization=False)
    ckpt = load_checkpoint(str(path))
    assert ckpt.format == "torch-legacy"
    assert_same(ckpt.root, sample())


def test_safetensors_loads_values_metadata_and_file_order(tmp_path):
    path = tmp_path / "grads.safetensors"
    tensors = sample()
    save_safetensors(path, tensors, metadata={"format": "pt", "step": "7"})
    ckpt = load_checkpoint(path)
    assert ckpt.format == "safetensors"
    assert ckpt.metadata == {"format": "pt", "step": "7"}
    # "File order" is the order of the data in the file, which the library chose.
    (header_size,) = struct.unpack("<Q", path.read_bytes()[:8])
    import json

    header = json.loads(path.read_bytes()[8 : 8 + header_size])
    header.pop("__metadata__")
    by_offset = sorted(header, key=lambda name: header[name]["data_offsets"])
    assert list(ckpt.root) == by_offset
    for name, tensor in tensors.items():
        assert ckpt.root[name].dtype == tensor.dtype and torch.equal(ckpt.root[name], tensor)


@pytest.mark.parametrize("suffix", [".safetensors", ".bin", ".txt", ""])
def test_kind_comes_from_content_not_suffix(tmp_path, suffix):
    zip_path, st_path = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}.x"
    torch.save(sample(), zip_path)
    save_safetensors(st_path, sample())
    assert load_checkpoint(zip_path).format == "torch-zip"
    assert load_checkpoint(st_path).format == "safetensors"


@pytest.mark.parametrize("legacy", [False, True])
def test_tied_storages_survive_loading(tmp_path, legacy):
    weight = torch.randn(6, 4)
    root = {"grads": {"embed": weight, "lm_head": weight, "row": weight[2]}}
    path = tmp_path / "tied.pt"
    torch.save(root, path, _use_new_zipfile_serialization=not legacy)
    grads = load_checkpoint(path).root["grads"]
    pointer = grads["embed"].untyped_storage().data_ptr()
    assert grads["lm_head"].untyped_storage().data_ptr() == pointer
    assert grads["row"].untyped_storage().data_ptr() == pointer
    grads["embed"].mul_(0.5)  # one storage: the edit shows through every name
    assert torch.equal(grads["lm_head"], weight * 0.5)
    assert torch.equal(grads["row"], weight[2] * 0.5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_torch_zip_is_memory_mapped_privately(tmp_path):
    path = tmp_path / "big.pt"
    torch.save({"w": torch.randn(256, 256)}, path)
    tensor = load_checkpoint(path).root["w"]
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            assert fields[-1] == str(path.resolve())
            assert fields[1].endswith("p"), "a shared mapping would write edits to the file"
            return
    pytest.fail("the tensor's memory is not a mapping of the file")


def _write_all_formats(tmp_path: Path) -> list[Path]:
    zip_path, legacy, st = tmp_path / "z.pt", tmp_path / "l.pt", tmp_path / "s.safetensors"
    root = {"grads": sample(), "step": 3}
    torch.save(root, zip_path)
    torch.save(root, legacy, _use_new_zipfile_serialization=False)
    save_safetensors(st, sample())
    return [zip_path, legacy, st]


def _edit_every_tensor(node) -> None:
    if isinstance(node, torch.Tensor):
        node.add_(1) if node.numel() else None
    elif isinstance(node, dict):
        for value in node.values():
            _edit_every_tensor(value)


def test_in_place_edits_never_reach_the_file(tmp_path):
    for path in _write_all_formats(tmp_path):
        before = sha256(path)
        ckpt = load_checkpoint(path)
        _edit_every_tensor(ckpt.root)
        del ckpt
        assert sha256(path) == before, path.name


@pytest.mark.skipif(sys.platform == "win32", reason="mmap options are POSIX-only")
def test_in_place_edits_stay_private_even_with_a_shared_mmap_default(tmp_path):
    path = tmp_path / "z.pt"
    torch.save({"w": torch.zeros(64)}, path)
    before = sha256(path)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        ckpt = load_checkpoint(path)
    ckpt.root["w"].fill_(7.0)
    del ckpt
    assert sha256(path) == before


def test_needs_full_unpickling_is_refused_then_allowed_with_trust(tmp_path):
    path = tmp_path / "lightning.ckpt"
    torch.save({"hparams": argparse.Namespace(lr=0.1), "grads": sample()}, path)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_checkpoint(path)
    message = str(refused.value)
    assert str(path) in message and "--trust-pickle" in message and "\n" not in message
    ckpt = load_checkpoint(path, trust_pickle=True)
    assert ckpt.trusted_pickle and ckpt.root["hparams"].lr == 0.1
