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


def load(path: Path):
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("samples")
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def healthy() -> dict[str, torch.Tensor]:
    return load(SAMPLES / "healthy.pt")["grads"]


def assert_same(a, b, where: str = "") -> None:
    """Same structure, same plain values, bit-identical tensors.

    Bits rather than torch.equal alone, because torch.equal(nan, nan) is False.
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


@pytest.mark.parametrize("name", FILES)
def test_regenerating_gives_identical_tensors(regenerated, name):
    assert_same(load(SAMPLES / name), load(regenerated / name), name)


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
    nan_tensor = grads["transformer.h.0.mlp.c_fc.weight"]
    inf_tensor = grads["transformer.h.1.attn.c_proj.weight"]
    assert nan_tensor.isnan().sum() == 3 and not nan_tensor.isinf().any()
    assert (inf_tensor == math.inf).sum() == 1
    assert (inf_tensor == -math.inf).sum() == 1
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
