"""What a user sees for the numbers that used to go wrong: totals beyond float64, shared
elements, NaN totals, parameters, complex, sparse, float8 and the clip-then-gate pipeline."""

from __future__ import annotations

import math
import resource
import subprocess
import sys

import pytest
import torch

from .support import REPO, SAMPLES, as_float, ref_norm, rel_err, sha256, unwrapped, verdict


def _json(result):
    assert result.out, result.err
    return result.json()


# --- totals beyond float64 (issue 7.1) ---------------------------------------------


@pytest.fixture
def huge(tmp_path):
    path = tmp_path / "huge.pt"
    torch.save({"grads": {f"l.{i}.w": torch.full((1,), 1e308, dtype=torch.float64)
                          for i in range(4)}}, path)
    return path


def test_inspect_total_beyond_float64_is_a_finding(gradclip, huge):
    result = gradclip("inspect", huge, "--format", "json")
    assert result.code == 1
    doc = _json(result)
    assert doc["total_norm"] == "inf" and doc["overflow"] is True
    assert doc["status"] == "overflow"
    assert rel_err(doc["total_norm_log10"], math.log10(2) + 308) <= 1e-9
    table = gradclip("inspect", huge)
    assert table.code == 1
    assert "> 1.8e308" in table.out
    assert verdict(table.out).startswith("FAIL: gradient total norm > 1.8e308")


def test_inspect_tiny_p_norm_of_subnormals_is_within_range(gradclip, tmp_path):
    # At p = 0.01 the root of 4,096 equal subnormals overflows alone (4096 ** 100),
    # the norm (2^-1074 times it, about 8.5e37) does not: it passes a limit above it.
    path = tmp_path / "sub.pt"
    torch.save({"w": torch.full((4096,), 2.0**-1074, dtype=torch.float64)}, path)
    expected = 2.0 ** (math.log2(4096) / 0.01 - 1074)
    result = gradclip("inspect", path, "--norm-type", "0.01", "--max-norm", "1e38",
                      "--format", "json")
    assert result.code == 0, result.err
    doc = _json(result)
    assert doc["overflow"] is False and doc["status"] == "ok"
    assert rel_err(as_float(doc["total_norm"]), expected) <= 1e-9


@pytest.mark.parametrize("max_norm,each", [(1e308, 0.5e308), (1.0, 0.5), (1e-300, 0.5e-300)])
def test_clip_total_beyond_float64_scales_exactly(gradclip, huge, tmp_path, max_norm, each):
    out = tmp_path / "c.pt"
    result = gradclip("clip", huge, "--max-norm", max_norm, "-o", out, "--format", "json")
    assert result.code == 0, result.err
    doc = _json(result)
    assert doc["overflow"] is True and doc["clipped"] is True
    assert doc["total_norm_before"] == "inf"
    clipped = torch.load(out, weights_only=True)["grads"]
    for t in clipped.values():
        assert rel_err(float(t), each) <= 1e-12
    assert as_float(doc["total_norm_after"]) <= max_norm
    assert gradclip("inspect", out, "--max-norm", max_norm).code == 0


def test_clip_refuses_when_every_gradient_would_round_to_zero(gradclip, tmp_path):
    # p = 1e-3 on the healthy sample: the total is about 10^3887, the coefficient
    # 10^-3887; every clipped gradient would be 0. Refused, nothing written.
    out = tmp_path / "zero.pt"
    source = SAMPLES / "healthy.pt"
    before = sha256(source)
    result = gradclip("clip", source, "--max-norm", "1", "--norm-type", "1e-3", "-o", out)
    assert result.code == 1
    assert not out.exists() and sha256(source) == before
    assert "round every gradient to zero" in result.err and "nothing written" in result.err
    assert len(result.err_lines) == 1


# --- shared elements (issue 7.2) --------------------------------------------------


@pytest.fixture
def aliased(tmp_path):
    g = torch.Generator().manual_seed(4)
    m = torch.randn(6, 4, generator=g)
    base = torch.randn(30, generator=g)
    scalar = torch.randn((), generator=g)
    grads = {"h.0.w": m, "h.0.wt": m.t(), "h.1.a": base[0:20], "h.1.b": base[10:30],
             "h.2.e": scalar.expand(50, 50)}
    path = tmp_path / "aliased.pt"
    # "ema.w" aliases grads h.0.w: it is not a gradient and must keep its values.
    torch.save({"grads": grads, "ema": {"w": m[0]}}, path)
    distinct = [m, base, scalar.reshape(1)]
    return path, distinct


