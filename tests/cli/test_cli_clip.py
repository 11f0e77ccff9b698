"""``gradclip clip``: where it writes, what it keeps, and that the clipped norm is right."""

from __future__ import annotations

import math
import re
import zipfile

import pytest
import torch

from .support import (
    as_float,
    assert_no_report,
    gpt_like_grads,
    load_safetensors,
    ref_norm,
    rel_err,
    save_safetensors,
    sha256,
)


def expected_after(total: float, max_norm: float) -> float:
    return total * min(1.0, max_norm / (total + 1e-6))


@pytest.mark.parametrize("p", ["1", "2", "inf", "0.5"])
@pytest.mark.parametrize("max_norm", [0.25, 3.0, 1e9])
def test_clipped_norm(gradclip, grads_file, grads, p, max_norm):
    pf = float(p)
    total = ref_norm(grads.values(), pf)
    out = grads_file.with_name(f"out-{p}-{max_norm}.pt")
    result = gradclip(
        "clip", grads_file, "--max-norm", max_norm, "--norm-type", p, "-o", out, "--format", "json"
    )
    assert result.code == 0, result.err
    doc = result.json()
    clipped = torch.load(out, weights_only=True)["grads"]
    assert rel_err(ref_norm(clipped.values(), pf), expected_after(total, max_norm)) <= 1e-6
    assert rel_err(as_float(doc["total_norm_after"]), expected_after(total, max_norm)) <= 1e-6
    assert doc["clipped"] is (max_norm < total)
    coef = min(1.0, max_norm / (total + 1e-6))
    for name, grad in grads.items():  # every tensor scaled by the same coefficient
        # The coefficient may come from a float32 total (contract: float32 or wider), and
        # the product is rounded to float32: a few ulps, well inside the norm's 1e-6.
        torch.testing.assert_close(clipped[name].double(), grad.double() * coef, rtol=1e-6, atol=0)


def test_default_output_beside_input(gradclip, tmp_path, grads):
    for name, clipped_name in (
        ("grads.pt", "grads.clipped.pt"),
        ("model.step.ckpt", "model.step.clipped.ckpt"),
        ("g.bin", "g.clipped.bin"),
    ):
        path = tmp_path / name
        torch.save({"grads": grads}, path)
        result = gradclip("clip", path, "--max-norm", "1")
        assert result.code == 0, result.err
        assert (tmp_path / clipped_name).is_file()


def test_default_output_safetensors(gradclip, tmp_path, grads):
    path = tmp_path / "g.safetensors"
    save_safetensors(path, grads, {"step": "5"})
    result = gradclip("clip", path, "--max-norm", "1", "--format", "json")
    assert result.code == 0, result.err
    assert result.json()["output"] == str(tmp_path / "g.clipped.safetensors")
    assert (tmp_path / "g.clipped.safetensors").is_file()


def test_input_never_changes_without_in_place(gradclip, grads_file, tmp_path):
    before = sha256(grads_file)
    gradclip("inspect", grads_file, "--max-norm", "1")
    gradclip("clip", grads_file, "--max-norm", "1")
    gradclip("clip", grads_file, "--clip-value", "0.01", "-o", tmp_path / "v.pt")
    assert sha256(grads_file) == before


def test_output_option(gradclip, grads_file, tmp_path):
    out = tmp_path / "sub" / "x.pt"
    out.parent.mkdir()
    result = gradclip("clip", grads_file, "--max-norm", "1", "-o", out, "--format", "json")
    assert result.code == 0
    assert result.json()["output"] == str(out)
    assert out.is_file()
    assert not grads_file.with_name("grads.clipped.pt").exists()
    result = gradclip("clip", grads_file, "--max-norm", "1", "--output", tmp_path / "y.pt")
    assert result.code == 0 and (tmp_path / "y.pt").is_file()


