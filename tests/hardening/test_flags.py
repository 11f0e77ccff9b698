"""Flag values at the edges: each is a one-line usage error (exit 2) or a sensible result."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.cli.support import assert_no_report

from .support import run_cli

EDGES = ["nan", "inf", "-1", "0", "1e308"]


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"a": torch.tensor([3.0, -4.0]), "b": torch.tensor([12.0])}}, path)
    return path  # L2 total 13, max_abs 12


def _usage(result, flag: str) -> None:
    assert result.code == 2, (result.code, result.out, result.err)
    assert len(result.err_lines) == 1, result.err
    assert flag in result.err_lines[0], result.err
    assert "Traceback" not in result.err
    assert_no_report(result)


# (command, flag, value) -> None for exit 2, else the expected exit code.
EXPECTED = {
    ("inspect", "--max-norm"): {"nan": None, "inf": None, "-1": None, "0": 1, "1e308": 0},
    ("clip", "--max-norm"): {"nan": None, "inf": None, "-1": None, "0": None, "1e308": 0},
    ("clip", "--clip-value"): {"nan": None, "inf": None, "-1": None, "0": None, "1e308": 0},
    ("inspect", "--norm-type"): {"nan": None, "inf": 0, "-1": None, "0": None, "1e308": 0},
    ("clip", "--norm-type"): {"nan": None, "inf": 0, "-1": None, "0": None, "1e308": 0},
    ("inspect", "--top"): {"nan": None, "inf": None, "-1": None, "0": 0, "1e308": None},
    ("clip", "--top"): {value: None for value in EDGES},  # clip has no --top
}




def _cases():
    for command, flag in EXPECTED:
        for value in EDGES:
            yield pytest.param(command, flag, value, id=f"{command}{flag}={value}")


@pytest.mark.parametrize("command, flag, value", list(_cases()))
def test_edge_values(tmp_path, ckpt, command, flag, value):
    args = [command, ckpt, f"{flag}={value}", "--format", "json", "-q"]
    if command == "clip":
        args += ["-o", tmp_path / "out.pt"]
        if flag != "--max-norm" and flag != "--clip-value":
            args += ["--max-norm", "100"]
    result = run_cli(*args)
    expected = EXPECTED[(command, flag)][value]
    if expected is None:
        _usage(result, flag)
        assert not (tmp_path / "out.pt").exists()
        return
    assert result.code == expected, result.err
    doc = json.loads(result.out)
    if flag == "--norm-type":
        # p = inf and p = 1e308 are both the max-norm (to float precision).
        assert doc["norm_type"] == ("inf" if value == "inf" else float(value))
        key = "total_norm" if command == "inspect" else "total_norm_before"
        assert math.isclose(doc[key], 12.0, rel_tol=1e-6), doc
    if command == "clip" and value == "1e308":
        assert doc["clipped"] is False
        assert torch.equal(torch.load(tmp_path / "out.pt")["grads"]["b"], torch.tensor([12.0]))


def test_inspect_max_norm_zero_flags_any_gradient(ckpt):
    result = run_cli("inspect", ckpt, "--max-norm", "0", "--format", "json", "-q")
    assert result.code == 1 and json.loads(result.out)["status"] == "exceeded"


def test_top_zero_shows_no_tensor_rows(ckpt):
    result = run_cli("inspect", ckpt, "--top", "0", "-q")
    assert result.code == 0 and result.err == ""


@pytest.mark.parametrize(
    "device",
    ["tpu", "gpu", "cuda:abc", "cuda:-1", "", "cpu:0:1", "xla", "meta", "cuda:99", "mps:7"],
)
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_unknown_devices(tmp_path, ckpt, command, device):
    extra = ["--max-norm", "1", "-o", tmp_path / "out.pt"] if command == "clip" else []
    result = run_cli(command, ckpt, "--device", device, "-q", *extra)
    if device == "cuda:99" and torch.cuda.device_count() > 99:  # pragma: no cover
        pytest.skip("a machine with 100 GPUs")
    _usage(result, "--device")
    assert not (tmp_path / "out.pt").exists()


def test_in_place_with_output(tmp_path, ckpt):
    before = ckpt.read_bytes()
    result = run_cli("clip", ckpt, "--max-norm", "1", "--in-place", "-o", tmp_path / "o.pt")
    _usage(result, "--in-place")
    assert ckpt.read_bytes() == before and not (tmp_path / "o.pt").exists()


def test_clip_value_with_max_norm(tmp_path, ckpt):
    result = run_cli("clip", ckpt, "--max-norm", "1", "--clip-value", "1", "-o", tmp_path / "o")
    _usage(result, "--clip-value")
    assert not (tmp_path / "o").exists()


def test_clip_without_either(tmp_path, ckpt):
    _usage(run_cli("clip", ckpt, "-o", tmp_path / "o"), "--max-norm")


@pytest.mark.parametrize("value", ["1e309", "0x10", "1_0", " 2 ", "infinity", "-inf", "1e-320"])
def test_odd_number_spellings_for_norm_type(ckpt, value):
    """Python's float() accepts some of these; the result must still be sane."""
    result = run_cli("inspect", ckpt, "--norm-type", value, "--format", "json", "-q")
    try:
        p = float(value)
    except ValueError:
        _usage(result, "--norm-type")
        return
    if math.isnan(p) or not p > 0:
        _usage(result, "--norm-type")
        return
    doc = json.loads(result.out)
    total = doc["total_norm"]
    if p == 1e-320:
        # The p-norm of 3 non-zero elements as p -> 0+ is 3 ** (1/p): beyond float64,
        # a finding of its own (issue 7.1), never "inf" with exit 0.
        assert result.code == 1, result.err
        assert total == "inf" and doc["overflow"] is True and doc["status"] == "overflow"
        return
    assert result.code == 0, result.err
    if math.isinf(p):
        assert total == 12.0
    else:
        reference = sum(abs(x) ** p for x in (3.0, 4.0, 12.0)) ** (1 / p)
        assert math.isclose(total, reference, rel_tol=1e-6)


def test_clip_value_beyond_float32_clamps_infinities_to_the_largest_finite(tmp_path):
    path = tmp_path / "inf.pt"
    torch.save({"grads": {"w": torch.tensor([1.0, float("inf"), -float("inf")])}}, path)
    out = tmp_path / "out.pt"
    result = run_cli("clip", path, "--clip-value", "1e308", "--allow-nonfinite", "-o", out, "-q")
    assert result.code == 0, result.err
    w = torch.load(out, weights_only=True)["grads"]["w"]
    big = torch.finfo(torch.float32).max
    assert w.tolist() == [1.0, big, -big]
