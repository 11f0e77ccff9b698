"""The JSON contract: schema keys and types, stdout alone, non-finite as strings, statuses."""

from __future__ import annotations

import json
import math

import pytest
import torch

from .support import (
    CLIP_KEYS,
    GROUP_KEYS,
    INSPECT_KEYS,
    NONFINITE_KEYS,
    TENSOR_KEYS,
    as_float,
    assert_no_report,
    ref_norm,
    rel_err,
)


def is_int(x) -> bool:
    return type(x) is int


def is_number(x) -> bool:
    return (type(x) in (int, float)) or x in ("nan", "inf", "-inf")


def check_nonfinite(obj) -> None:
    assert set(obj) == NONFINITE_KEYS
    assert all(is_int(v) and v >= 0 for v in obj.values())


def check_inspect_schema(doc) -> None:
    assert INSPECT_KEYS <= set(doc), INSPECT_KEYS - set(doc)
    assert doc["schema"] == "gradclip.inspect/1"
    assert isinstance(doc["source"], str)
    for key in ("norm_type", "total_norm", "max_abs"):
        assert is_number(doc[key]), (key, doc[key])
    assert is_int(doc["num_tensors"]) and is_int(doc["num_elements"])
    check_nonfinite(doc["nonfinite"])
    assert doc["status"] in ("ok", "exceeded", "nonfinite")
    assert isinstance(doc["groups"], list) and doc["groups"]
    for group in doc["groups"]:
        assert GROUP_KEYS <= set(group), GROUP_KEYS - set(group)
        assert isinstance(group["name"], str)
        assert is_number(group["norm"]) and is_number(group["max_abs"])
        assert is_int(group["num_tensors"]) and is_int(group["num_elements"])
        check_nonfinite(group["nonfinite"])
    assert isinstance(doc["tensors"], list) and doc["tensors"]
    for tensor in doc["tensors"]:
        assert TENSOR_KEYS <= set(tensor), TENSOR_KEYS - set(tensor)
        assert isinstance(tensor["name"], str) and isinstance(tensor["group"], str)
        assert isinstance(tensor["shape"], list) and all(is_int(n) for n in tensor["shape"])
        assert isinstance(tensor["dtype"], str)
        assert is_number(tensor["norm"]) and is_number(tensor["max_abs"])
        check_nonfinite(tensor["nonfinite"])
    assert doc["num_tensors"] == len(doc["tensors"])
    assert doc["num_elements"] == sum(math.prod(t["shape"]) for t in doc["tensors"])
    assert sum(g["num_tensors"] for g in doc["groups"]) == doc["num_tensors"]
    assert sum(g["num_elements"] for g in doc["groups"]) == doc["num_elements"]


def strict_json(text: str):
    """Parse as a strict consumer would: NaN/Infinity literals are not JSON."""

    def refuse(name):
        raise ValueError(f"non-standard JSON literal {name}")

    return json.loads(text, parse_constant=refuse)


def test_inspect_schema_and_values(gradclip, grads_file, grads, monkeypatch):
    monkeypatch.chdir(grads_file.parent)
    result = gradclip("inspect", "grads.pt", "--format", "json")
    assert result.code == 0, result.err
    assert result.err == ""
    doc = strict_json(result.out)  # stdout holds the JSON document and nothing else
    check_inspect_schema(doc)
    assert doc["source"] == "grads.pt"  # PATH as given
    assert doc["norm_type"] == 2.0
    assert doc["status"] == "ok"
    assert doc["num_tensors"] == len(grads)
    assert doc["num_elements"] == sum(t.numel() for t in grads.values())
    assert doc["nonfinite"] == {"nan": 0, "posinf": 0, "neginf": 0}
    assert rel_err(doc["total_norm"], ref_norm(grads.values(), 2)) <= 1e-6
    assert doc["max_abs"] == max(float(t.abs().max()) for t in grads.values())
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert list(by_name) == list(grads)  # checkpoint order, every name
    for name, grad in grads.items():
        row = by_name[name]
        assert row["shape"] == list(grad.shape)
        assert row["dtype"] == "float32"


def test_clip_schema_and_values(gradclip, grads_file, grads):
    total = ref_norm(grads.values(), 2)
    result = gradclip("clip", grads_file, "--max-norm", "1.0", "--format", "json")
    assert result.code == 0, result.err
    assert result.err == ""
    doc = strict_json(result.out)
    assert CLIP_KEYS <= set(doc), CLIP_KEYS - set(doc)
    assert doc["schema"] == "gradclip.clip/1"
    assert doc["source"] == str(grads_file)
    assert doc["output"] == str(grads_file.with_name("grads.clipped.pt"))
    assert doc["norm_type"] == 2.0 and doc["max_norm"] == 1.0
    assert doc["clipped"] is True
    for key in ("total_norm_before", "clip_coef", "total_norm_after"):
        assert type(doc[key]) is float, key
    assert rel_err(doc["total_norm_before"], total) <= 1e-6
    coef = min(1.0, 1.0 / (total + 1e-6))
    assert rel_err(doc["clip_coef"], coef) <= 1e-6
    assert rel_err(doc["total_norm_after"], total * coef) <= 1e-6


