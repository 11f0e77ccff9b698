"""write_checkpoint: the clipped copy keeps the input's format and everything in it."""

from __future__ import annotations

import json
import os
import stat
import struct

import pytest
import torch
from safetensors import safe_open

from gradclip_cli.errors import OutputError
from gradclip_cli.sink import write_checkpoint
from gradclip_cli.source import load_checkpoint, select_gradients
from gradclip_cli.source.interface import Checkpoint
from tests.safetensors_files import save_safetensors

LEGACY_MAGIC = b"\x80\x02\x8a\x0a"  # pickle PROTO 2, then torch's 10-byte magic number


def training_root() -> dict:
    torch.manual_seed(0)
    embed = torch.randn(5, 3)
    return {
        "model": {"embed.weight": embed, "head.weight": embed, "norm.bias": torch.randn(3).half()},
        "grads": {
            "embed.weight": torch.randn(5, 3),
            "head.weight": torch.randn(5, 3).to(torch.bfloat16),
            "norm.bias": torch.randn(3, dtype=torch.float64),
            "scalar": torch.tensor(1.5),
            "empty": torch.zeros(0, 4),
            "ids": torch.arange(6, dtype=torch.int32),
            "mask": torch.tensor([True, False]),
        },
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]},
        "step": 42,
        "name": "run-7",
        "history": [0.5, 0.25, (1, 2)],
    }


def assert_same_structure(got, want, where="root"):
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same_structure(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_structure(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def clip_in_place(ckpt: Checkpoint, factor: float = 0.5) -> None:
    for tensor in select_gradients(ckpt.root, None).tensors.values():
        tensor.mul_(factor)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_torch_round_trip_keeps_everything_but_the_clipped_values(tmp_path, legacy):
    source, output = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(training_root(), source, _use_new_zipfile_serialization=not legacy)
    ckpt = load_checkpoint(source)
    clip_in_place(ckpt)
    write_checkpoint(ckpt, output)

    expected = training_root()
    for tensor in expected["grads"].values():
        if tensor.is_floating_point():
            tensor.mul_(0.5)
    reloaded = load_checkpoint(output)
    assert reloaded.format == ckpt.format
    assert output.read_bytes().startswith(LEGACY_MAGIC if legacy else b"PK\x03\x04")
    assert_same_structure(reloaded.root, expected)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_tied_storages_are_still_one_storage_after_writing(tmp_path, legacy):
    weight = torch.randn(4, 4)
    root = {"grads": {"embed": weight, "lm_head": weight, "row": weight[1]}}
    source, output = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(root, source, _use_new_zipfile_serialization=not legacy)
    ckpt = load_checkpoint(source)
    ckpt.root["grads"]["embed"].mul_(0.5)  # clipped once, through one name
    write_checkpoint(ckpt, output)

    grads = load_checkpoint(output).root["grads"]
    pointer = grads["embed"].untyped_storage().data_ptr()
    assert grads["lm_head"].untyped_storage().data_ptr() == pointer
    assert grads["row"].untyped_storage().data_ptr() == pointer
    assert torch.equal(grads["lm_head"], weight * 0.5)
    assert torch.equal(grads["row"], weight[1] * 0.5)


def safetensors_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        "layers.0.weight": torch.randn(4, 3),
        "layers.0.bias": torch.randn(3).half(),
        "embed": torch.randn(2, 2).to(torch.bfloat16),
        "double": torch.randn(2, dtype=torch.float64),
        "scalar": torch.tensor(2.0),
        "empty": torch.zeros(0),
        "ids": torch.arange(5),
        "flags": torch.tensor([True, False, True]),
        "naïve": torch.ones(1),
    }


def test_safetensors_round_trip_keeps_metadata_order_and_dtypes(tmp_path):
    source, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    metadata = {"format": "pt", "note": "grads at step 7"}
    save_safetensors(source, safetensors_tensors(), metadata)
    ckpt = load_checkpoint(source)
    clip_in_place(ckpt)
    write_checkpoint(ckpt, output)

    expected = {
        name: t * 0.5 if t.is_floating_point() else t for name, t in safetensors_tensors().items()
    }
    with safe_open(str(output), framework="pt") as written:  # the library is the referee
        assert written.metadata() == metadata
        assert list(written.offset_keys()) == list(ckpt.root)  # input's order kept
        for name, tensor in expected.items():
            got = written.get_tensor(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got, tensor), name
    assert load_checkpoint(output, verify=True).format == "safetensors"


def test_safetensors_header_is_padded_so_data_stays_aligned(tmp_path):
    source, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_safetensors(source, safetensors_tensors(), None)
    write_checkpoint(load_checkpoint(source), output)
    (header_size,) = struct.unpack("<Q", output.read_bytes()[:8])
    assert header_size % 8 == 0
    header = json.loads(output.read_bytes()[8 : 8 + header_size])
    assert "__metadata__" not in header


def test_safetensors_without_metadata_and_non_contiguous_tensors(tmp_path):
    ckpt = Checkpoint(
        path=tmp_path / "in.safetensors",
        format="safetensors",
        root={"t": torch.arange(6.0).reshape(2, 3).t(), "w": torch.ones(2)},
    )
    write_checkpoint(ckpt, tmp_path / "out.safetensors")
    with safe_open(str(tmp_path / "out.safetensors"), framework="pt") as written:
        assert written.metadata() is None or written.metadata() == {}
        assert torch.equal(written.get_tensor("t"), torch.arange(6.0).reshape(2, 3).t())


def test_in_place_over_the_memory_mapped_input(tmp_path):
    # The input's tensors are mapped from the very file being replaced: writing
    # over it in place would SIGBUS; the atomic replace must leave them readable.
    path = tmp_path / "grads.pt"
    original = torch.randn(1024)
    torch.save({"grads": {"w": original}}, path)
    ckpt = load_checkpoint(path)
    ckpt.root["grads"]["w"].mul_(0.25)
    write_checkpoint(ckpt, path)
    assert torch.equal(ckpt.root["grads"]["w"], original * 0.25)  # still readable
    assert torch.equal(load_checkpoint(path).root["grads"]["w"], original * 0.25)
    assert sorted(os.listdir(tmp_path)) == ["grads.pt"]


def test_in_place_over_a_safetensors_input(tmp_path):
    path = tmp_path / "grads.safetensors"
    save_safetensors(path, safetensors_tensors(), {"format": "pt"})
    ckpt = load_checkpoint(path)
    clip_in_place(ckpt, 2.0)
    write_checkpoint(ckpt, path)
    reloaded = load_checkpoint(path)
    assert torch.equal(
        reloaded.root["layers.0.weight"], safetensors_tensors()["layers.0.weight"] * 2
    )
    assert reloaded.metadata == {"format": "pt"}


def test_symlink_stays_a_link_and_its_target_is_replaced(tmp_path):
    real_dir = tmp_path / "store"
    real_dir.mkdir()
    real = real_dir / "grads.pt"
    torch.save({"grads": {"w": torch.ones(3)}}, real)
    link = tmp_path / "latest.pt"
    link.symlink_to(real)
    ckpt = load_checkpoint(link)
    clip_in_place(ckpt)
    write_checkpoint(ckpt, link)

    assert link.is_symlink() and os.readlink(link) == str(real)
    assert torch.equal(load_checkpoint(real).root["grads"]["w"], torch.full((3,), 0.5))
    assert sorted(os.listdir(real_dir)) == ["grads.pt"]  # the temp file lived beside the target
    assert sorted(os.listdir(tmp_path)) == ["latest.pt", "store"]


def test_output_takes_the_inputs_mode(tmp_path):
    source, output = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"grads": {"w": torch.ones(2)}}, source)
    os.chmod(source, 0o600)
    write_checkpoint(load_checkpoint(source), output)
    assert stat.S_IMODE(output.stat().st_mode) == 0o600


