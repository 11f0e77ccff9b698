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
    # A NaN norm is the largest change (docs/reference/contract.md): its group leads.
    assert doc["groups"][0] == {"name": "transformer.h.2", "a": doc["groups"][0]["a"],
                                "b": "nan", "ratio": "nan"}


def test_a_norm_beyond_float64s_range_is_not_called_non_finite_gradients(gradclip, tmp_path):
    """float64 gradients of finite values whose norm is beyond float64's range: the
    table's verdict said "non-finite gradient norm", but github's and junit's findings
    "non-finite gradients", which none of them is."""
    a = {k: v.double() for k, v in layer_grads(1).items()}
    b = {k: v.clone() for k, v in a.items()}
    b["transformer.h.2.mlp.weight"].fill_(1e308)
    assert all(bool(v.isfinite().all()) for v in b.values())
    assert math.isinf(ref_norm(b.values(), 2))
    torch.save({"grads": a}, tmp_path / "a.pt")
    torch.save({"grads": b}, tmp_path / "b.pt")
    for fmt in ("table", "github", "junit", "markdown"):
        r = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--format", fmt)
        assert r.code == 1, r.err
        assert "non-finite gradients" not in r.out, r.out
        assert "non-finite gradient norm" in r.out.replace("\\", ""), r.out


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