def test_in_place(gradclip, grads_file, grads):
    total = ref_norm(grads.values(), 2)
    before = sha256(grads_file)
    result = gradclip("clip", grads_file, "--max-norm", "1", "--in-place", "--format", "json")
    assert result.code == 0, result.err
    assert result.json()["output"] == str(grads_file)
    assert sha256(grads_file) != before
    loaded = torch.load(grads_file, weights_only=True)
    assert loaded["step"] == 7
    assert rel_err(ref_norm(loaded["grads"].values(), 2), expected_after(total, 1.0)) <= 1e-6
    assert sorted(p.name for p in grads_file.parent.iterdir()) == ["grads.pt"]  # no leftovers


def test_in_place_safetensors(gradclip, tmp_path, grads):
    path = tmp_path / "g.safetensors"
    save_safetensors(path, grads, {"a": "b"})
    total = ref_norm(grads.values(), 2)
    assert gradclip("clip", path, "--max-norm", "2", "--in-place").code == 0
    loaded, metadata = load_safetensors(path)
    assert metadata == {"a": "b"}
    assert rel_err(ref_norm(loaded.values(), 2), expected_after(total, 2.0)) <= 1e-6


def training_state():
    g = torch.Generator().manual_seed(4)
    wte = torch.randn(16, 4, generator=g)
    grads = gpt_like_grads(seed=4, layers=2)
    grads["transformer.h.0.mlp.c_fc.weight"] = grads["transformer.h.0.mlp.c_fc.weight"].half()
    grads["transformer.ln_f.weight"] = grads["transformer.ln_f.weight"].double()
    grads["nested"] = {"inner.w": torch.randn(3, 3, generator=g), "count": torch.arange(3)}
    grads["lm_head.weight"] = grads["transformer.wte.weight"]  # tied
    return {
        "model": {"transformer.wte.weight": wte, "lm_head.weight": wte, "ln.bias": torch.zeros(4)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(4)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "grads": grads,
        "step": 12,
        "config": {"name": "gpt", "layers": [1, 2], "dropout": None, "tied": True},
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_output_keeps_structure_entries_dtypes_and_ties(gradclip, tmp_path):
    state = training_state()
    path = tmp_path / "state.pt"
    torch.save(state, path)
    original = torch.load(path, weights_only=True)
    grads_in = dict(leaves(original["grads"]))
    floating = [t for n, t in grads_in.items() if t.is_floating_point() and n != "lm_head.weight"]
    total = ref_norm(floating, 2)
    out = tmp_path / "out.pt"
    result = gradclip("clip", path, "--max-norm", "0.5", "-o", out, "--format", "json")
    assert result.code == 0, result.err
    assert rel_err(result.json()["total_norm_before"], total) <= 1e-6
    loaded = torch.load(out, weights_only=True)

    assert list(loaded) == list(original)
    for key in ("model", "optimizer", "step", "config"):
        assert same(loaded[key], original[key]), key
    model = loaded["model"]
    assert model["lm_head.weight"].data_ptr() == model["transformer.wte.weight"].data_ptr()

    grads_out = dict(leaves(loaded["grads"]))
    assert list(grads_out) == list(grads_in)
    coef = min(1.0, 0.5 / (total + 1e-6))
    for name, before in grads_in.items():
        after = grads_out[name]
        assert (after.dtype, after.shape) == (before.dtype, before.shape), name
        if not before.is_floating_point():
            assert torch.equal(after, before), name
        else:
            # One coefficient for all (float32 or wider: 1e-6 covers it); fp16 also rounds
            # the product, to its subnormal spacing (2**-24) near zero.
            rtol, atol = (2.0**-10, 2.0**-24) if before.dtype == torch.float16 else (1e-6, 0)
            torch.testing.assert_close(after.double(), before.double() * coef, rtol=rtol, atol=atol)
    tied = loaded["grads"]
    assert tied["lm_head.weight"].data_ptr() == tied["transformer.wte.weight"].data_ptr()
    # Scaled once, not twice through its second name.
    unique = [t for n, t in grads_out.items() if t.is_floating_point() and n != "lm_head.weight"]
    assert rel_err(ref_norm(unique, 2), expected_after(total, 0.5)) <= 1e-6



def test_entries_in_tuples_that_share_a_gradients_storage_keep_their_values(gradclip, tmp_path):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(4, 4, generator=g) * 10
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": w}, "ema": (w[0], 5), "deep": {"x": (1, [(w[2],)])},
                "size": torch.Size([4, 4])}, path)
    original = torch.load(path, weights_only=True)
    out = tmp_path / "out.pt"
    result = gradclip("clip", path, "--max-norm", "1", "-o", out, "--format", "json")
    assert result.code == 0, result.err
    assert result.json()["unshared"] == ["deep.x.1.0.0", "ema.0"]
    clipped = torch.load(out, weights_only=True)
    assert type(clipped["ema"]) is tuple and clipped["ema"][1] == 5
    assert torch.equal(clipped["ema"][0], original["ema"][0])
    assert torch.equal(clipped["deep"]["x"][1][0][0], original["deep"]["x"][1][0][0])
    assert type(clipped["size"]) is torch.Size
    assert gradclip("inspect", out, "--max-norm", "1").code == 0