@pytest.mark.parametrize("p", ["2", "1", "inf"])
def test_inspect_counts_shared_elements_once(gradclip, aliased, p):
    path, distinct = aliased
    doc = _json(gradclip("inspect", path, "--format", "json", "--norm-type", p))
    assert rel_err(as_float(doc["total_norm"]), ref_norm(distinct, float(p))) <= 1e-6
    assert doc["num_elements"] == 24 + 30 + 1
    rows = {t["name"]: t for t in doc["tensors"]}
    assert rows["h.0.w"]["tied"] == ["h.0.wt"]  # the transpose holds exactly m's elements
    assert rows["h.1.a"]["shares"] == ["h.1.b"]
    assert rel_err(as_float(rows["h.2.e"]["norm"]), abs(float(distinct[2]))) <= 1e-6
    groups = {g["name"]: g for g in doc["groups"]}
    assert groups["h.1"]["num_elements"] == 30
    table = gradclip("inspect", path, "--norm-type", p)
    assert "tied (counted once): h.0.w = h.0.wt" in unwrapped(table.out)


def test_clip_scales_shared_elements_once_and_keeps_aliasing_entries(gradclip, aliased,
                                                                      tmp_path):
    path, distinct = aliased
    out = tmp_path / "c.pt"
    result = gradclip("clip", path, "--max-norm", "0.5", "-o", out, "--format", "json")
    assert result.code == 0, result.err
    doc = _json(result)
    assert doc["unshared"] == ["ema.w"]
    original = torch.load(path, weights_only=True)
    clipped = torch.load(out, weights_only=True)
    coef = 0.5 / (ref_norm(distinct, 2.0) + 1e-6)
    for name, grad in original["grads"].items():
        torch.testing.assert_close(clipped["grads"][name], grad * coef, rtol=1e-6, atol=0)
    assert torch.equal(clipped["ema"]["w"], original["ema"]["w"])
    assert rel_err(ref_norm([t * coef for t in distinct], 2.0), 0.5) <= 1e-6
    assert "kept the values of 1 non-gradient entry" in gradclip(
        "clip", path, "--max-norm", "0.5", "-o", tmp_path / "t.pt").out


