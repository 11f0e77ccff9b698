"""save_grads: what lands in the file, checked by loading it back as a user would."""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from gradclip_cli.errors import OutputError
from gradclip_cli.producer import save_grads


class TiedNet(torch.nn.Module):
    """Embedding and output head sharing one weight, plus a frozen and an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.frozen = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.body(self.embed(idx))))


@pytest.fixture
def model() -> TiedNet:
    net = TiedNet()
    logits = net(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    torch.nn.functional.cross_entropy(logits.reshape(-1, 10), torch.arange(6)).backward()
    return net


EXPECTED_NAMES = ["embed.weight", "body.weight", "body.bias"]


def test_grads_equal_p_grad_and_are_copies(model, tmp_path):
    path = tmp_path / "g.pt"
    save_grads(model, path)
    grads = torch.load(path, weights_only=True)["grads"]
    params = dict(model.named_parameters())
    assert list(grads) == EXPECTED_NAMES
    for name, grad in grads.items():
        assert grad.device.type == "cpu"
        assert torch.equal(grad, params[name].grad)
    # Later changes to the live gradients (zero_grad, clipping) do not reach the file.
    model.zero_grad()
    assert torch.load(path, weights_only=True)["grads"]["body.weight"].abs().sum() > 0


def test_params_without_grad_are_skipped(model, tmp_path):
    save_grads(model, tmp_path / "g.pt")
    grads = torch.load(tmp_path / "g.pt", weights_only=True)["grads"]
    assert model.frozen.weight.grad is None and model.unused.weight.grad is None
    assert not any(name.startswith(("frozen.", "unused.")) for name in grads)


def test_tied_parameter_appears_once_under_first_name(model, tmp_path):
    save_grads(model, tmp_path / "g.pt")
    grads = torch.load(tmp_path / "g.pt", weights_only=True)["grads"]
    assert "embed.weight" in grads
    assert "head.weight" not in grads
    # The one entry holds the summed gradient of both uses.
    assert torch.equal(grads["embed.weight"], model.head.weight.grad)


def test_extra_entries_are_kept(model, tmp_path):
    path = tmp_path / "state.pt"
    config = {"lr": 3e-4, "betas": [0.9, 0.95], "name": "run-7", "warmup": None}
    save_grads(model, path, step=1200, config=config, model=model.state_dict(), path="kept")
    loaded = torch.load(path, weights_only=True)
    assert set(loaded) == {"grads", "gradclip", "step", "config", "model", "path"}
    assert loaded["gradclip"] == "gradients"  # gradclip's mark: the evidence of the role
    assert loaded["step"] == 1200
    assert loaded["config"] == config
    assert loaded["path"] == "kept"
    assert torch.equal(loaded["model"]["body.weight"], model.body.weight)


def test_extra_named_grads_is_refused(model, tmp_path):
    with pytest.raises(ValueError, match="'grads'"):
        save_grads(model, tmp_path / "g.pt", grads={})
    assert list(tmp_path.iterdir()) == []


def test_model_without_any_grad_is_refused(tmp_path):
    with pytest.raises(ValueError, match="backward"):
        save_grads(torch.nn.Linear(2, 2), tmp_path / "g.pt")
    assert list(tmp_path.iterdir()) == []


def test_safetensors_holds_grads_and_metadata(model, tmp_path):
    path = tmp_path / "g.safetensors"
    save_grads(model, path, step="1200", run="demo")
    loaded = load_file(path)
    params = dict(model.named_parameters())
    assert sorted(loaded) == sorted(EXPECTED_NAMES)
    for name, grad in loaded.items():
        assert torch.equal(grad, params[name].grad)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"gradclip": "gradients", "step": "1200", "run": "demo"}


def test_safetensors_mixed_dtypes_are_aligned(tmp_path):
    # Readers that map the file and view each tensor in place (no copy) need
    # every tensor to start at a multiple of its element size, as the
    # safetensors writer itself guarantees.
    model = torch.nn.ModuleDict(
        {
            "f16": torch.nn.Linear(1, 3).half(),  # 12 bytes: would misalign what follows
            "f64": torch.nn.Linear(3, 1).double(),
            "bf16": torch.nn.Linear(1, 3).bfloat16(),
        }
    )
    for p in model.parameters():
        p.grad = torch.randn(p.shape).to(p.dtype)
    path = tmp_path / "mixed.safetensors"
    save_grads(model, path)

    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    assert header.pop("__metadata__") == {"gradclip": "gradients"}  # gradclip's mark
    widths = {"F16": 2, "BF16": 2, "F64": 8}
    for name, entry in header.items():
        assert (8 + header_len + entry["data_offsets"][0]) % widths[entry["dtype"]] == 0, name
    with safe_open(path, framework="pt") as f:
        for name, p in model.named_parameters():
            grad = f.get_tensor(name)
            assert grad.dtype == p.dtype
            assert torch.equal(grad, p.grad)


def test_safetensors_refuses_non_text_extra(model, tmp_path):
    with pytest.raises(ValueError, match=r"step \(int\)"):
        save_grads(model, tmp_path / "g.safetensors", step=3, run="ok")
    assert list(tmp_path.iterdir()) == []


def test_file_loads_with_weights_only(model, tmp_path):
    path = tmp_path / "g.pt"
    save_grads(model, path, step=torch.tensor(5), note="text")
    loaded = torch.load(path, weights_only=True)
    assert loaded["note"] == "text"
    assert torch.equal(loaded["step"], torch.tensor(5))


def test_overwrite_is_atomic_and_leaves_no_temp_file(model, tmp_path):
    path = tmp_path / "g.pt"
    save_grads(model, path, step=1)
    save_grads(model, path, step=2)
    assert torch.load(path, weights_only=True)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["g.pt"]


def test_failed_write_keeps_old_file(model, tmp_path):
    path = tmp_path / "g.pt"
    save_grads(model, path, step=1)
    before = path.read_bytes()
    with pytest.raises(OutputError, match="nothing was changed"):
        save_grads(model, path, step=2, hook=lambda: None)  # a lambda cannot be pickled
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["g.pt"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_new_file_gets_umask_permissions(model, tmp_path):
    umask = os.umask(0o022)
    try:
        save_grads(model, tmp_path / "g.pt")
    finally:
        os.umask(umask)
    assert (tmp_path / "g.pt").stat().st_mode & 0o777 == 0o644