def test_gradient_mapping_named_twice_is_clipped(gradclip, tmp_path):
    """One gradient dict under two keys (pickle keeps it one object): it is clipped."""
    grads = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(3)) * 10}
    path = tmp_path / "g.pt"
    torch.save({"grads": grads, "state": {"last": grads}}, path)
    out = tmp_path / "out.pt"
    result = gradclip("clip", path, "--max-norm", "1", "-o", out, "--format", "json")
    assert result.code == 0, result.err
    assert result.json()["unshared"] == []
    clipped = torch.load(out, weights_only=True)
    assert clipped["grads"] is clipped["state"]["last"]
    coef = 1.0 / (ref_norm(grads.values(), 2) + 1e-6)
    torch.testing.assert_close(clipped["grads"]["w"], grads["w"] * coef, rtol=1e-6, atol=0)
    assert gradclip("inspect", out, "--max-norm", "1").code == 0


def test_entries_that_hold_themselves_are_written_back(gradclip, tmp_path):
    loop: list = [1]
    loop.append(loop)
    node: dict = {}
    node["self"] = node
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(3) * 4}, "loop": loop, "node": node}, path)
    out = tmp_path / "out.pt"
    result = gradclip("clip", path, "--max-norm", "1", "-o", out)
    assert result.code == 0, result.err
    clipped = torch.load(out, weights_only=True)
    assert clipped["loop"][1] is clipped["loop"] and clipped["node"]["self"] is clipped["node"]

def test_safetensors_output_keeps_metadata_names_dtypes(gradclip, tmp_path):
    g = torch.Generator().manual_seed(6)
    grads = {
        "b.w": torch.randn(4, 3, generator=g),
        "a.w": torch.randn(5, generator=g).half(),
        "c.w": torch.randn(2, generator=g).bfloat16(),
        "ids": torch.arange(4),
    }
    path = tmp_path / "g.safetensors"
    save_safetensors(path, grads, {"step": "100", "producer": "test"})
    out = tmp_path / "o.safetensors"
    assert gradclip("clip", path, "--max-norm", "0.1", "-o", out).code == 0
    loaded, metadata = load_safetensors(out)
    assert metadata == {"step": "100", "producer": "test"}
    assert set(loaded) == set(grads)
    for name, t in grads.items():
        assert (loaded[name].dtype, loaded[name].shape) == (t.dtype, t.shape), name
    assert torch.equal(loaded["ids"], grads["ids"])
    floating = [t for t in grads.values() if t.is_floating_point()]
    after = ref_norm([loaded[n] for n, t in grads.items() if t.is_floating_point()], 2)
    assert after == pytest.approx(expected_after(ref_norm(floating, 2), 0.1), rel=1e-2)