def test_unknown_format_is_an_output_error(tmp_path):
    ckpt = Checkpoint(path=tmp_path / "x", format="onnx", root={})
    with pytest.raises(OutputError, match="onnx"):
        write_checkpoint(ckpt, tmp_path / "out")


def test_failed_serialisation_leaves_target_and_folder_as_they_were(tmp_path):
    output = tmp_path / "out.pt"
    output.write_bytes(b"previous")
    ckpt = Checkpoint(path=tmp_path / "in.pt", format="torch-zip", root={"f": lambda: None})
    with pytest.raises(OutputError) as caught:
        write_checkpoint(ckpt, output)
    assert "\n" not in str(caught.value)
    assert output.read_bytes() == b"previous" and os.listdir(tmp_path) == ["out.pt"]


def test_missing_output_folder_is_an_output_error(tmp_path):
    source = tmp_path / "in.pt"
    torch.save({"w": torch.ones(2)}, source)
    with pytest.raises(OutputError, match="does not exist"):
        write_checkpoint(load_checkpoint(source), tmp_path / "missing" / "out.pt")


def _two_sets(tmp_path):
    target, new = tmp_path / "set", tmp_path / ".set.clipped"
    for folder, text in ((target, "old"), (new, "new")):
        folder.mkdir()
        (folder / "shard.safetensors").write_text(text)
    return target, new


@pytest.mark.parametrize("exchange", [True, False])
def test_in_place_swap_done_when_the_old_set_cannot_be_removed(tmp_path, monkeypatch, capsys,
                                                               exchange):
    """Once the clipped set is in place the clip is done: an old set that cannot be
    removed stays beside it, said on stderr, and no error claims nothing changed."""
    from gradclip_cli.sink import sharded_set

    target, new = _two_sets(tmp_path)
    if not exchange:
        monkeypatch.setattr(sharded_set, "_exchange", lambda a, b: False)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(sharded_set.shutil, "rmtree", refuse)
    sharded_set.switch_set(new, target, in_place=True)
    assert (target / "shard.safetensors").read_text() == "new"
    [left] = [p for p in tmp_path.iterdir() if p != target]
    assert (left / "shard.safetensors").read_text() == "old"
    err = capsys.readouterr().err
    assert "holds the clipped set" in err and left.name in err and "Permission denied" in err


def test_in_place_swap_failing_midway_puts_the_old_set_back(tmp_path, monkeypatch):
    """Without an atomic exchange the set is moved aside first: if the new one then
    cannot take its place, the old one goes back, and the error says nothing changed."""
    from gradclip_cli.sink import sharded_set

    target, new = _two_sets(tmp_path)
    monkeypatch.setattr(sharded_set, "_exchange", lambda a, b: False)
    rename = os.rename

    def fail_the_new_one(src, dst):
        if os.fspath(src) == os.fspath(new):
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(sharded_set.os, "rename", fail_the_new_one)
    with pytest.raises(OutputError, match="nothing was changed"):
        sharded_set.switch_set(new, target, in_place=True)
    assert (target / "shard.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]