def disjoint(tmp_path):
    """A holds only ``enc`` (norm 2), B only ``dec`` (norm 2000): no group in common."""
    torch.save({"grads": {"enc.w": torch.tensor([1.2, 1.6])}}, tmp_path / "a.pt")
    torch.save({"grads": {"dec.w": torch.tensor([1200.0, 1600.0])}}, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt"


def test_disjoint_groups_fail_above_on_the_total_and_each_one_sided_group(gradclip, tmp_path):
    a, b = disjoint(tmp_path)
    r = gradclip("compare", a, b, "--fail-above", "10", "--format", "json")
    assert r.code == 1, r.out
    doc = r.json()
    validate(doc, "compare-1")
    assert doc["status"] == "exceeded"
    by_name = {g["name"]: g for g in doc["groups"]}
    assert by_name["enc"]["b"] is None and by_name["enc"]["ratio"] is None
    assert by_name["dec"]["a"] is None and by_name["dec"]["ratio"] is None
    assert rel_err(by_name["enc"]["a"], math.hypot(1.2, 1.6)) <= 1e-6
    assert rel_err(by_name["dec"]["b"], math.hypot(1200, 1600)) <= 1e-6
    assert rel_err(doc["total"]["ratio"], 1000.0) <= 1e-6


def test_disjoint_groups_in_the_table_and_markdown(gradclip, tmp_path):
    a, b = disjoint(tmp_path)
    r = gradclip("compare", a, b, "--fail-above", "10")
    assert r.code == 1
    rows = {line.split()[1]: line for line in r.out.splitlines() if line.startswith("│")}
    assert "only in A" in rows["enc"] and "only in B" in rows["dec"]
    verdict = r.out.splitlines()[-1]
    assert verdict.startswith("FAIL: gradient norms: the total changed 1000x, beyond 10x")
    assert "2 group(s) on one side only: enc (A only), dec (B only)" in verdict
    md = gradclip("compare", a, b, "--fail-above", "10", "--format", "markdown")
    assert md.code == 1
    assert "| enc | 2 | - | **only in A** |" in md.out
    assert "| dec | - | 2000 | **only in B** |" in md.out


def test_disjoint_groups_are_findings_in_github_and_junit(gradclip, tmp_path):
    import xml.etree.ElementTree as ET

    from tests.format.test_ci_formats import parse_workflow_command

    a, b = disjoint(tmp_path)
    gh = gradclip("compare", a, b, "--fail-above", "10", "--format", "github")
    assert gh.code == 1
    parsed = [parse_workflow_command(line) for line in gh.out.splitlines()]
    titles = sorted(props["title"] for name, props, _ in parsed if name == "error")
    assert titles == ["gradclip: gradient total norm changed 1000x",
                      "gradclip: group in A only", "gradclip: group in B only"]
    junit = gradclip("compare", a, b, "--fail-above", "10", "--format", "junit")
    root = ET.fromstring(junit.out.encode())
    failed = {c.get("name") for c in root.iter("testcase") if c.find("failure") is not None}
    assert failed == {"(total)", "enc", "dec"}


def test_without_fail_above_one_sided_groups_are_listed_not_failed(gradclip, tmp_path):
    from tests.format.test_ci_formats import parse_workflow_command

    a, b = disjoint(tmp_path)
    r = gradclip("compare", a, b)
    assert r.code == 0
    assert r.out.splitlines()[-1] == ("OK: gradient total ratio 1000x; 2 group(s) on one side "
                                      "only (exit 0)")
    gh = gradclip("compare", a, b, "--format", "github")
    assert gh.code == 0
    kinds = sorted(name for name, _, _ in map(parse_workflow_command, gh.out.splitlines()))
    assert kinds == ["notice", "warning", "warning"]


def test_the_total_ratio_alone_is_checked(gradclip, tmp_path):
    # Every group (and so the total) grows 4x: within 5x; beyond 3x, the total is named.
    a = {f"{layer}.w": torch.ones(4) for layer in LAYERS}
    torch.save({"grads": a}, tmp_path / "a.pt")
    torch.save({"grads": {k: v * 4 for k, v in a.items()}}, tmp_path / "b.pt")
    ok = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--fail-above", "5")
    assert ok.code == 0
    bad = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--fail-above", "3")
    assert bad.code == 1 and bad.out.splitlines()[-1].startswith(
        "FAIL: gradient norms: the total changed 4x, beyond 3x; "
        "3 group(s) changed by more than 3x")


def test_sides_that_measure_two_quantities_are_refused_in_compare_words(gradclip, tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.save({"grads": {n: p.grad for n, p in model.named_parameters()}}, tmp_path / "a.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "b.pt")
    r = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--format", "json")
    assert r.code == 2
    assert_no_report(r)
    assert r.err_lines == [
        f"gradclip: {tmp_path / 'b.pt'} measures exp_avg (first moment exp_avg / (1 - "
        f"beta1^step), each parameter's own step) but {tmp_path / 'a.pt'} measures grads; "
        "compare needs one quantity on both sides: no --what measures both alike"]


def _adam_step(model):
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("command", ["compare", "trend"])
def test_a_side_without_weights_is_never_offered_weights(gradclip, tmp_path, command):
    """A model's state_dict against a gradients-only file: --what weights fails on the
    gradients' side, so the refusal offers none (following it would be exit 3)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    _adam_step(model)
    torch.save(model.state_dict(), tmp_path / "a.pt")
    torch.save({"grads": {n: p.grad for n, p in model.named_parameters()}}, tmp_path / "b.pt")
    paths = [tmp_path / "a.pt", tmp_path / "b.pt"]
    r = gradclip(command, *paths)
    assert r.code == 2 and len(r.err_lines) == 1, r.err
    assert "give --what" not in r.err, r.err
    assert r.err.rstrip().endswith("no --what measures both alike" if command == "compare"
                                   else "trend them apart"), r.err
    assert gradclip(command, *paths, "--what", "weights").code == 3


@pytest.mark.parametrize("command", ["compare", "trend"])
def test_sides_that_both_hold_the_weights_are_offered_weights(gradclip, tmp_path, command):
    """Saved gradients beside the model against Adam's state beside the model: auto measures
    grads on one side, exp_avg on the other, and --what weights measures both alike; the
    refusal offers it, and following it gives the weights' norms."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = _adam_step(model)
    grads = {n: p.grad for n, p in model.named_parameters()}
    torch.save({"grads": grads, "model": model.state_dict()}, tmp_path / "a.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "b.pt")
    paths = [tmp_path / "a.pt", tmp_path / "b.pt"]
    r = gradclip(command, *paths)
    assert r.code == 2 and len(r.err_lines) == 1, r.err
    assert "give --what weights to measure" in r.err, r.err
    assert "--what exp_avg" not in r.err and "--what grads" not in r.err, r.err
    follow = gradclip(command, *paths, "--what", "weights", "--format", "json")
    assert follow.code == 0, follow.err
    want = float(torch.cat([p.detach().double().flatten() for p in model.parameters()]).norm())
    doc = follow.json()
    got = ([doc["total"]["a"], doc["total"]["b"]] if command == "compare"
           else [p["total_norm"] for p in doc["points"]])
    assert got == pytest.approx([want, want], rel=1e-6)