def test_clip_value(gradclip, grads_file, grads, tmp_path):
    out = tmp_path / "v.pt"
    result = gradclip("clip", grads_file, "--clip-value", "0.5", "-o", out, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["clipped"] is True
    loaded = torch.load(out, weights_only=True)
    assert loaded["step"] == 7
    for name, grad in grads.items():
        assert torch.equal(loaded["grads"][name], grad.clamp(-0.5, 0.5)), name
    expected = ref_norm([g.clamp(-0.5, 0.5) for g in grads.values()], 2)
    assert rel_err(doc["total_norm_after"], expected) <= 1e-6
    assert rel_err(doc["total_norm_before"], ref_norm(grads.values(), 2)) <= 1e-6


def test_clip_value_above_max_abs_changes_nothing(gradclip, grads_file, grads, tmp_path):
    out = tmp_path / "v.pt"
    result = gradclip("clip", grads_file, "--clip-value", "1e9", "-o", out, "--format", "json")
    assert result.code == 0 and result.json()["clipped"] is False
    loaded = torch.load(out, weights_only=True)["grads"]
    assert all(torch.equal(loaded[n], g) for n, g in grads.items())



@pytest.mark.parametrize("values, clipped", [
    ([5.0, math.nan, 0.1], True),       # a NaN beside an element the clamp changes
    ([0.1, math.nan, -0.2], False),     # a NaN, nothing beyond the bound
    ([0.1, math.inf, -0.2], True),      # an infinity is clamped to the bound
], ids=["nan-and-large", "nan-only", "inf"])
def test_clip_value_says_whether_it_changed_an_element(gradclip, tmp_path, values, clipped):
    path = tmp_path / "g.pt"
    grads = {"a": torch.tensor(values), "b": torch.tensor([0.25, -0.25])}
    torch.save({"grads": grads}, path)
    out = tmp_path / "v.pt"
    result = gradclip("clip", path, "--clip-value", "0.3", "--allow-nonfinite", "-o", out,
                      "--format", "json")
    assert result.code == 0, result.err
    written = torch.load(out, weights_only=True)["grads"]
    changed = any(not torch.equal(written[n].nan_to_num(), g.nan_to_num())
                  for n, g in grads.items())
    assert changed is clipped
    assert result.json()["clipped"] is clipped

def nonfinite_file(tmp_path):
    grads = gpt_like_grads()
    grads["transformer.h.1.mlp.c_fc.weight"][0, 0] = math.nan
    path = tmp_path / "bad.pt"
    torch.save({"grads": grads}, path)
    return path


def test_nonfinite_refuses_to_clip(gradclip, tmp_path):
    path = nonfinite_file(tmp_path)
    before = sha256(path)
    for extra in ([], ["-o", tmp_path / "o.pt"], ["--in-place"], ["--format", "json"]):
        result = gradclip("clip", path, "--max-norm", "1", *extra)
        assert result.code == 1, extra
        assert_no_report(result)
        assert str(path) in result.err and "--allow-nonfinite" in result.err
        assert "Traceback" not in result.err and len(result.err_lines) <= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]  # nothing written
    assert sha256(path) == before


def test_nonfinite_clip_value_also_refuses(gradclip, tmp_path):
    path = nonfinite_file(tmp_path)
    result = gradclip("clip", path, "--clip-value", "1")
    assert result.code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]