def test_clip_below_the_limit_is_not_clipped(gradclip, grads_file, grads):
    total = ref_norm(grads.values(), 2)
    result = gradclip("clip", grads_file, "--max-norm", str(total * 10), "--format", "json")
    assert result.code == 0, result.err
    doc = strict_json(result.out)
    assert doc["clipped"] is False
    assert doc["clip_coef"] == 1.0
    assert rel_err(doc["total_norm_after"], total) <= 1e-6
    out = torch.load(doc["output"], weights_only=True)["grads"]
    for name, grad in grads.items():
        assert torch.equal(out[name], grad), name


def test_nonfinite_numbers_are_strings(gradclip, tmp_path):
    path = tmp_path / "g.pt"
    torch.save(
        {
            "a.w": torch.tensor([1.0, math.nan]),
            "b.w": torch.tensor([math.inf, 2.0]),
            "c.w": torch.tensor([-math.inf]),
        },
        path,
    )
    result = gradclip("inspect", path, "--format", "json")
    assert result.code == 1
    doc = strict_json(result.out)
    check_inspect_schema(doc)
    assert doc["status"] == "nonfinite"
    assert doc["total_norm"] == "nan"  # NaN poisons the total, as torch's
    assert doc["nonfinite"] == {"nan": 1, "posinf": 1, "neginf": 1}
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows["a.w"]["norm"] == "nan"
    assert rows["b.w"]["norm"] == "inf"
    assert rows["c.w"]["norm"] == "inf"
    assert rows["c.w"]["max_abs"] == "inf"
    assert rows["b.w"]["nonfinite"] == {"nan": 0, "posinf": 1, "neginf": 0}


def test_inf_norm_type_is_the_string_inf(gradclip, grads_file, grads):
    doc = strict_json(gradclip("inspect", grads_file, "--format", "json", "--norm-type", "inf").out)
    assert doc["norm_type"] == "inf"
    assert as_float(doc["total_norm"]) == ref_norm(grads.values(), math.inf)


@pytest.mark.parametrize(
    ("extra", "code", "status"),
    [
        ([], 0, "ok"),
        (["--max-norm", "1e9"], 0, "ok"),
        (["--max-norm", "1.0"], 1, "exceeded"),
        (["--max-norm", "0"], 1, "exceeded"),
    ],
)
def test_max_norm_status_and_exit_code(gradclip, grads_file, extra, code, status):
    result = gradclip("inspect", grads_file, "--format", "json", *extra)
    assert result.code == code
    assert strict_json(result.out)["status"] == status
    assert result.err == ""  # a finding is not an error: the report says it


def test_max_norm_threshold_is_strictly_above(gradclip, tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"w": torch.tensor([3.0, 4.0])}, path)  # norm exactly 5
    assert gradclip("inspect", path, "--max-norm", "5").code == 0
    assert gradclip("inspect", path, "--max-norm", "4.999").code == 1


def test_nan_is_a_finding_unless_allowed(gradclip, tmp_path):
    path = tmp_path / "g.pt"
    grads = {"l.0.w": torch.tensor([1.0, math.nan, 2.0]), "l.1.w": torch.ones(3)}
    torch.save({"grads": grads}, path)
    result = gradclip("inspect", path, "--format", "json")
    assert (result.code, result.json()["status"]) == (1, "nonfinite")
    # NaN beats --max-norm: a NaN total cannot be compared to a threshold.
    result = gradclip("inspect", path, "--format", "json", "--max-norm", "1")
    assert (result.code, result.json()["status"]) == (1, "nonfinite")
    allowed = gradclip("inspect", path, "--format", "json", "--allow-nonfinite")
    assert allowed.code == 0
    doc = allowed.json()
    assert doc["status"] == "ok"
    assert doc["nonfinite"] == {"nan": 1, "posinf": 0, "neginf": 0}  # still reported


def test_json_stdout_is_one_document_for_every_outcome(gradclip, tmp_path, grads_file):
    """Findings and usage/input errors alike: stdout is parseable JSON or empty."""
    missing = tmp_path / "missing.pt"
    for args in (
        ("inspect", grads_file, "--format", "json", "--max-norm", "0.1"),
        ("clip", grads_file, "--format", "json", "--max-norm", "0.1", "-o", tmp_path / "o.pt"),
    ):
        result = gradclip(*args)
        strict_json(result.out)
    for args in (
        ("inspect", missing, "--format", "json"),
        ("inspect", grads_file, "--format", "json", "--norm-type", "-1"),
    ):
        result = gradclip(*args)
        assert result.code in (2, 3)
        assert_no_report(result)
        assert result.err_lines
