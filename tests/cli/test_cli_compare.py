"""``gradclip compare A B``: ratios against float64, ordering, --fail-above, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from tests.schemas import validate

from .support import as_float, assert_no_report, logical_lines, ref_norm, rel_err
from .test_cli_trend import LAYERS, layer_grads


def pair(tmp_path, scale_b: dict[str, float], drop_b=(), nan_b=False):
    a, b = layer_grads(1), layer_grads(1, scale_b)
    for name in [n for n in b if any(n.startswith(d + ".") for d in drop_b)]:
        del b[name]
    if nan_b:
        b["transformer.h.2.mlp.weight"][1, 1] = math.nan
    torch.save({"grads": a}, tmp_path / "a.pt")
    torch.save({"grads": b}, tmp_path / "b.pt")
    return a, b


def group(grads, layer):
    return [t for n, t in grads.items() if n.startswith(layer + ".")]


def test_ratios_match_float64_and_the_scaled_layer_leads(gradclip, tmp_path):
    a, b = pair(tmp_path, {"transformer.h.1": 8.0, "transformer.h.2": 0.5})
    r = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--format", "json")
    assert r.code == 0, r.err
    doc = r.json()
    validate(doc, "compare-1")
    assert [g["name"] for g in doc["groups"]] == ["transformer.h.1", "transformer.h.2",
                                                  "transformer.h.0"]
    for g in doc["groups"]:
        ra, rb = ref_norm(group(a, g["name"]), 2), ref_norm(group(b, g["name"]), 2)
        assert rel_err(as_float(g["a"]), ra) <= 1e-6 and rel_err(as_float(g["b"]), rb) <= 1e-6
        assert rel_err(as_float(g["ratio"]), rb / ra) <= 1e-6
    assert rel_err(doc["groups"][0]["ratio"], 8.0) <= 1e-6  # scaling is exact in binary
    total = doc["total"]
    assert rel_err(total["ratio"], ref_norm(b.values(), 2) / ref_norm(a.values(), 2)) <= 1e-6
    assert doc["status"] == "ok"


@pytest.mark.parametrize("limit, code", [("9", 0), ("7.9", 1), ("2.1", 1)])
def test_fail_above_flags_ratios_beyond_r_or_below_its_inverse(gradclip, tmp_path, limit, code):
    # h.1 grows 8x; h.2 shrinks to 0.5x (beyond 2.1 only as 1/0.5 = 2 < 2.1: not flagged)
    pair(tmp_path, {"transformer.h.1": 8.0, "transformer.h.2": 0.5})
    r = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--fail-above", limit)
    assert r.code == code, r.out
    last = logical_lines(r.out)[-1]
    assert last.endswith(f"(exit {code})")
    if code:
        assert "transformer.h.1" in last and "transformer.h.2" not in last


def test_shrinking_below_the_inverse_is_a_finding(gradclip, tmp_path):
    pair(tmp_path, {"transformer.h.0": 0.25})
    r = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--fail-above", "3",
                 "--format", "json")
    assert r.code == 1 and r.json()["status"] == "exceeded"


def test_a_group_missing_on_one_side_leads_with_null(gradclip, tmp_path):
    pair(tmp_path, {}, drop_b=("transformer.h.0",))
    doc = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--format", "json").json()
    validate(doc, "compare-1")
    first = doc["groups"][0]
    assert first["name"] == "transformer.h.0" and first["b"] is None and first["ratio"] is None
    assert all(g["ratio"] == 1.0 for g in doc["groups"][1:])


def test_nonfinite_norm_is_a_finding(gradclip, tmp_path):
    pair(tmp_path, {}, nan_b=True)
    r = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--format", "json")
    assert r.code == 1
    doc = r.json()
    validate(doc, "compare-1")
    assert doc["status"] == "nonfinite" and doc["total"]["b"] == "nan"
    assert doc["groups"][-1] == {"name": "transformer.h.2", "a": doc["groups"][-1]["a"],
                                 "b": "nan", "ratio": "nan"}


def test_zero_norms(gradclip, tmp_path):
    zeros = {f"{layer}.w": torch.zeros(4) for layer in LAYERS}
    torch.save({"grads": zeros}, tmp_path / "a.pt")
    torch.save({"grads": {**zeros, "transformer.h.0.w": torch.ones(4)}}, tmp_path / "b.pt")
    doc = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--format", "json").json()
    assert doc["groups"][0] == {"name": "transformer.h.0", "a": 0.0, "b": 2.0, "ratio": "inf"}
    assert [g["ratio"] for g in doc["groups"][1:]] == [1.0, 1.0]


@pytest.mark.parametrize("args, code, words", [
    (["--fail-above", "0.5"], 2, "--fail-above must be >= 1"),
    (["--fail-above", "nan"], 2, "--fail-above"),
    (["--what", "moments"], 2, "--what must be one of"),
    (["--what", "update"], 3, "a.pt: --what update: the checkpoint holds no optimizer state"),
    (["--group-by", "depth:0"], 2, "--group-by"),
])  # fmt: skip
def test_bad_flags(gradclip, tmp_path, args, code, words):
    pair(tmp_path, {})
    r = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", *args, "--format", "json")
    assert r.code == code and words in r.err
    assert_no_report(r)


def test_unreadable_b_is_exit_3_naming_it(gradclip, tmp_path):
    pair(tmp_path, {})
    (tmp_path / "b.pt").write_bytes((tmp_path / "b.pt").read_bytes()[:100])
    r = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--format", "json")
    assert r.code == 3 and str(tmp_path / "b.pt") in r.err and len(r.err_lines) == 1
    assert_no_report(r)