def test_allow_nonfinite_clips_anyway(gradclip, tmp_path):
    path = nonfinite_file(tmp_path)
    result = gradclip("clip", path, "--max-norm", "1", "--allow-nonfinite", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["total_norm_before"] == "nan"
    out = torch.load(path.with_name("bad.clipped.pt"), weights_only=True)["grads"]
    assert set(out) == set(gpt_like_grads())


def test_bf16_clip_keeps_bf16(gradclip, tmp_path):
    g = torch.Generator().manual_seed(11)
    grads = {f"l.{i}.w": torch.randn(200, generator=g).bfloat16() for i in range(3)}
    path = tmp_path / "b.pt"
    torch.save({"grads": grads}, path)
    total = ref_norm(grads.values(), 2)
    result = gradclip("clip", path, "--max-norm", "3.3", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    torch_coef = min(1.0, 3.3 / (total + 1e-6))
    assert rel_err(doc["total_norm_before"], total) <= 1e-6
    # Rounded to bf16, torch's coefficient leaves this total above 3.3: the
    # coefficient is lowered (by less than two bf16 roundings) and says so.
    assert doc["coef_lowered"] is True
    assert rel_err(doc["clip_coef_torch"], torch_coef) <= 1e-6
    coef = doc["clip_coef"]
    assert torch_coef * (1 - 2.0**-7) <= coef < torch_coef
    assert doc["total_norm_after"] <= 3.3
    out = torch.load(path.with_name("b.clipped.pt"), weights_only=True)["grads"]
    for name, grad in grads.items():
        assert out[name].dtype == torch.bfloat16
        exact = grad.double() * coef
        # One bf16 rounding of the exact product (2**-8 relative); a coefficient rounded to
        # bf16 first would add up to another 2**-8.
        err = ((out[name].double() - exact).abs() / exact.abs().clamp_min(1e-30)).max()
        assert float(err) <= 2.0**-8 * (1 + 1e-6), name
    assert rel_err(ref_norm(out.values(), 2), total * coef) <= 2.0**-8
    assert rel_err(doc["total_norm_after"], ref_norm(out.values(), 2)) <= 1e-6


def test_fp16_clip_keeps_fp16_above_fp16_max(gradclip, tmp_path):
    grads = {"a.w": torch.full((1000,), 3000.0, dtype=torch.float16)}  # norm ~94868 > 65504
    path = tmp_path / "h.pt"
    torch.save(grads, path)
    result = gradclip("clip", path, "--max-norm", "1", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert rel_err(doc["total_norm_before"], 3000.0 * math.sqrt(1000)) <= 1e-6
    out = torch.load(path.with_name("h.clipped.pt"), weights_only=True)
    assert out["a.w"].dtype == torch.float16
    assert ref_norm(out.values(), 2) == pytest.approx(1.0, rel=1e-3)




@pytest.mark.parametrize(
    ("dtype", "scale", "max_norm"),
    [
        (torch.float32, 1e30, "1"),  # coefficient ~1e-32: a normal float32
        (torch.float32, 1e33, "1e-3"),  # ~7e-38: still normal
        pytest.param(torch.float32, 1.5e38, "1e-3"),  # ~4e-43: a subnormal
        pytest.param(torch.float32, 1.5e38, "1e-6"),  # ~4e-46: rounds to 0
        pytest.param(torch.bfloat16, 1.5e38, "1e-6"),
    ],
)  # fmt: skip
def test_clip_huge_gradients_to_a_small_norm(gradclip, tmp_path, dtype, scale, max_norm):
    g = torch.Generator().manual_seed(15)
    grads = {"w.a": ((torch.rand(100, generator=g) + 1) * scale).to(dtype)}
    path = tmp_path / "huge.pt"
    torch.save(grads, path)
    result = gradclip("clip", path, "--max-norm", max_norm, "--format", "json")
    assert result.code == 0, result.err
    total = ref_norm(grads.values(), 2)
    assert rel_err(result.json()["total_norm_before"], total) <= 1e-6
    out = torch.load(path.with_name("huge.clipped.pt"), weights_only=True)
    assert out["w.a"].dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 2.0**-8
    assert rel_err(ref_norm(out.values(), 2), expected_after(total, float(max_norm))) <= tolerance


def test_legacy_stays_legacy(gradclip, tmp_path, grads):
    path = tmp_path / "legacy.pt"
    shared = grads["transformer.wte.weight"]
    torch.save({**grads, "lm_head.weight": shared}, path, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path)
    total = ref_norm(grads.values(), 2)
    result = gradclip("clip", path, "--max-norm", "1", "--format", "json")
    assert result.code == 0, result.err
    out = path.with_name("legacy.clipped.pt")
    assert not zipfile.is_zipfile(out)
    loaded = torch.load(out, weights_only=True)
    assert list(loaded) == [*grads, "lm_head.weight"]
    assert loaded["lm_head.weight"].data_ptr() == loaded["transformer.wte.weight"].data_ptr()
    unique = [loaded[n] for n in grads]
    assert rel_err(ref_norm(unique, 2), expected_after(total, 1.0)) <= 1e-6


def test_zip_stays_zip(gradclip, grads_file):
    assert gradclip("clip", grads_file, "--max-norm", "1").code == 0
    assert zipfile.is_zipfile(grads_file.with_name("grads.clipped.pt"))


def test_clipped_copy_inspects_at_the_limit(gradclip, grads_file):
    """The user's round trip: clip, then inspect the copy against the same threshold."""
    assert gradclip("inspect", grads_file, "--max-norm", "2").code == 1
    assert gradclip("clip", grads_file, "--max-norm", "2").code == 0
    result = gradclip(
        "inspect", grads_file.with_name("grads.clipped.pt"), "--max-norm", "2", "--format", "json"
    )
    assert result.code == 0, result.json()["total_norm"]


def test_in_place_through_a_symlink_keeps_the_link(gradclip, grads_file, grads, tmp_path):
    link = tmp_path / "link.pt"
    link.symlink_to(grads_file)
    total = ref_norm(grads.values(), 2)
    assert gradclip("clip", link, "--max-norm", "1", "--in-place").code == 0
    assert link.is_symlink() and link.resolve() == grads_file.resolve()
    loaded = torch.load(grads_file, weights_only=True)["grads"]
    assert rel_err(ref_norm(loaded.values(), 2), expected_after(total, 1.0)) <= 1e-6


def test_output_that_is_a_link_to_the_input_is_refused(gradclip, grads_file, tmp_path):
    link = tmp_path / "alias.pt"
    link.symlink_to(grads_file)
    before = sha256(grads_file)
    result = gradclip("clip", grads_file, "--max-norm", "1", "-o", link)
    assert result.code == 2 and len(result.err_lines) == 1
    assert sha256(grads_file) == before


def test_output_takes_the_input_permissions(gradclip, grads_file):
    grads_file.chmod(0o640)
    assert gradclip("clip", grads_file, "--max-norm", "1").code == 0
    assert grads_file.with_name("grads.clipped.pt").stat().st_mode & 0o777 == 0o640


def test_gradients_in_nested_lists_are_clipped_in_place(gradclip, tmp_path):
    layers = [torch.full((3,), 2.0), torch.full((2,), 4.0)]
    path = tmp_path / "lists.pt"
    torch.save({"grads": {"layers": layers, "head": torch.ones(1)}, "step": 1}, path)
    result = gradclip("clip", path, "--max-norm", "1", "--format", "json")
    assert result.code == 0, result.err
    out = torch.load(path.with_name("lists.clipped.pt"), weights_only=True)
    assert isinstance(out["grads"]["layers"], list) and len(out["grads"]["layers"]) == 2
    after = ref_norm([*out["grads"]["layers"], out["grads"]["head"]], 2)
    assert rel_err(after, expected_after(ref_norm([*layers, torch.ones(1)], 2), 1.0)) <= 1e-6


def test_allow_nonfinite_table_warns_in_a_sentence(gradclip, tmp_path):
    path = nonfinite_file(tmp_path)
    result = gradclip("clip", path, "--clip-value", "1", "--allow-nonfinite")
    assert result.code == 0, result.err
    assert ("warning: gradients holding 1 non-finite value were clipped under "
            "--allow-nonfinite") in " ".join(result.out.split())


@pytest.mark.parametrize(("dtype", "value"), [
    (torch.float32, "1e-50"),  # below half float32's smallest subnormal (1.4e-45)
    (torch.float16, "1e-9"),  # below half float16's (6e-8)
])  # fmt: skip
def test_clip_value_that_rounds_to_zero_in_the_dtype_refuses(gradclip, tmp_path, dtype, value):
    # torch casts the bound to the tensor's dtype: a bound that rounds to 0 there
    # would set every gradient to 0, which clip never does silently.
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.tensor([1.0, -0.5, 1e-3]).to(dtype)}}, path)
    before = sha256(path)
    for extra in ([], ["--format", "json"]):
        result = gradclip("clip", path, "--clip-value", value, *extra)
        assert result.code == 1, result.err
        assert_no_report(result)
        assert str(path) in result.err and "zero" in result.err
        assert "Traceback" not in result.err and len(result.err_lines) <= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.pt"] and sha256(path) == before


