"""Numbers through the CLI: norm types, groups, per-tensor rows and accuracy at any magnitude.

References are float64 and scaled (support.ref_norm); torch's own get_total_norm is asserted
where it fails, to document why the CLI's answer cannot simply be torch's.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from .support import as_float, assert_no_report, gpt_like_grads, nonfinite_counts, ref_norm, rel_err

NORM_TYPES = ["0.5", "1", "2", "3", "inf"]


def inspect_json(gradclip, path, *args):
    result = gradclip("inspect", path, "--format", "json", "--allow-nonfinite", *args)
    assert result.code == 0, result.err
    return result.json()


def layer(name: str) -> str:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name.rpartition(".")[0] or name


@pytest.mark.parametrize("p", NORM_TYPES)
def test_total_group_and_tensor_norms_match_reference(gradclip, grads_file, grads, p):
    pf = float(p)
    doc = inspect_json(gradclip, grads_file, "--norm-type", p)
    assert as_float(doc["norm_type"]) == pf
    assert rel_err(as_float(doc["total_norm"]), ref_norm(grads.values(), pf)) <= 1e-6
    for row in doc["tensors"]:
        grad = grads[row["name"]]
        assert rel_err(as_float(row["norm"]), ref_norm([grad], pf)) <= 1e-6, row["name"]
        assert as_float(row["max_abs"]) == float(grad.abs().max())
        assert row["group"] == layer(row["name"])
    members: dict[str, list[torch.Tensor]] = {}
    for name, grad in grads.items():
        members.setdefault(layer(name), []).append(grad)
    assert [g["name"] for g in doc["groups"]] == list(members)  # checkpoint order
    for group in doc["groups"]:
        tensors = members[group["name"]]
        assert rel_err(as_float(group["norm"]), ref_norm(tensors, pf)) <= 1e-6, group["name"]
        assert as_float(group["max_abs"]) == max(float(t.abs().max()) for t in tensors)
        assert group["num_tensors"] == len(tensors)
        assert group["num_elements"] == sum(t.numel() for t in tensors)


def test_default_layer_groups(gradclip, grads_file):
    doc = inspect_json(gradclip, grads_file)
    rows = {t["name"]: t["group"] for t in doc["tensors"]}
    assert rows["transformer.h.2.attn.c_attn.weight"] == "transformer.h.2"
    assert rows["transformer.wte.weight"] == "transformer.wte"
    assert rows["transformer.ln_f.weight"] == "transformer.ln_f"
    assert [g["name"] for g in doc["groups"]] == [
        "transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
        "transformer.h.2", "transformer.ln_f",
    ]  # fmt: skip


NAMES = [
    "transformer.h.3.attn.c_attn.weight",
    "transformer.h.3.mlp.c_fc.bias",
    "transformer.h.12.ln_1.weight",
    "transformer.wte.weight",
    "bias",
]


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("layer", ["transformer.h.3", "transformer.h.3", "transformer.h.12", "transformer.wte",
                   "bias"]),
        ("module", ["transformer.h.3.attn.c_attn", "transformer.h.3.mlp.c_fc",
                    "transformer.h.12.ln_1", "transformer.wte", "bias"]),
        ("depth:2", ["transformer.h", "transformer.h", "transformer.h", "transformer.wte",
                     "bias"]),
        ("tensor", NAMES),
    ],
)  # fmt: skip
def test_group_by_rules(gradclip, tmp_path, rule, expected):
    g = torch.Generator().manual_seed(2)
    grads = {name: torch.randn(5, generator=g) * (i + 1) for i, name in enumerate(NAMES)}
    path = tmp_path / "g.pt"
    torch.save(grads, path)
    doc = inspect_json(gradclip, path, "--group-by", rule)
    assert [t["group"] for t in doc["tensors"]] == expected
    members: dict[str, list[torch.Tensor]] = {}
    for name, group in zip(NAMES, expected):
        members.setdefault(group, []).append(grads[name])
    assert [g["name"] for g in doc["groups"]] == list(members)
    for group in doc["groups"]:
        assert rel_err(group["norm"], ref_norm(members[group["name"]], 2)) <= 1e-6
        assert group["num_tensors"] == len(members[group["name"]])


def test_group_by_regex_capture(gradclip, tmp_path):
    g = torch.Generator().manual_seed(3)
    grads = {name: torch.randn(5, generator=g) for name in NAMES}
    path = tmp_path / "g.pt"
    torch.save(grads, path)
    doc = inspect_json(gradclip, path, "--group-by", r"regex:(h\.\d+)")
    rows = {t["name"]: t["group"] for t in doc["tensors"]}
    assert rows["transformer.h.3.attn.c_attn.weight"] == "h.3"
    assert rows["transformer.h.3.mlp.c_fc.bias"] == "h.3"
    assert rows["transformer.h.12.ln_1.weight"] == "h.12"
    # Unmatched names fall in one group of their own, never in a matched one.
    unmatched = {rows["transformer.wte.weight"], rows["bias"]}
    assert len(unmatched) == 1 and not unmatched & {"h.3", "h.12"}
    groups = {gr["name"]: gr for gr in doc["groups"]}
    h3 = [grads["transformer.h.3.attn.c_attn.weight"], grads["transformer.h.3.mlp.c_fc.bias"]]
    assert rel_err(groups["h.3"]["norm"], ref_norm(h3, 2)) <= 1e-6
    assert sum(gr["num_tensors"] for gr in doc["groups"]) == len(NAMES)


@pytest.mark.parametrize("rule", ["bogus", "depth:0", "depth:x", "depth:", "regex:(", "Layer"])
def test_bad_group_by_exits_2(gradclip, grads_file, rule):
    result = gradclip("inspect", grads_file, "--group-by", rule)
    assert result.code == 2
    assert len(result.err_lines) == 1 and "--group-by" in result.err
    assert_no_report(result)


def test_nonfinite_counts_per_tensor_and_group(gradclip, tmp_path):
    grads = gpt_like_grads(seed=5)
    poisoned = {
        "transformer.h.0.attn.c_attn.weight": (3, 0, 0),
        "transformer.h.0.mlp.c_fc.weight": (0, 2, 1),
        "transformer.h.2.attn.c_attn.bias": (1, 1, 1),
    }
    for name, (nan, pos, neg) in poisoned.items():
        flat = grads[name].view(-1)
        flat[:nan] = math.nan
        flat[nan : nan + pos] = math.inf
        flat[nan + pos : nan + pos + neg] = -math.inf
    path = tmp_path / "bad.pt"
    torch.save({"grads": grads}, path)
    result = gradclip("inspect", path, "--format", "json")
    assert result.code == 1
    doc = result.json()
    assert doc["status"] == "nonfinite"
    assert doc["nonfinite"] == nonfinite_counts(grads.values())
    for row in doc["tensors"]:
        assert row["nonfinite"] == nonfinite_counts([grads[row["name"]]]), row["name"]
        if row["name"] not in poisoned:
            assert rel_err(row["norm"], ref_norm([grads[row["name"]]], 2)) <= 1e-6
    for group in doc["groups"]:
        tensors = [t for n, t in grads.items() if layer(n) == group["name"]]
        assert group["nonfinite"] == nonfinite_counts(tensors), group["name"]
    groups = {g["name"]: g for g in doc["groups"]}
    assert groups["transformer.h.1"]["norm"] == pytest.approx(
        ref_norm([t for n, t in grads.items() if layer(n) == "transformer.h.1"], 2), rel=1e-6
    )


# -- accuracy at extreme magnitudes -------------------------------------------------------


def _single(tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / "g.pt"
    torch.save({"grads": tensors}, path)
    return path


@pytest.mark.parametrize("scale", [1e20, 1e-25])
@pytest.mark.parametrize("p", ["2", "3", "0.5"])
def test_fp32_extreme_magnitudes_are_accurate(gradclip, tmp_path, scale, p):
    g = torch.Generator().manual_seed(7)
    grads = {f"l.{i}.w": (torch.rand(64, generator=g) + 0.5) * scale for i in range(3)}
    expected = ref_norm(grads.values(), float(p))
    if p == "2":
        # Why not torch: its fp32 sum of squares overflows (1e40) or underflows (1e-50).
        naive = float(torch.nn.utils.get_total_norm(list(grads.values()), 2.0))
        assert naive == (math.inf if scale > 1 else 0.0)
    doc = inspect_json(gradclip, _single(tmp_path, grads), "--norm-type", p)
    actual = as_float(doc["total_norm"])
    assert math.isfinite(actual) and actual > 0
    assert rel_err(actual, expected) <= 1e-6
    for row in doc["tensors"]:
        assert rel_err(row["norm"], ref_norm([grads[row["name"]]], float(p))) <= 1e-6
    for group in doc["groups"]:
        assert rel_err(group["norm"], ref_norm([grads[group["name"] + ".w"]], float(p))) <= 1e-6
    assert doc["status"] == "ok"


def test_fp16_norm_above_fp16_max(gradclip, tmp_path):
    grads = {
        "a.w": torch.full((400,), 30000.0, dtype=torch.float16),
        "b.w": torch.full((3,), 65504.0, dtype=torch.float16),
    }
    expected = ref_norm(grads.values(), 2)
    assert expected > 65504
    assert math.isinf(float(torch.nn.utils.get_total_norm(list(grads.values()), 2.0)))
    doc = inspect_json(gradclip, _single(tmp_path, grads))
    assert rel_err(doc["total_norm"], expected) <= 1e-6
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rel_err(rows["a.w"]["norm"], 30000.0 * 20) <= 1e-6
    assert rows["a.w"]["dtype"] == "float16"


def test_fp16_tiny_values(gradclip, tmp_path):
    grads = {"a.w": torch.full((100,), 6e-8, dtype=torch.float16)}  # subnormal fp16
    doc = inspect_json(gradclip, _single(tmp_path, grads))
    assert rel_err(doc["total_norm"], ref_norm(grads.values(), 2)) <= 1e-6


@pytest.mark.parametrize("scale", [1.0, 1e30, 1e-30])
def test_bf16(gradclip, tmp_path, scale):
    g = torch.Generator().manual_seed(8)
    grads = {f"l.{i}.w": (torch.randn(50, generator=g) * scale).bfloat16() for i in range(2)}
    doc = inspect_json(gradclip, _single(tmp_path, grads))
    assert rel_err(doc["total_norm"], ref_norm(grads.values(), 2)) <= 1e-6
    assert {t["dtype"] for t in doc["tensors"]} == {"bfloat16"}
    for row in doc["tensors"]:
        assert rel_err(row["norm"], ref_norm([grads[row["name"]]], 2)) <= 1e-6


@pytest.mark.parametrize("scale", [1.0, 1e300, 1e-300])
@pytest.mark.parametrize("p", ["1", "2", "3"])
def test_float64(gradclip, tmp_path, scale, p):
    g = torch.Generator().manual_seed(9)
    grads = {
        f"l.{i}.w": torch.randn(50, generator=g, dtype=torch.float64) * scale for i in range(2)
    }
    doc = inspect_json(gradclip, _single(tmp_path, grads), "--norm-type", p)
    actual = as_float(doc["total_norm"])
    assert math.isfinite(actual) and actual > 0
    assert rel_err(actual, ref_norm(grads.values(), float(p))) <= 1e-6
    assert {t["dtype"] for t in doc["tensors"]} == {"float64"}


def test_mixed_dtypes_in_one_file(gradclip, tmp_path):
    g = torch.Generator().manual_seed(10)
    grads = {
        "a.w": torch.randn(30, generator=g).half() * 1000,
        "b.w": torch.randn(30, generator=g).bfloat16() * 1e20,
        "c.w": torch.randn(30, generator=g) * 1e-10,
        "d.w": torch.randn(30, generator=g, dtype=torch.float64),
    }
    for p in NORM_TYPES:
        doc = inspect_json(gradclip, _single(tmp_path, grads), "--norm-type", p)
        assert rel_err(as_float(doc["total_norm"]), ref_norm(grads.values(), float(p))) <= 1e-6


def test_zero_gradients(gradclip, tmp_path):
    grads = {"a.w": torch.zeros(10), "b.w": torch.zeros(0)}
    for p in NORM_TYPES:
        doc = inspect_json(gradclip, _single(tmp_path, grads), "--norm-type", p)
        assert as_float(doc["total_norm"]) == 0.0
        assert doc["num_elements"] == 10


def test_table_numbers_agree_with_reference(gradclip, grads_file, grads):
    """The number a person reads in the table is the reference, to its 6 digits."""
    out = gradclip("inspect", grads_file).out
    total_line = next(
        line
        for line in out.splitlines()
        if re.search(r"\btotal\b", line) and not line.startswith(("OK", "FAIL"))
    )
    shown = float(re.findall(r"[-+]?\d[\d.]*(?:e[-+]?\d+)?", total_line)[0])
    assert shown == pytest.approx(ref_norm(grads.values(), 2), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_total_beyond_the_dtype_range_stays_finite(gradclip, tmp_path, dtype):
    """Every element is finite, the total (~2e39) is not representable in the input's dtype."""
    g = torch.Generator().manual_seed(14)
    grads = {"w.a": ((torch.rand(100, generator=g) + 1) * 1.5e38).to(dtype)}
    assert torch.isfinite(grads["w.a"]).all()
    doc = inspect_json(gradclip, _single(tmp_path, grads))
    assert rel_err(as_float(doc["total_norm"]), ref_norm(grads.values(), 2)) <= 1e-6
    assert doc["status"] == "ok"
