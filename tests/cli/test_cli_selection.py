"""Finding the gradients: --key, auto-detection, skipped non-floating entries, tied tensors."""

from __future__ import annotations

import math

import pytest
import torch

from .support import assert_no_report, ref_norm, rel_err


def total(result) -> float:
    assert result.code == 0, result.err
    return result.json()["total_norm"]


@pytest.mark.parametrize("name", ["grads", "gradients", "grad"])
def test_auto_detects_the_gradient_entry(gradclip, tmp_path, grads, name):
    path = tmp_path / "g.pt"
    decoy = {"w": torch.full((4,), 100.0)}
    torch.save({name: grads, "model": decoy, "step": 3}, path)
    result = gradclip("inspect", path, "--format", "json")
    assert rel_err(total(result), ref_norm(grads.values(), 2)) <= 1e-6
    assert {t["name"] for t in result.json()["tensors"]} == set(grads)


def test_auto_detects_a_flat_mapping(gradclip, tmp_path, grads):
    path = tmp_path / "flat.pt"
    torch.save(grads, path)
    result = gradclip("inspect", path, "--format", "json")
    assert rel_err(total(result), ref_norm(grads.values(), 2)) <= 1e-6


def test_ambiguous_gradient_entries_exit_3_listing_candidates(gradclip, tmp_path, grads):
    path = tmp_path / "two.pt"
    torch.save({"grads": grads, "gradients": {"x": torch.ones(2)}}, path)
    result = gradclip("inspect", path, "--format", "json")
    assert result.code == 3
    assert_no_report(result)
    assert len(result.err_lines) <= 2 and "Traceback" not in result.err
    assert "grads" in result.err and "gradients" in result.err
    assert "--key" in result.err
    # Either one picked explicitly works.
    assert total(gradclip("inspect", path, "--key", "gradients", "--format", "json")) == (
        pytest.approx(math.sqrt(2), rel=1e-6)
    )


def test_nested_without_gradient_key_lists_candidates(gradclip, tmp_path, grads):
    path = tmp_path / "nested.pt"
    torch.save({"state": {"g": grads}, "model": {"w": torch.ones(3)}}, path)
    # No gradients found: auto measures the model's weights and says so (the contract).
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "weights" and doc["measured"]["evidence"] == "the 'model' entry"
    assert doc["total_norm"] == pytest.approx(math.sqrt(3), rel=1e-6)
    result = gradclip("inspect", path, "--what", "grads")
    assert result.code == 3
    # The weights are offered as --what weights, never as a --key of "gradients".
    assert "candidates for --key: state.g;" in result.err
    assert "available: --what weights" in result.err
    assert str(path) in result.err
    assert "Traceback" not in result.err and len(result.err_lines) <= 2


@pytest.mark.parametrize("flag", ["state.grads", "state.inner.deep"])
def test_dotted_key(gradclip, tmp_path, grads, flag):
    path = tmp_path / "deep.pt"
    torch.save({"state": {"grads": grads, "inner": {"deep": grads}}, "step": 1}, path)
    result = gradclip("inspect", path, "--key", flag, "--format", "json")
    assert rel_err(total(result), ref_norm(grads.values(), 2)) <= 1e-6


def test_key_that_is_one_entry_with_a_dot(gradclip, tmp_path, grads):
    path = tmp_path / "dotted.pt"
    torch.save({"model.grads": grads, "other": {"w": torch.ones(1)}}, path)
    result = gradclip("inspect", path, "--key", "model.grads", "--format", "json")
    assert rel_err(total(result), ref_norm(grads.values(), 2)) <= 1e-6


@pytest.mark.parametrize("flag", ["nope", "grads.nope", "step"])
def test_bad_key_exits_3(gradclip, grads_file, flag):
    result = gradclip("inspect", grads_file, "--key", flag)
    assert result.code == 3
    assert str(grads_file) in result.err
    assert "grads" in result.err  # the candidate a user should have typed
    assert "Traceback" not in result.err and len(result.err_lines) <= 2


def test_key_selects_for_clip_and_leaves_the_rest(gradclip, tmp_path, grads):
    path = tmp_path / "two.pt"
    other = {k: v * 3 for k, v in grads.items()}
    torch.save({"grads": grads, "gradients": other}, path)
    out = tmp_path / "out.pt"
    result = gradclip("clip", path, "--key", "gradients", "--max-norm", "1", "-o", out)
    assert result.code == 0, result.err
    loaded = torch.load(out, weights_only=True)
    for name, grad in grads.items():
        assert torch.equal(loaded["grads"][name], grad)
    assert ref_norm(loaded["gradients"].values(), 2) == pytest.approx(1.0, rel=1e-5)


