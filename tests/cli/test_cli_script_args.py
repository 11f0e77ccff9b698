"""A training script's ``args`` (an ``argparse.Namespace``) saved beside its state: read as
inert data, without --trust-pickle; what the Namespace holds still goes through the
restricted reader, so a payload inside it is refused before it runs."""

from __future__ import annotations

import argparse
import math
import os

import torch

from tests.cli.support import rel_err


def _run(tmp_path):
    """Three AdamW steps of a small model, saved as scripts do: state, optimizer and args."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    args = argparse.Namespace(model="mlp", lr=1e-2, layers=[3, 4, 2], sched=None, amp=False)
    path = tmp_path / "checkpoint-3.pth.tar"
    torch.save({"epoch": 0, "state_dict": model.state_dict(), "optimizer": opt.state_dict(),
                "args": args}, path)
    return path, opt.state_dict()


def test_args_namespace_is_read_without_trust_pickle(gradclip, tmp_path):
    path, state = _run(tmp_path)
    b1 = state["param_groups"][0]["betas"][0]
    expected = math.sqrt(sum(
        (s["exp_avg"].double() / (1 - b1 ** float(s["step"]))).square().sum().item()
        for s in state["state"].values()))
    result = gradclip("inspect", path, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == "exp_avg"
    assert rel_err(doc["total_norm"], expected) <= 1e-6
    assert gradclip("inspect", path, "--trust-pickle", "--format",
                    "json").json()["total_norm"] == doc["total_norm"]


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_payload_inside_args_is_refused_before_it_runs(gradclip, tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "checkpoint.pt"
    torch.save({"state_dict": {"w": torch.ones(3)},
                "args": argparse.Namespace(lr=1.0, hook=_Payload(marker))}, path)
    result = gradclip("inspect", path)
    assert result.code == 3
    assert len(result.err_lines) == 1
    assert str(path) in result.err and "--trust-pickle" in result.err
    assert "mkdir" in result.err
    assert not marker.exists()
