"""``--device cuda``: the same report and the same clipped file as on the CPU.

Skipped where CUDA is absent (the usage error there is tested in test_cli_errors.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from .support import gpt_like_grads, ref_norm, rel_err

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def numbers(doc):
    """Every number of an inspect report that must not depend on the device."""
    keys = ("norm", "max_abs", "nonfinite", "num_tensors", "num_elements")
    return (
        doc["total_norm"], doc["max_abs"], doc["nonfinite"], doc["status"],
        [{k: g[k] for k in keys} | {"name": g["name"]} for g in doc["groups"]],
        [{k: t[k] for k in ("name", "norm", "max_abs", "nonfinite", "dtype")}
         for t in doc["tensors"]],
    )  # fmt: skip


@pytest.mark.parametrize("p", ["0.5", "1", "2", "3", "inf"])
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "auto"])
def test_inspect_cuda_matches_cpu(gradclip, tmp_path, p, device):
    grads = gpt_like_grads(seed=12)
    grads["transformer.h.0.mlp.c_fc.weight"] = grads["transformer.h.0.mlp.c_fc.weight"] * 1e20
    grads["transformer.wpe.weight"] = grads["transformer.wpe.weight"].half()
    grads["transformer.ln_f.weight"] = grads["transformer.ln_f.weight"].bfloat16()
    grads["transformer.h.1.attn.c_attn.bias"][0] = math.nan
    path = tmp_path / "g.pt"
    torch.save({"grads": grads}, path)
    args = ("inspect", path, "--format", "json", "--norm-type", p)
    cpu = gradclip(*args, "--device", "cpu")
    gpu = gradclip(*args, "--device", device)
    assert cpu.code == gpu.code == 1
    a, b = numbers(cpu.json()), numbers(gpu.json())
    assert a[2:4] == b[2:4]  # non-finite counts and status exactly
    for row_a, row_b in zip(a[5], b[5]):
        assert row_a["nonfinite"] == row_b["nonfinite"]
        if isinstance(row_a["norm"], float):
            assert rel_err(row_b["norm"], row_a["norm"]) <= 1e-6, row_a["name"]
            pf = float(p)
            assert rel_err(row_b["norm"], ref_norm([grads[row_a["name"]]], pf)) <= 1e-6
        else:
            assert row_a["norm"] == row_b["norm"]


def test_clip_cuda_matches_cpu(gradclip, tmp_path):
    grads = gpt_like_grads(seed=13)
    path = tmp_path / "g.pt"
    torch.save({"grads": grads, "step": 2}, path)
    cpu = gradclip(
        "clip",
        path,
        "--max-norm",
        "1",
        "-o",
        tmp_path / "cpu.pt",
        "--format",
        "json",
        "--device",
        "cpu",
    )
    gpu = gradclip(
        "clip",
        path,
        "--max-norm",
        "1",
        "-o",
        tmp_path / "gpu.pt",
        "--format",
        "json",
        "--device",
        "cuda",
    )
    assert cpu.code == gpu.code == 0
    assert rel_err(gpu.json()["clip_coef"], cpu.json()["clip_coef"]) <= 1e-6
    a = torch.load(tmp_path / "cpu.pt", weights_only=True)
    b = torch.load(tmp_path / "gpu.pt", weights_only=True)  # written for the CPU, like the input
    assert b["step"] == 2
    for name, grad in a["grads"].items():
        assert b["grads"][name].device.type == "cpu"
        torch.testing.assert_close(b["grads"][name], grad, rtol=1e-6, atol=0)
    total = ref_norm(grads.values(), 2)
    assert rel_err(ref_norm(b["grads"].values(), 2), total * min(1, 1 / (total + 1e-6))) <= 1e-6
