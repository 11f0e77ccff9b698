"""--verify: damage torch.load would miss is caught and named."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from gradclip_cli.errors import IntegrityError
from gradclip_cli.source import load_checkpoint


def _data_offset(path: Path, entry_suffix: str) -> tuple[str, int]:
    """Where an entry's bytes start in the archive: after its local header."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(entry_suffix))
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack(
        "<HH", raw[info.header_offset + 26 : info.header_offset + 30]
    )
    return info.filename, info.header_offset + 30 + name_len + extra_len


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_flipped_tensor_byte_is_caught_and_the_entry_named(tmp_path):
    path = tmp_path / "grads.pt"
    torch.save({"grads": {"w": torch.ones(1024)}}, path)
    entry, offset = _data_offset(path, "data/0")
    _flip(path, offset + 2)  # one bit of one float32: still a valid number
    # torch.load never checks the CRC: the damage loads silently...
    assert not torch.equal(load_checkpoint(path).root["grads"]["w"], torch.ones(1024))
    # ...and --verify refuses it, naming the damaged entry.
    with pytest.raises(IntegrityError) as caught:
        load_checkpoint(path, verify=True)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and entry in message and "\n" not in message
    assert caught.value.exit_code == 3


def test_flipped_pickle_byte_is_caught(tmp_path):
    path = tmp_path / "grads.pt"
    torch.save({"grads": {"w": torch.ones(4)}}, path)
    entry, offset = _data_offset(path, "data.pkl")
    _flip(path, offset + 20)
    with pytest.raises(IntegrityError, match="data.pkl"):
        load_checkpoint(path, verify=True)


@pytest.mark.parametrize("legacy", [False, True])
def test_intact_torch_files_pass(tmp_path, legacy):
    path = tmp_path / "grads.pt"
    torch.save({"w": torch.randn(8)}, path, _use_new_zipfile_serialization=not legacy)
    assert load_checkpoint(path, verify=True).root["w"].shape == (8,)


def _safetensors(path: Path, entries: dict, buffer: bytes) -> Path:
    text = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + buffer)
    return path


def _f32(begin: int, count: int) -> dict:
    return {"dtype": "F32", "shape": [count], "data_offsets": [begin, begin + 4 * count]}


def test_intact_safetensors_pass(tmp_path):
    path = _safetensors(tmp_path / "a.safetensors", {"a": _f32(0, 2), "b": _f32(8, 1)}, bytes(12))
    assert list(load_checkpoint(path, verify=True).root) == ["a", "b"]


@pytest.mark.parametrize(
    "entries, buffer, words",
    [
        ({"a": _f32(0, 2), "b": _f32(4, 2)}, bytes(12), "overlaps"),
        ({"a": _f32(0, 1), "b": _f32(8, 1)}, bytes(12), "unexplained bytes"),
        ({"a": _f32(4, 1)}, bytes(8), "unexplained bytes"),
        ({"a": _f32(0, 1)}, bytes(8), "after the last tensor"),
    ],
    ids=["overlap", "gap", "leading-gap", "trailing"],
)
def test_safetensors_offsets_must_tile_the_buffer(tmp_path, entries, buffer, words):
    path = _safetensors(tmp_path / "a.safetensors", entries, buffer)
    with pytest.raises(IntegrityError, match=words) as caught:
        load_checkpoint(path, verify=True)
    assert str(caught.value).startswith(f"{path}: ")