def test_expansion_to_a_trillion_elements_follows_the_bytes_stored(tmp_path):
    # A 1.6 KB file naming 10^12 elements (issue 7.11). Run with the address space
    # capped at 3 GiB: the work and memory must follow the one stored element.
    path = tmp_path / "expand.pt"
    torch.save({"g": torch.tensor(1.5).expand(10**6, 10**6)}, path)
    assert path.stat().st_size < 4096

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    for args in (["inspect", path, "--format", "json"],
                 ["clip", path, "--max-norm", "1", "-o", tmp_path / "c.pt", "--format", "json"]):
        proc = subprocess.run([sys.executable, "-m", "gradclip_cli", *map(str, args)], cwd=REPO,
                              preexec_fn=cap, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
    clipped = torch.load(tmp_path / "c.pt", weights_only=True)["g"]
    assert clipped.stride() == (0, 0) and rel_err(float(clipped[0, 0]), 1.5 / (1.5 + 1e-6)) < 1e-6


# --- NaN totals (issues 7.3, 7.4) ---------------------------------------------------


@pytest.fixture
def nan_file(tmp_path):
    path = tmp_path / "nan.pt"
    torch.save({"grads": {"a.w": torch.tensor([math.nan, 1.0]), "b.w": torch.ones(3)}}, path)
    return path


def test_nan_total_with_a_threshold_is_a_finding_even_when_allowed(gradclip, nan_file):
    table = gradclip("inspect", nan_file, "--allow-nonfinite", "--max-norm", "1")
    assert table.code == 1
    assert verdict(table.out).startswith("FAIL") and "could not be checked" in verdict(table.out)
    doc = _json(gradclip("inspect", nan_file, "--allow-nonfinite", "--max-norm", "1",
                         "--format", "json"))
    assert doc["status"] == "nonfinite"
    # Without a threshold there is nothing to check: allowed is allowed.
    assert gradclip("inspect", nan_file, "--allow-nonfinite").code == 0


def test_clip_nan_total_reports_what_was_written(gradclip, nan_file, tmp_path):
    out = tmp_path / "c.pt"
    result = gradclip("clip", nan_file, "--max-norm", "1", "--allow-nonfinite", "-o", out,
                      "--format", "json")
    assert result.code == 0, result.err
    doc = _json(result)
    assert doc["clipped"] is True and doc["clip_coef"] == "nan"
    clipped = torch.load(out, weights_only=True)["grads"]
    assert all(bool(t.isnan().all()) for t in clipped.values())  # as torch does
    table = gradclip("clip", nan_file, "--max-norm", "1", "--allow-nonfinite", "-o", out)
    shown = unwrapped(table.out)
    assert "every gradient element is now NaN" in shown and "unchanged" not in shown


# --- tensors that must simply work (issues 7.5, 7.6, 7.7, 7.10) ----------------------


def test_parameters_saved_with_requires_grad(gradclip, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    path = tmp_path / "params.pt"
    torch.save(dict(model.named_parameters()), path)
    values = [p.detach() for p in model.parameters()]
    doc = _json(gradclip("inspect", path, "--format", "json"))
    assert rel_err(as_float(doc["total_norm"]), ref_norm(values, 2.0)) <= 1e-6
    out = tmp_path / "c.pt"
    assert gradclip("clip", path, "--max-norm", "0.5", "-o", out).code == 0
    clipped = torch.load(out, weights_only=True)
    assert rel_err(ref_norm([t.detach() for t in clipped.values()], 2.0), 0.5) <= 1e-6


@pytest.mark.parametrize("p", ["2", "1", "inf"])
def test_complex_gradients_count_with_modulus(gradclip, tmp_path, p):
    g = torch.Generator().manual_seed(2)
    z = torch.complex(torch.randn(40, generator=g), torch.randn(40, generator=g))
    real = torch.randn(7, generator=g)
    path = tmp_path / "z.pt"
    torch.save({"grads": {"z": z, "r": real}}, path)
    want = ref_norm([z.to(torch.complex128).abs(), real], float(p))
    doc = _json(gradclip("inspect", path, "--format", "json", "--norm-type", p))
    assert rel_err(as_float(doc["total_norm"]), want) <= 1e-6
    out = tmp_path / "c.pt"
    assert gradclip("clip", path, "--max-norm", "0.5", "-o", out, "--norm-type", p).code == 0
    clipped = torch.load(out, weights_only=True)["grads"]
    assert clipped["z"].dtype == torch.complex64
    coef = 0.5 / (want + 1e-6)
    torch.testing.assert_close(clipped["z"], z * coef, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_clip_scales_in_float32(gradclip, tmp_path, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, generator=g) * 4).to(dtype)
    path = tmp_path / "f8.pt"
    torch.save({"grads": {"w": x}}, path)
    out = tmp_path / "c.pt"
    result = gradclip("clip", path, "--max-norm", "1", "-o", out, "--format", "json")
    assert result.code == 0, result.err
    coef = _json(result)["clip_coef"]
    clipped = torch.load(out, weights_only=True)["grads"]["w"]
    assert clipped.dtype == dtype
    assert torch.equal(clipped.float(), (x.float() * coef).to(dtype).float())


@pytest.mark.filterwarnings("ignore:Sparse")
def test_sparse_gradients_are_measured_and_clipped(gradclip, tmp_path):
    emb = torch.nn.Embedding(12, 4, sparse=True)
    emb(torch.tensor([1, 5, 1, 9])).sum().backward()
    coo = emb.weight.grad
    csr = (torch.eye(5) * 2).to_sparse_csr()
    path = tmp_path / "sparse.pt"
    torch.save({"grads": {"emb.weight": coo, "m.w": csr}}, path)
    dense = [coo.to_dense(), csr.to_dense()]
    doc = _json(gradclip("inspect", path, "--format", "json"))
    assert rel_err(as_float(doc["total_norm"]), ref_norm(dense, 2.0)) <= 1e-6
    # Elements are the stored values: the embedding's 3 rows of 4 (row 1 twice,
    # summed), not its 3 entries; the CSR matrix's 5 values.
    assert doc["num_elements"] == 3 * 4 + 5
    assert [g["num_elements"] for g in doc["groups"]] == [12, 5]
    out = tmp_path / "c.pt"
    assert gradclip("clip", path, "--max-norm", "1", "-o", out).code == 0
    clipped = torch.load(out, weights_only=True)["grads"]
    assert clipped["emb.weight"].layout == torch.sparse_coo
    assert rel_err(ref_norm([t.to_dense() for t in clipped.values()], 2.0), 1.0) <= 1e-6


# --- clip, then gate (issue 8.1) -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.float32])
@pytest.mark.parametrize("max_norm", ["0.5", "1", "3.3", "0.0123"])
def test_clip_then_inspect_with_the_same_limit_passes(gradclip, tmp_path, dtype, max_norm):
    g = torch.Generator().manual_seed(7)
    grads = {f"l.{i}.w": (torch.randn(300, generator=g) * 2).to(dtype) for i in range(3)}
    path = tmp_path / "g.pt"
    torch.save({"grads": grads}, path)
    out = tmp_path / "c.pt"
    result = gradclip("clip", path, "--max-norm", max_norm, "-o", out, "--format", "json")
    assert result.code == 0, result.err
    doc = _json(result)
    gate = gradclip("inspect", out, "--max-norm", max_norm, "--format", "json")
    assert gate.code == 0, _json(gate)["total_norm"]
    stored = ref_norm(torch.load(out, weights_only=True)["grads"].values(), 2.0)
    assert stored <= float(max_norm) * (1 + 1e-6)
    total = ref_norm(grads.values(), 2.0)
    torch_coef = float(max_norm) / (total + 1e-6)
    u = torch.finfo(dtype).eps / 2
    if doc["coef_lowered"]:
        assert rel_err(doc["clip_coef_torch"], torch_coef) <= 1e-6
        # Lowered just enough: by no more than a few roundings of the stored dtype.
        assert torch_coef * (1 - 4 * u) <= doc["clip_coef"] < torch_coef
        text = gradclip("clip", path, "--max-norm", max_norm, "-o", tmp_path / "t.pt").out
        assert "coefficient lowered from" in unwrapped(text)
    else:
        assert rel_err(doc["clip_coef"], torch_coef) <= 1e-6