def test_clip_value_that_rounds_to_zero_in_one_dtype_only_clamps(gradclip, tmp_path):
    # 1e-50 is 0 in float32 but not in float64: the float64 gradient keeps a value.
    path = tmp_path / "g.pt"
    grads = {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([3.0, -0.0], dtype=torch.float64)}
    torch.save({"grads": grads}, path)
    result = gradclip("clip", path, "--clip-value", "1e-50", "-o", tmp_path / "o.pt")
    assert result.code == 0, result.err
    out = torch.load(tmp_path / "o.pt", weights_only=True)["grads"]
    for name, grad in grads.items():  # torch's clamp, the bound in the tensor's dtype
        assert torch.equal(out[name], grad.clamp(-1e-50, 1e-50))


@pytest.mark.parametrize(("fmt", "shown"), [
    ("github", "bad\\nname.pt"), ("junit", "bad\\nname.pt"),
    ("markdown", "bad\\\\nname.pt"),  # the backslash that shows the newline, escaped
])  # fmt: skip
def test_refusal_shows_a_hostile_name_escaped_once(gradclip, tmp_path, fmt, shown):
    # The refusal's line names the file as every other line does: a newline in the
    # name shown as \n, not as \\n (a backslash the name does not hold).
    path = tmp_path / "bad\nname.pt"
    torch.save({"grads": {"w": torch.tensor([1.0, math.nan])}}, path)
    result = gradclip("clip", path, "--max-norm", "1", "--format", fmt)
    assert result.code == 1
    refusal = [line for line in result.out.splitlines() if "refusing to clip" in line]
    twice = shown.replace("\\", "\\\\")
    assert refusal and all(shown in line and twice not in line for line in refusal)


@pytest.mark.parametrize("fmt", ["table", "markdown", "github", "junit"])
def test_every_report_says_the_coefficient_was_lowered(gradclip, tmp_path, fmt):
    # As test_bf16_clip_keeps_bf16: torch's coefficient, rounded to bf16, leaves the
    # total above 3.3. The contract: the coefficient is lowered, and the report says so.
    g = torch.Generator().manual_seed(11)
    grads = {f"l.{i}.w": torch.randn(200, generator=g).bfloat16() for i in range(3)}
    path = tmp_path / "b.pt"
    torch.save({"grads": grads}, path)
    torch_coef = min(1.0, 3.3 / (ref_norm(grads.values(), 2) + 1e-6))
    result = gradclip("clip", path, "--max-norm", "3.3", "--format", fmt)
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    assert "coefficient lowered from" in text and "(torch's)" in text
    shown = re.search(r"lowered from (\S+) \(torch's\)", text).group(1)
    assert rel_err(float(shown), torch_coef) <= 1e-5  # six digits
