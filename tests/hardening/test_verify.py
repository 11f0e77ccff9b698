"""``--verify`` through the CLI: damage is exit 3 naming the entry; its cost on a big file.

The cost measurement is slow and prints figures instead of asserting them::

    GRADCLIP_SLOW=1 .venv/bin/pytest -s -m slow tests/hardening/test_verify.py
"""

from __future__ import annotations

import os
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch

from .support import assert_refused, f32, run_cli, safetensors_bytes


def _entry_data_offset(path: Path, suffix: str) -> tuple[str, int]:
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    n, e = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    return info.filename, info.header_offset + 30 + n + e


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("entry_index", [0, 2])
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_flipped_data_byte_names_the_entry(tmp_path, command, entry_index):
    path = tmp_path / "g.pt"
    torch.save({"grads": {f"w{i}": torch.ones(256) * (i + 1) for i in range(3)}}, path)
    entry, offset = _entry_data_offset(path, f"data/{entry_index}")
    _flip(path, offset + 100, bit=3)
    extra = ["--max-norm", "1"] if command == "clip" else []
    plain = run_cli(command, path, "-q", *extra)
    assert plain.code == 0  # torch.load never checks: the damage passes unseen...
    (tmp_path / "g.clipped.pt").unlink(missing_ok=True)
    line = assert_refused(run_cli(command, path, "-q", "--verify", *extra), path)
    assert entry in line and "checksum" in line  # ...--verify names it
    assert not (tmp_path / "g.clipped.pt").exists()


def test_flipped_bit_in_the_last_byte_of_the_last_entry(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(1000)}}, path)
    entry, offset = _entry_data_offset(path, "data/0")
    _flip(path, offset + 3999, bit=7)
    assert entry in assert_refused(run_cli("inspect", path, "-q", "--verify"), path)


def test_stored_crc_edited_instead_of_data(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(16)}}, path)
    raw = bytearray(path.read_bytes())
    cd = raw.index(b"PK\x01\x02")
    while not raw[cd + 46 : cd + 46 + struct.unpack("<H", raw[cd + 28 : cd + 30])[0]].endswith(
        b"data/0"
    ):
        cd = raw.index(b"PK\x01\x02", cd + 4)
    raw[cd + 16] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert "data/0" in assert_refused(run_cli("inspect", path, "-q", "--verify"), path)


@pytest.mark.parametrize(
    "header, buffer, words",
    [
        ({"a": f32(0, 2), "b": f32(4, 2)}, bytes(12), "overlaps"),
        ({"a": f32(0, 1), "b": f32(8, 1)}, bytes(12), "unexplained"),
        ({"a": f32(0, 1)}, bytes(8), "after the last tensor"),
    ],
    ids=["overlap", "gap", "trailing"],
)
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_safetensors_layout_faults(tmp_path, command, header, buffer, words):
    path = tmp_path / "g.safetensors"
    path.write_bytes(safetensors_bytes(header, buffer))
    extra = ["--max-norm", "1"] if command == "clip" else []
    assert_refused(run_cli(command, path, "-q", "--verify", *extra), path, words)
    assert not (tmp_path / "g.clipped.safetensors").exists()


def test_verify_passes_a_clean_file(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(4)}}, path)
    assert run_cli("inspect", path, "-q", "--verify").code == 0


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("GRADCLIP_SLOW"), reason="set GRADCLIP_SLOW=1")
def test_verify_cost_on_200mb(tmp_path):
    path = tmp_path / "big.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({"grads": {f"w{i}": torch.randn(5_000_000, generator=g) for i in range(10)}}, path)
    print(f"\nfile: {path.stat().st_size / 1e6:.0f} MB")
    for label, extra in [
        ("warm-up", []),
        ("plain", []),
        ("verify", ["--verify"]),
        ("plain", []),
        ("verify", ["--verify"]),
    ]:
        start = time.perf_counter()
        assert run_cli("inspect", path, "-q", "--format", "json", *extra).code == 0
        print(f"{label:8s} {time.perf_counter() - start:.2f} s")
