"""Pickle protocols 2 to 5, zip and legacy: harmless files are read, payloads refused.

torch's weights-only unpickler refuses every protocol 4 and 5 file (it lacks
FRAME, MEMOIZE, STACK_GLOBAL), which used to push users to ``--trust-pickle``
for a file of plain tensors. The restricted reader reads them; only a file that
truly needs a class outside the weights-only set is refused.
"""

from __future__ import annotations

import json
import os
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from gradclip_cli.errors import InputError, UnsafeCheckpointError
from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files import torch_legacy_reader
from gradclip_cli.source.files.weights_pickle import Outside
from tests.hardening.support import run_cli

PROTOCOLS = [2, 3, 4, 5]
FORMATS = ["zip", "legacy"]


def _save(obj, path: Path, protocol: int, fmt: str) -> None:
    torch.save(obj, path, pickle_protocol=protocol, _use_new_zipfile_serialization=fmt == "zip")


def _contents() -> dict:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 4, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    return {
        "grads": {
            "w": base,
            "w.t": base.t(),  # a view: one storage, two tensors
            "half": torch.randn(5, generator=g).half(),
            "bf16": torch.randn(2, 3, generator=g).bfloat16(),
            "f64": torch.randn(3, generator=g).double(),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
        },
        "model": model.state_dict(),  # an OrderedDict with _metadata
        "params": dict(model.named_parameters()),  # nn.Parameter, requires_grad
        "leaf": torch.randn(3, generator=g).requires_grad_(),
        "step": 12, "lr": 1e-3, "betas": (0.9, 0.999), "name": "run", "none": None,
        "shape": torch.Size([6, 4]), "device": torch.device("cpu"), "dtype": torch.float16,
        "ids": [1, 2, [3, (4, 5)]],
    }  # fmt: skip


def assert_same(got, want) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
            want.dtype, want.shape, want.stride(), want.storage_offset()
        )
        assert got.requires_grad is want.requires_grad
        assert torch.equal(got.detach(), want.detach())
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
        if isinstance(want, OrderedDict):
            assert vars(got) == vars(want)
    elif isinstance(want, (list, tuple)) and not isinstance(want, torch.Size):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_protocol_reads_as_torch_does(tmp_path, protocol, fmt):
    path = tmp_path / "c.pt"
    _save(_contents(), path, protocol, fmt)
    got = load_checkpoint(path)
    assert got.format == ("torch-zip" if fmt == "zip" else "torch-legacy")
    assert not got.trusted_pickle
    # The file is the test's own, so the full unpickler is a fair reference.
    want = torch.load(path, map_location="cpu", weights_only=False)
    assert_same(got.root, want)
    grads = got.root["grads"]
    assert grads["w.t"].untyped_storage().data_ptr() == grads["w"].untyped_storage().data_ptr()
    if protocol <= 3:  # where torch's weights-only reader works, it agrees too
        assert_same(got.root, torch.load(path, map_location="cpu", weights_only=True))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("protocol", [4, 5])
