"""Lightning's sharded checkpoint folder: DCP files plus ``meta.pt``, from a real 2-process run.

The folder is written by ``Trainer.save_checkpoint`` under
``ModelParallelStrategy`` (FSDP2 on two CPU processes). References never go
through gradclip: torch's own ``dcp_to_torch_save`` reassembles the full
tensors, and the moments are bias-corrected here in float64.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.support import load_dcp, rel_err, unwrapped

TOL = 1e-6  # the contract's accuracy; the references are float64


@pytest.fixture(scope="module")
def reference(lightning_sharded, tmp_path_factory) -> dict:
    return load_dcp(lightning_sharded, tmp_path_factory.mktemp("lightning_sharded_ref") / "full.pt")


def _expected(reference: dict, what: str) -> dict[str, torch.Tensor]:
    weights = {k: v.double() for k, v in reference["state_dict"].items()}
    if what == "weights":
        return weights
    optimizer = reference["optimizer_0"]
    (group,) = optimizer["param_groups"]
    beta1, beta2 = group["betas"]
    out = {}
    for name, state in optimizer["state"].items():
        step = float(state["step"])
        m = state["exp_avg"].double() / (1 - beta1**step)
        v = (state["exp_avg_sq"].double() / (1 - beta2**step)).sqrt()
        out[name] = {"exp_avg": m, "grad_rms": v,
                     "update": group["lr"] * m / (v + group["eps"])}[what]
    return out


def _norm(tensors) -> float:
    return float(torch.cat([t.reshape(-1) for t in tensors]).norm())


@pytest.mark.parametrize("what", ["exp_avg", "grad_rms", "update", "weights"])
def test_every_number_against_torch_reassembled(gradclip, lightning_sharded, reference, what):
    expected = _expected(reference, what)
    assert len(expected) == 6
    result = gradclip("inspect", lightning_sharded, "--what", what, "--group-by", "tensor",
                      "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["what"], doc["step"]) == ("lightning", what, 3)
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    weights = _expected(reference, "weights")
    for name, tensor in expected.items():
        assert rel_err(rows[name]["norm"], _norm([tensor])) <= TOL, name
        assert rel_err(rows[name]["max_abs"], float(tensor.abs().max())) <= TOL, name
        if what != "weights":
            ratio = _norm([tensor]) / _norm([weights[name]])
            assert rel_err(rows[name]["ratio"], ratio) <= TOL, name


def test_auto_is_exp_avg_and_the_header_names_lightning(gradclip, lightning_sharded):
    result = gradclip("inspect", lightning_sharded, "--no-progress")
    assert result.code == 0, result.err
    shown = unwrapped(result.out)
    assert "Lightning sharded checkpoint (Lightning " in shown
    assert "what: exp_avg" in shown
    grads = gradclip("inspect", lightning_sharded, "--what", "grads")
    assert grads.code == 3 and "meta.pt" not in grads.err and "optimizer" in grads.err


def test_clip_offers_no_key_and_refuses_the_model_and_the_optimizer(gradclip, lightning_sharded,
                                                                    tmp_path):
    """The folder's entries are the model and the optimizer: clip's refusal offers no --key
    (clip never offers weights or optimizer state), and a key naming either is refused."""
    out = tmp_path / "clipped"
    result = gradclip("clip", lightning_sharded, "--max-norm", "1", "-o", out)
    assert result.code == 3 and "--key" not in result.err
    for key in ("state_dict", "optimizer_0"):
        keyed = gradclip("clip", lightning_sharded, "--key", key, "--max-norm", "1", "-o", out)
        assert keyed.code == 3 and "not gradients" in keyed.err, keyed.err
    assert not out.exists()


def _copy(lightning_sharded: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "last.ckpt"
    shutil.copytree(lightning_sharded, folder)
    return folder


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_meta_with_a_code_payload_is_refused_and_runs_nothing(gradclip, lightning_sharded,
                                                              tmp_path):
    folder = _copy(lightning_sharded, tmp_path)
    marker = tmp_path / "ran"
    meta = torch.load(folder / "meta.pt", weights_only=True)
    meta["callbacks"] = _Payload(marker)
    torch.save(meta, folder / "meta.pt")
    result = gradclip("inspect", folder)
    assert result.code == 3 and not marker.exists()
    assert result.err.count("\n") == 1 and f"{folder / 'meta.pt'}: refused" in result.err


@pytest.mark.parametrize("content", [{"global_step": "3"}, [1, 2], "not a dict"])
def test_meta_that_is_not_what_it_claims(gradclip, lightning_sharded, tmp_path, content):
    folder = _copy(lightning_sharded, tmp_path)
    torch.save(content, folder / "meta.pt")
    result = gradclip("inspect", folder, "--format", "json")
    assert result.code == 3
    doc = result.json()
    assert doc["schema"] == "gradclip.error/1" and str(folder / "meta.pt") in doc["error"]


def test_meta_that_is_no_torch_file(gradclip, lightning_sharded, tmp_path):
    folder = _copy(lightning_sharded, tmp_path)
    (folder / "meta.pt").write_bytes(pickle.dumps({"global_step": 3}) [:7])
    result = gradclip("inspect", folder)
    assert result.code == 3 and str(folder / "meta.pt") in result.err
