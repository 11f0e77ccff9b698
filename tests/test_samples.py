"""The committed sample checkpoints: reproducible, small, and showing what README.md says."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"
SCRIPT = SAMPLES / "make_samples.py"
FILES = [
    "healthy.pt",
    "exploding.pt",
    "nonfinite.pt",
    "bf16.pt",
    "training_state.pt",
    "healthy.safetensors",
    "flat_legacy.pt",
]
EXPLODING_PREFIX = "transformer.h.1."
NAN_TENSOR = "transformer.h.0.mlp.c_fc.weight"
INF_TENSOR = "transformer.h.1.attn.c_proj.weight"


def load(path: Path):
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("samples")
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, timeout=900)
    return out


@pytest.fixture(scope="module")
def healthy() -> dict[str, torch.Tensor]:
    return load(SAMPLES / "healthy.pt")["grads"]


def assert_same(a, b, where: str = "") -> None:
    """Same structure, same plain values, bit-identical tensors.

    Bits rather than torch.equal alone, because torch.equal(nan, nan) is False.
    For files read back from the same bytes: use `assert_matches_script` to
    compare with a regeneration, which may run on another CPU.
    """
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        a_bits = a.contiguous().reshape(-1).view(torch.uint8)
        b_bits = b.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a_bits, b_bits), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# Why regenerated values may differ from the committed ones, and by how much.
#
# make_samples.py runs in float64 and rounds once to the stored dtype. Two
# CPUs (another SIMD width, another BLAS kernel, FMA or not, another thread
# count) sum the float64 terms in another order, so their float64 results
# differ by accumulated float64 rounding: at most about n * 2**-53 times the
# sum of the terms' magnitudes, for n terms per sum (n <= a few thousand
# here). The terms are of the size of the tensor's largest entries, so the
# difference is below 2**-32 * max|tensor| with a margin of thousands. Where
# the exact value is zero (the key bias of attention: softmax ignores a shift
# shared by every key) that is all that remains: values near 1e-18 that differ
# from CPU to CPU. Rounding to the stored dtype then moves the result by
# at most one unit in the last place, eps(dtype) * |x| (half of it each side,
# which may fall on either side of a rounding boundary).
#
# So an element passes when |a - b| <= eps(dtype) * max(|a|, |b|) + 2**-32 *
# max|tensor|. That is far below what a change in the script produces: the
# absolute term is 1/256 of one float32 unit at the tensor's scale, and a
# changed seed, shape, learning rate or formula moves values by whole percents.
FLOAT64_ACCUMULATION = 2.0**-32


def assert_matches_script(committed, regenerated, where: str = "") -> None:
    """`regenerated` is what make_samples.py writes for `committed`, on any CPU.

    Structure, names, plain values, dtypes, shapes and integer tensors are
    exact; the positions and signs of non-finite values are exact; finite
    floating values agree within the float rounding bound explained above.
    """
    assert type(committed) is type(regenerated), where
    if isinstance(committed, torch.Tensor):
        assert (committed.dtype, committed.shape) == (regenerated.dtype, regenerated.shape), where
        if not committed.is_floating_point():
            assert torch.equal(committed, regenerated), where
            return
        a, b = committed.double(), regenerated.double()
        assert torch.equal(a.isnan(), b.isnan()), f"{where}: NaN positions differ"
        infinite = a.isinf() | b.isinf()
        assert torch.equal(a[infinite], b[infinite]), f"{where}: infinities differ"
        finite = a.isfinite() & b.isfinite()
        a, b = a[finite], b[finite]
        if a.numel() == 0:
            return
        eps = torch.finfo(committed.dtype).eps
        bound = eps * torch.maximum(a.abs(), b.abs()) + FLOAT64_ACCUMULATION * a.abs().max()
        excess = ((a - b).abs() - bound).max().item()
        assert excess <= 0, f"{where}: values differ beyond float rounding"
    elif isinstance(committed, dict):
        assert list(committed) == list(regenerated), where
        for key in committed:
            assert_matches_script(committed[key], regenerated[key], f"{where}.{key}")
    elif isinstance(committed, (list, tuple)):
        assert len(committed) == len(regenerated), where
        for i, (x, y) in enumerate(zip(committed, regenerated, strict=True)):
            assert_matches_script(x, y, f"{where}[{i}]")
    else:
        assert committed == regenerated, where


@pytest.mark.parametrize("name", FILES)
def test_regenerating_matches_the_committed_files(regenerated, name):
    assert_matches_script(load(SAMPLES / name), load(regenerated / name), name)


def perturbed(tree, scale: float):
    """`tree` with each floating tensor (2+ elements) shifted by `scale` of its largest value."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and tree.numel() > 1:
            return tree + (tree.double().abs().max() * scale).to(tree.dtype)
        return tree
    if isinstance(tree, dict):
        return {key: perturbed(value, scale) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(perturbed(value, scale) for value in tree)
    return tree


def test_the_comparison_catches_a_sample_that_no_longer_matches(healthy):
    """The tolerance lets float rounding pass and nothing a script change would do."""
    assert_matches_script(healthy, perturbed(healthy, 0.0))
    # A change of 1e-6 of a tensor's scale (a few float32 units) is caught...
    with pytest.raises(AssertionError, match="beyond float rounding"):
        assert_matches_script(healthy, perturbed(healthy, 1e-6))
    # ...as are a renamed tensor, a changed dtype, a moved NaN, a changed plain value.
    renamed = {("x" + name if i == 0 else name): g for i, (name, g) in enumerate(healthy.items())}
    with pytest.raises(AssertionError):
        assert_matches_script(healthy, renamed)
    with pytest.raises(AssertionError):
        assert_matches_script(healthy, {n: g.double() for n, g in healthy.items()})
    nonfinite = load(SAMPLES / "nonfinite.pt")
    moved = dict(nonfinite["grads"])
    weight = moved[NAN_TENSOR].clone()
    weight.view(-1)[[3, 4]] = weight.view(-1)[[4, 3]]
    moved[NAN_TENSOR] = weight
    with pytest.raises(AssertionError, match="NaN positions"):
        assert_matches_script(nonfinite["grads"], moved)
    with pytest.raises(AssertionError):
        assert_matches_script(nonfinite, {**nonfinite, "step": 101})
    # A one-unit rounding flip, and float64 noise on a value that is exactly zero, pass.
    flipped = dict(healthy)
    flipped[NAN_TENSOR] = torch.nextafter(healthy[NAN_TENSOR], torch.tensor(math.inf))
    bias = healthy["transformer.h.0.attn.c_attn.bias"].clone()
    bias[16:32] = 1e-18  # the key part, zero in exact arithmetic
    flipped["transformer.h.0.attn.c_attn.bias"] = bias
    assert_matches_script(healthy, flipped)


def test_regenerating_writes_exactly_the_committed_files(regenerated):
    assert sorted(p.name for p in regenerated.iterdir()) == sorted(FILES)
    assert sorted(p.name for p in SAMPLES.iterdir() if p.suffix != ".md" and p != SCRIPT) == sorted(
        FILES
    )


def test_total_size_stays_small():
    assert sum((SAMPLES / name).stat().st_size for name in FILES) < 500_000


def test_healthy_has_real_names_and_finite_float32(healthy):
    loaded = load(SAMPLES / "healthy.pt")
    assert set(loaded) == {"grads", "step"}
    assert isinstance(loaded["step"], int)
    for name in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.mlp.c_fc.bias",
        "transformer.ln_f.weight",
    ]:
        assert name in healthy
    # lm_head.weight is tied to wte: saved once, under the first name.
    assert "lm_head.weight" not in healthy
    for grad in healthy.values():
        assert grad.dtype == torch.float32
        assert torch.isfinite(grad).all()
        assert grad.abs().sum() > 0