def test_non_floating_tensors_are_skipped_and_listed(gradclip, tmp_path, grads):
    path = tmp_path / "mixed.pt"
    mixed = dict(grads)
    mixed["tokens.count"] = torch.arange(10)
    mixed["mask.flag"] = torch.ones(4, dtype=torch.bool)
    mixed["q.int8"] = torch.full((3,), 100, dtype=torch.int8)
    torch.save({"grads": mixed}, path)
    result = gradclip("inspect", path, "--format", "json")
    doc = result.json()
    assert rel_err(total(result), ref_norm(grads.values(), 2)) <= 1e-6
    assert set(doc["skipped"]) == {"tokens.count", "mask.flag", "q.int8"}
    assert doc["num_tensors"] == len(grads)
    assert {t["name"] for t in doc["tensors"]} == set(grads)
    table = gradclip("inspect", path)
    assert "tokens.count" in table.out


def test_skipped_entries_survive_clip_untouched(gradclip, tmp_path, grads):
    path = tmp_path / "mixed.pt"
    ids = torch.arange(10)
    torch.save({"grads": {**grads, "ids": ids}}, path)
    out = tmp_path / "o.pt"
    assert gradclip("clip", path, "--max-norm", "0.5", "-o", out).code == 0
    loaded = torch.load(out, weights_only=True)["grads"]
    assert torch.equal(loaded["ids"], ids) and loaded["ids"].dtype == torch.int64


def test_only_non_floating_tensors_exit_3(gradclip, tmp_path):
    path = tmp_path / "ints.pt"
    torch.save({"grads": {"a": torch.arange(3), "b": torch.ones(2, dtype=torch.bool)}}, path)
    result = gradclip("inspect", path)
    assert result.code == 3
    assert str(path) in result.err
    assert "Traceback" not in result.err and len(result.err_lines) <= 2


def tied_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(1)
    shared = torch.randn(16, 4, generator=g)
    grads = {
        "transformer.wte.weight": shared,
        "transformer.h.0.mlp.w": torch.randn(8, generator=g),
        "lm_head.weight": shared,  # the same tensor object under a second name
    }
    path = tmp_path / "tied.pt"
    torch.save({"grads": grads}, path)
    untied = [shared, grads["transformer.h.0.mlp.w"]]
    return path, untied


@pytest.mark.parametrize("p", ["1", "2", "inf"])
def test_tied_tensors_count_once(gradclip, tmp_path, p):
    path, untied = tied_checkpoint(tmp_path)
    result = gradclip("inspect", path, "--format", "json", "--norm-type", p)
    doc = result.json()
    assert rel_err(total(result), ref_norm(untied, float(p))) <= 1e-6
    assert doc["num_tensors"] == 2
    assert doc["num_elements"] == 16 * 4 + 8
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == {"transformer.wte.weight", "transformer.h.0.mlp.w"}
    assert rows["transformer.wte.weight"]["tied"] == ["lm_head.weight"]
    assert rows["transformer.h.0.mlp.w"]["tied"] == []


def test_tied_tensors_named_in_table(gradclip, tmp_path):
    path, _ = tied_checkpoint(tmp_path)
    result = gradclip("inspect", path)
    assert result.code == 0
    assert "lm_head.weight" in result.out


def test_equal_but_separate_tensors_are_not_tied(gradclip, tmp_path):
    a = torch.ones(4)
    path = tmp_path / "copies.pt"
    # b is a copy: its own elements. c is a view of half of a: not a tie (its
    # own row), but its elements are a's and count once (issue 7.2).
    torch.save({"a.w": a, "b.w": a.clone(), "c.w": a[:2]}, path)
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["num_tensors"] == 3
    assert doc["num_elements"] == 8
    assert doc["total_norm"] == pytest.approx(math.sqrt(8), rel=1e-6)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows["c.w"]["norm"] == pytest.approx(math.sqrt(2), rel=1e-6)
    assert rows["c.w"]["shares"] == ["a.w"] and rows["a.w"]["shares"] == ["c.w"]
    assert rows["b.w"]["shares"] == [] and rows["b.w"]["tied"] == []
