"""DeepSpeed pipeline parallelism (``deepspeed.pipe.PipelineModule``), written by
DeepSpeed's own 2-rank CPU training (``deepspeed_runs.py``): two stages under ZeRO 1,
checked against the plain ``torch.optim.AdamW`` run beside it, and one stage without ZeRO,
refused.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.distributed.launch import same_under_torchrun
from tests.hardening.support import assert_refused, run_cli
from tests.layouts.test_deepspeed import RTOL, _expected, _inspect, _rewrite
from tests.layouts.test_deepspeed_zero0 import TAG, WHATS


@pytest.mark.parametrize("what", WHATS)
def test_pipeline_stages_match_a_plain_adamw_run(deepspeed_runs, what):
    """Two PipelineModule stages under ZeRO 1: each mp_rank_XX file a stage of its own
    parameters, read side by side (never as tensor-parallel shards)."""
    run = deepspeed_runs / "pipe2_zero1"
    reference = torch.load(deepspeed_runs / "pipe2_zero1.reference.pt")
    expected = _expected(reference, what)
    for path in (run, run / TAG):
        doc = _inspect(path, what)
        tensors = {t["name"]: t for t in doc["tensors"]}
        assert list(tensors) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        for name, value in expected.items():
            assert tensors[name]["norm"] == pytest.approx(value.norm().item(), rel=RTOL), name
        total = torch.cat([v.flatten() for v in expected.values()]).norm().item()
        assert doc["total_norm"] == pytest.approx(total, rel=RTOL)
    table = run_cli("inspect", run, "--no-progress", "--top", "0")
    text = " ".join(table.out.split())
    assert "2 pipeline stages (mp_rank_00, mp_rank_01) x 1 data-parallel rank(s)" in text
    assert "layer_XX-model_states.pt files are not read" in text


def test_pipeline_stages_under_torchrun(deepspeed_runs, tmp_path):
    jobs = [{"args": ["inspect", str(deepspeed_runs / "pipe2_zero1"), "--what", what,
                      "--format", "json", "--no-progress"]} for what in ("auto", "weights")]
    same_under_torchrun(jobs, tmp_path)


def test_a_layer_on_two_stages_is_refused(deepspeed_runs, tmp_path):
    """A layer tied across stages (both keep a copy): refused, not counted twice."""
    target = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "pipe2_zero1", target)
    file = target / TAG / "mp_rank_01_model_states.pt"

    def edit(root):
        shapes = root["param_shapes"][0]
        root["param_shapes"][0] = type(shapes)(
            ("0.bias" if n == "2.bias" else n, s) for n, s in shapes.items())
    _rewrite(file, edit)
    assert_refused(run_cli("inspect", target), file, "holds 0.bias", "tied across pipeline stages")


def test_a_pipeline_without_zero_is_refused(deepspeed_runs):
    """Without ZeRO a PipelineModule's weights are in its layer files alone: refused in one
    line saying so, not the list of every kind a folder could be."""
    run = deepspeed_runs / "pipe1_zero0"
    for path in (run, run / TAG):
        result = run_cli("inspect", path, "--no-progress")
        assert_refused(result, run / TAG, "pipeline-parallel checkpoint without ZeRO",
                       "layer_00-model_states.pt", "does not read DeepSpeed pipeline")