def group_norm(grads: dict[str, torch.Tensor], prefix: str, inside: bool = True) -> float:
    parts = [g.double().reshape(-1) for n, g in grads.items() if n.startswith(prefix) == inside]
    return torch.cat(parts).norm().item()


def test_exploding_scales_one_layer_by_1e4(healthy):
    exploding = load(SAMPLES / "exploding.pt")["grads"]
    assert list(exploding) == list(healthy)
    ratio = group_norm(exploding, EXPLODING_PREFIX) / group_norm(healthy, EXPLODING_PREFIX)
    assert ratio == pytest.approx(1e4, rel=1e-6)
    for name, grad in exploding.items():
        if not name.startswith(EXPLODING_PREFIX):
            assert torch.equal(grad, healthy[name]), name
    # The README's `--max-norm 100` flags the exploding file and not the healthy one.
    assert group_norm(exploding, "") > 100 > group_norm(healthy, "")


def test_nonfinite_has_nan_and_both_infinities(healthy):
    grads = load(SAMPLES / "nonfinite.pt")["grads"]
    assert list(grads) == list(healthy)
    nan_tensor = grads[NAN_TENSOR]
    inf_tensor = grads[INF_TENSOR]
    assert nan_tensor.isnan().reshape(-1).nonzero().reshape(-1).tolist() == [3, 17, 42]
    assert not nan_tensor.isinf().any()
    assert (inf_tensor.reshape(-1) == math.inf).nonzero().reshape(-1).tolist() == [5]
    assert (inf_tensor.reshape(-1) == -math.inf).nonzero().reshape(-1).tolist() == [11]
    assert not inf_tensor.isnan().any()
    for name, grad in grads.items():
        if grad is not nan_tensor and grad is not inf_tensor:
            assert torch.equal(grad, healthy[name]), name
    # Elsewhere in the two poisoned tensors, the healthy values are untouched.
    for name, grad in [
        ("transformer.h.0.mlp.c_fc.weight", nan_tensor),
        ("transformer.h.1.attn.c_proj.weight", inf_tensor),
    ]:
        finite = grad.isfinite()
        assert torch.equal(grad[finite], healthy[name][finite]), name


