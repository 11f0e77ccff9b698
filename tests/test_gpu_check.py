"""benchmarks/gpu_check.py's CPU-side logic (no GPU here): it skips cleanly without CUDA,
and its training-loop table, goals and inspect timing work, run on the CPU on small shapes."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check, gpu_issue42
from benchmarks.inputs import llama2_7b_shapes, numel
from gradclip_cli import save_grads


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_skips_cleanly_without_cuda(capsys):
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out.strip() == "no CUDA device: nothing to check"


def test_llama2_7b_shapes():
    shapes = llama2_7b_shapes()
    assert len(shapes) == 291
    assert numel(shapes) == 6_738_415_616  # Llama-2-7B's published parameter count


def test_training_loop_table_on_cpu(capsys):
    shapes = [("a", (64, 32)), ("b", (32,)), ("c", (5, 7, 3))]
    rows = gpu_check.training_loop(shapes, torch.bfloat16, device="cpu", reps=1)
    names = [r["name"] for r in rows]
    assert names[:2] == ["torch get_total_norm", "torch clip_grad_norm_"]
    assert "GradMonitor.clip_grad_norm_ (logged)" in names
    for r in rows:
        assert r["ms"] > 0
        if r["name"].startswith(("gradclip get_total_norm", "gradclip clip_grad_norm_",
                                 "GradMonitor")):
            assert r["error"] is not None and r["error"] <= 1e-6, r
    assert [r["vs_torch_clip"] for r in rows if r["name"] == "torch clip_grad_norm_"] == [1.0]
    lines = gpu_check.goals(rows)
    assert lines[0].startswith("total norm ") and "goal <= 3.7 ms" in lines[0]
    assert lines[1].startswith("logged monitor step ") and "goal <= 2x" in lines[1]
    gpu_check.print_training_loop(rows)
    out = capsys.readouterr().out
    assert out.count("\n| ") == len(rows) + 2  # header, rule, one line a call


def test_inspect_timing_runs_the_cli(tmp_path):
    model = torch.nn.Linear(8, 4)
    model(torch.randn(2, 8)).sum().backward()
    path = tmp_path / "grads.pt"
    save_grads(model, path)
    assert gpu_check.inspect_ms(path, device="cpu", reps=1) > 0
    with pytest.raises(RuntimeError, match="inspect failed"):
        gpu_check.inspect_ms(tmp_path / "missing.pt", device="cpu", reps=1)


def test_issue42_section_on_cpu():
    # The section's logic on the CPU, on small shapes: every table and every goal line.
    big = [("a", (64, 32)), ("b", (33,)), ("c", (5, 7, 3))]
    small = [("x", (16, 8)), ("y", (9,))]
    text, worst = gpu_issue42.run(big, small, device="cpu", reps=1)
    assert worst <= 1e-6
    for heading in ("| total norm |", "| clipping call (bf16) |", "| accuracy: dtype |",
                    "CLI core (tensor_power_sums, with max), 7B bf16",
                    "DTensor local sum, GPT-2 bf16"):
        assert heading in text, heading
    goals = [line for line in text.splitlines() if "(goal" in line]
    assert len(goals) == 2 + 4 + 2 + 1
    assert "- bf16 scaling bit for bit torch's: yes" in text
    assert "- Triton pass: not used (not CUDA)" in text
    assert text.count("sync-free") >= 4  # every call named, nothing to catch on the CPU
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len([r for r in rows if r.startswith(("| float", "| bfloat"))]) == 4 * 3 * 4