def test_plain_python_values_at_protocol_4_and_5(tmp_path, protocol, fmt):
    """Values torch's weights-only set allows, as protocols 4 and 5 write them."""
    obj = {"grads": {"w": torch.ones(2)}, "c": 1 + 2j, "b": b"raw", "ba": bytearray(b"xy"),
           "s": {1, "a", (2, 3)}, "fs": frozenset({4}), "big": 2**80, "nan": float("nan")}
    path = tmp_path / "v.pt"
    _save(obj, path, protocol, fmt)
    got = load_checkpoint(path).root
    want = torch.load(path, weights_only=False)
    assert_same(got["grads"], want["grads"])
    for key in ("c", "b", "ba", "s", "fs", "big"):
        assert type(got[key]) is type(want[key]) and got[key] == want[key], key
    assert got["nan"] != got["nan"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("protocol", [4, 5])
def test_cli_inspects_and_clips_protocol_4_and_5(tmp_path, protocol, fmt):
    path = tmp_path / "g.pt"
    grads = {"a": torch.full((3, 4), 0.5), "b": torch.full((5,), -2.0, dtype=torch.float64)}
    _save({"grads": grads, "step": 3}, path, protocol, fmt)
    result = run_cli("inspect", path, "-q", "--format", "json")
    assert result.code == 0, result.err
    expected = (12 * 0.25 + 5 * 4.0) ** 0.5
    assert abs(json.loads(result.out)["total_norm"] - expected) <= 1e-9 * expected
    result = run_cli("clip", path, "--max-norm", "1", "-q")
    assert result.code == 0, result.err
    clipped = torch.load(path.with_name("g.clipped.pt"), weights_only=False)["grads"]
    total = torch.cat([t.double().flatten() for t in clipped.values()]).norm()
    assert abs(float(total) - 1.0) < 1e-5


class SystemPayload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Custom:
    """A harmless class that is still outside the weights-only set."""

    def __init__(self):
        self.value = 1


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("protocol", [4, 5])
def test_payload_at_protocol_4_and_5_is_refused_naming_it(tmp_path, protocol, fmt):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    _save({"grads": {"w": torch.ones(2)}, "x": [SystemPayload(marker)]}, path, protocol, fmt)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_checkpoint(path)
    assert not marker.exists()
    message = str(refused.value)
    assert message.startswith(f"{path}: refused") and "--trust-pickle" in message
    assert "posix.system" in message or "os.system" in message
    result = run_cli("inspect", path, "-q")
    assert result.code == 3 and "--trust-pickle" in result.err
    assert not marker.exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_class_outside_the_set_is_refused_but_trust_pickle_reads_it(tmp_path, fmt):
    path = tmp_path / "c.pt"
    _save({"grads": {"w": torch.ones(2)}, "obj": Custom()}, path, 4, fmt)
    with pytest.raises(UnsafeCheckpointError, match="Custom"):
        load_checkpoint(path)
    assert load_checkpoint(path, trust_pickle=True).root["obj"].value == 1


@pytest.mark.parametrize("protocol", [2, 4])
def test_truncated_legacy_file_is_damage_not_a_refusal(tmp_path, protocol):
    path = tmp_path / "l.pt"
    _save({"grads": {"w": torch.randn(64)}}, path, protocol, "legacy")
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(InputError) as caught:
        load_checkpoint(cut)
    assert not isinstance(caught.value, UnsafeCheckpointError)
    assert str(caught.value).startswith(f"{cut}: ")


# --- the legacy reader's own bounds -----------------------------------------


def _legacy_parts(path: Path, nbytes: int) -> tuple[bytes, bytes]:
    """The file split where its one storage (count, then ``nbytes`` of data) begins."""
    data = path.read_bytes()
    return data[: -(8 + nbytes)], data[-(8 + nbytes):]


def test_storage_count_mismatch_is_refused(tmp_path):
    path = tmp_path / "l.pt"
    _save({"w": torch.ones(4)}, path, 2, "legacy")
    head, tail = _legacy_parts(path, 16)
    (count,) = struct.unpack("<q", tail[:8])
    assert count == 4
    bad = tmp_path / "bad.pt"
    bad.write_bytes(head + struct.pack("<q", 5) + tail[8:])
    with pytest.raises(Outside, match="wrong size"):
        torch_legacy_reader.restricted_read(bad)


def test_storage_larger_than_the_file_is_refused_before_allocating(tmp_path):
    path = tmp_path / "l.pt"
    _save({"w": torch.ones(4)}, path, 2, "legacy")
    data = path.read_bytes()
    # The numel in the persistent id: BININT1 4 right after the location 'cpu'.
    at = data.index(b"cpu")
    numel_op = data.index(b"K\x04", at)
    huge = data[:numel_op] + b"J" + struct.pack("<i", 2**31 - 1) + data[numel_op + 2:]
    bad = tmp_path / "big.pt"
    bad.write_bytes(huge)
    with pytest.raises(Outside, match="larger than the file"):
        torch_legacy_reader.restricted_read(bad)
