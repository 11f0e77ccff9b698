"""Every unreadable input is an InputError: one line, naming the file, no traceback."""

from __future__ import annotations

import json
import random
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint


def _torch_zip_bytes(tmp_path: Path) -> bytes:
    torch.save({"grads": {"w": torch.randn(64, 64)}}, tmp_path / "good.pt")
    return (tmp_path / "good.pt").read_bytes()


def _safetensors(header: object, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def missing(tmp_path):
    return tmp_path / "nope.pt"


def directory(tmp_path):
    (tmp_path / "ckpt.pt").mkdir()
    return tmp_path / "ckpt.pt"


def empty(tmp_path):
    (tmp_path / "empty.pt").touch()
    return tmp_path / "empty.pt"


def truncated_zip(tmp_path):
    raw = _torch_zip_bytes(tmp_path)
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    return tmp_path / "cut.pt"


def zip_without_end_record(tmp_path):
    raw = _torch_zip_bytes(tmp_path)
    (tmp_path / "cut.pt").write_bytes(raw[:-10])
    return tmp_path / "cut.pt"


def truncated_legacy(tmp_path):
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "l.pt", _use_new_zipfile_serialization=False)
    raw = (tmp_path / "l.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) - 100])
    return tmp_path / "cut.pt"


def legacy_header_only(tmp_path):
    torch.save({"w": torch.randn(4)}, tmp_path / "l.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "cut.pt").write_bytes((tmp_path / "l.pt").read_bytes()[:12])
    return tmp_path / "cut.pt"


def random_bytes(tmp_path):
    data = bytearray(random.Random(0).randbytes(4096))
    data[0] = 0x00  # never a magic number by chance
    (tmp_path / "noise.bin").write_bytes(bytes(data))
    return tmp_path / "noise.bin"


def text_file(tmp_path):
    (tmp_path / "notes.pt").write_text("epoch 3: loss 0.25\nthese are notes, not weights\n")
    return tmp_path / "notes.pt"


def plain_zip(tmp_path):
    with zipfile.ZipFile(tmp_path / "docs.pt", "w") as archive:
        archive.writestr("readme.txt", "hello")
    return tmp_path / "docs.pt"


def corrupt_zip_entry(tmp_path):
    raw = bytearray(_torch_zip_bytes(tmp_path))
    start = raw.index(b"data.pkl")  # damage the pickle's local header and data
    raw[start : start + 64] = bytes(64)
    (tmp_path / "bad.pt").write_bytes(bytes(raw))
    return tmp_path / "bad.pt"


def safetensors_header_not_json(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(_safetensors(None, raw_header=b"{not json at all}"))
    return tmp_path / "a.safetensors"


def safetensors_header_not_utf8(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(_safetensors(None, raw_header=b'{"\xff\xfe": 1}'))
    return tmp_path / "a.safetensors"


def safetensors_header_length_lies(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b'{"a": 1}')
    return tmp_path / "a.safetensors"


def safetensors_offsets_past_end(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [1 << 28], "data_offsets": [0, 1 << 30]}}
    (tmp_path / "a.safetensors").write_bytes(_safetensors(header, bytes(16)))
    return tmp_path / "a.safetensors"


def safetensors_size_mismatch(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 16]}}
    (tmp_path / "a.safetensors").write_bytes(_safetensors(header, bytes(16)))
    return tmp_path / "a.safetensors"


def safetensors_bad_entry(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}
    (tmp_path / "a.safetensors").write_bytes(_safetensors(header, bytes(4)))
    return tmp_path / "a.safetensors"


def safetensors_header_is_a_list(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(_safetensors(None, raw_header=b"{}"[:1] + b"]"))
    return tmp_path / "a.safetensors"


def safetensors_unknown_dtype(tmp_path):
    header = {"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}
    (tmp_path / "a.safetensors").write_bytes(_safetensors(header, bytes(4)))
    return tmp_path / "a.safetensors"


def safetensors_bad_metadata(tmp_path):
    header = {
        "__metadata__": {"step": 3},
        "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    (tmp_path / "a.safetensors").write_bytes(_safetensors(header, bytes(4)))
    return tmp_path / "a.safetensors"


def eight_bytes_only(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", 2) + b"{")
    return tmp_path / "a.safetensors"


BAD_INPUTS = [
    missing,
    directory,
    empty,
    truncated_zip,
    zip_without_end_record,
    truncated_legacy,
    legacy_header_only,
    random_bytes,
    text_file,
    plain_zip,
    corrupt_zip_entry,
    safetensors_header_not_json,
    safetensors_header_not_utf8,
    safetensors_header_length_lies,
    safetensors_offsets_past_end,
    safetensors_size_mismatch,
    safetensors_bad_entry,
    safetensors_header_is_a_list,
    safetensors_unknown_dtype,
    safetensors_bad_metadata,
    eight_bytes_only,
]


@pytest.mark.parametrize("make", BAD_INPUTS, ids=[f.__name__ for f in BAD_INPUTS])
@pytest.mark.parametrize("verify", [False, True])
def test_bad_input_is_one_line_naming_the_file(tmp_path, make, verify):
    path = make(tmp_path)
    with pytest.raises(InputError) as caught:
        load_checkpoint(path, verify=verify)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message and "Traceback" not in message
    assert len(message) < 400
    assert caught.value.exit_code == 3


def test_error_messages_say_what_is_wrong(tmp_path):
    def message(make) -> str:
        with pytest.raises(InputError) as caught:
            load_checkpoint(make(tmp_path))
        return str(caught.value)

    assert "no such file" in message(missing)
    assert "directory" in message(directory)
    assert "empty" in message(empty)
    assert "text" in message(text_file)
    assert "not valid JSON" in message(safetensors_header_not_json)
    assert "past the end" in message(safetensors_offsets_past_end)