def test_bf16_is_healthy_cast(healthy):
    loaded = load(SAMPLES / "bf16.pt")
    assert set(loaded) == {"grads", "step"}
    assert list(loaded["grads"]) == list(healthy)
    for name, grad in loaded["grads"].items():
        assert grad.dtype == torch.bfloat16
        assert torch.equal(grad, healthy[name].to(torch.bfloat16)), name


def test_training_state_nesting(healthy):
    state = load(SAMPLES / "training_state.pt")
    assert set(state) == {"model", "optimizer", "grads", "step", "config"}
    assert state["step"] == 1
    assert_same(state["grads"], healthy, "grads")

    model = state["model"]
    assert "lm_head.weight" in model and "transformer.wte.weight" in model
    assert model["lm_head.weight"].untyped_storage().data_ptr() == (
        model["transformer.wte.weight"].untyped_storage().data_ptr()
    )
    assert set(healthy) <= set(model)

    optimizer = state["optimizer"]
    assert set(optimizer) == {"state", "param_groups"}
    assert len(optimizer["state"]) == len(healthy)
    for entry in optimizer["state"].values():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        assert entry["step"].item() == 1
    assert optimizer["param_groups"][0]["weight_decay"] > 0

    # Plain Python values only: round-trips through JSON.
    assert json.loads(json.dumps(state["config"])) == state["config"]


def test_safetensors_is_healthy_with_metadata(healthy):
    path = SAMPLES / "healthy.safetensors"
    assert_same(dict(sorted(load(path).items())), dict(sorted(healthy.items())))
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    assert metadata["step"] == "100"
    assert "producer" in metadata


def test_legacy_file_is_flat_and_not_zip(healthy):
    path = SAMPLES / "flat_legacy.pt"
    assert not zipfile.is_zipfile(path)
    assert zipfile.is_zipfile(SAMPLES / "healthy.pt")
    assert_same(load(path), healthy)
