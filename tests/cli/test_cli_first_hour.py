"""Small things a user met in the first hour (issue 20, item 6), each as the user saw it."""

from __future__ import annotations

import math

import pytest
import torch

from tests.format.test_ci_formats import parse_workflow_command

from .test_cli_trend import checkpointed_run, trainer_state  # noqa: F401 (fixtures)


def run_folder(tmp_path, steps=12, spike=None, nan=None):
    """``steps`` checkpoints of two layers whose norms barely move (no rule flags them);
    ``spike``/``nan``: the step that has one."""
    folder = tmp_path / "run"
    folder.mkdir()
    for step in range(steps):
        grads = {f"layer.{i}.w": torch.ones(16) * (1 + 0.01 * (step % 3)) for i in range(2)}
        if step == spike:
            grads["layer.1.w"] *= 1000
        if step == nan:
            grads["layer.0.w"][3] = math.nan
        torch.save({"grads": grads, "step": step}, folder / f"ckpt-{step}.pt")
    return folder


def test_the_trend_verdict_names_an_earlier_nonfinite_step(gradclip, tmp_path):
    folder = run_folder(tmp_path, nan=8, spike=10)
    r = gradclip("trend", folder, "--no-progress")
    assert r.code == 0, r.err  # the newest point is healthy
    verdict = r.out.splitlines()[-1]
    assert verdict.startswith("OK: no spike or non-finite gradient norm at the newest point")
    assert "earlier: 1 non-finite (step 8), 1 spike(s) (step 10)" in verdict
    failing = gradclip("trend", folder, "--fail-on", "any", "--no-progress")
    assert failing.code == 1 and "at 2 point(s)" in failing.out.splitlines()[-1]


def test_the_plot_title_gives_the_verdict_its_scope(gradclip, tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    folder = run_folder(tmp_path, spike=9)
    svg = tmp_path / "norms.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text in the SVG
        r = gradclip("trend", folder, "--plot", svg, "--no-progress")
    assert r.code == 0, r.err
    text = svg.read_text()
    assert "gradclip trend: 12 points, 1 spike(s); verdict (newest point): ok" in text
    assert "status ok" not in text


def test_github_names_the_tensor_of_a_nonfinite_finding(gradclip, tmp_path):
    path = tmp_path / "g.pt"
    grads = {"transformer.h.0.attn.weight": torch.ones(4),
             "transformer.h.0.mlp.weight": torch.tensor([1.0, math.inf])}
    torch.save({"grads": grads}, path)
    r = gradclip("inspect", path, "--format", "github")
    assert r.code == 1
    ((name, _, data),) = [parse_workflow_command(line) for line in r.out.splitlines()]
    assert name == "error"
    assert data == "tensor transformer.h.0.mlp.weight (group transformer.h.0): 0 NaN, 1 +inf, " \
                   "0 -inf"
    quiet = gradclip("inspect", path, "-q")  # the table's -q names the same tensor
    assert "transformer.h.0.mlp.weight" in quiet.err


@pytest.mark.parametrize("command", ["trend", "compare"])
def test_quiet_prints_the_verdict_alone(gradclip, tmp_path, command):
    folder = run_folder(tmp_path, spike=11)
    args = [folder] if command == "trend" else [folder / "ckpt-10.pt", folder / "ckpt-11.pt",
                                                "--fail-above", "10"]
    full = gradclip(command, *args)
    quiet = gradclip(command, *args, "-q")
    assert quiet.code == full.code == 1
    assert quiet.out.splitlines() == [full.out.splitlines()[-1]]  # the verdict, one line
    assert quiet.err_lines and all(line.startswith("gradclip: ") for line in quiet.err_lines)
    assert any("layer.1" in line for line in quiet.err_lines)


@pytest.mark.parametrize("command", ["trend", "compare"])
def test_no_progress_is_taken(gradclip, tmp_path, command):
    folder = run_folder(tmp_path)
    args = [folder] if command == "trend" else [folder / "ckpt-0.pt", folder / "ckpt-1.pt"]
    r = gradclip(command, *args, "--no-progress")
    assert r.code == 0 and r.err == ""


def test_inspect_points_an_output_dir_and_its_trainer_state_to_trend(
        gradclip, checkpointed_run, trainer_state):  # noqa: F811
    r = gradclip("inspect", trainer_state)
    assert r.code == 3 and len(r.err_lines) == 1, r.err
    assert r.err_lines[0].endswith(f"for norms over the run use 'gradclip trend {trainer_state}'")
    # The output_dir: what it is, trend, and the newest checkpoint-N to inspect; not the
    # twelve layouts it is not.
    run = checkpointed_run
    r = gradclip("inspect", run.output_dir)
    assert r.code == 3 and len(r.err_lines) == 1, r.err
    newest = run.output_dir / f"checkpoint-{run.steps}"
    assert r.err_lines[0] == (
        f"gradclip: {run.output_dir}: a run's folder of {run.steps} numbered checkpoints "
        f"(checkpoint-1 .. checkpoint-{run.steps}), not one checkpoint: for norms over the run "
        f"use 'gradclip trend {run.output_dir}'; to inspect the newest, "
        f"'gradclip inspect {newest}'")
    assert "DeepSpeed" not in r.err and len(r.err_lines[0]) < 300 + 2 * len(str(newest))
    assert gradclip("inspect", newest).code == 0  # the line's own advice works
    assert gradclip("trend", run.output_dir).code in (0, 1)


def test_inspect_of_a_folder_of_per_step_files_points_to_trend_and_the_newest(gradclip,
                                                                              tmp_path):
    folder = run_folder(tmp_path)
    names = sorted((p.name for p in folder.iterdir()), key=lambda n: int(n[5:-3]))
    for fmt in ("table", "json"):
        r = gradclip("inspect", folder, "--format", fmt)
        assert r.code == 3 and len(r.err_lines) == 1, r.err
        line = r.err_lines[0]
        assert line == (
            f"gradclip: {folder}: a run's folder of {len(names)} per-step checkpoint files "
            f"({names[0]} .. {names[-1]}), not one checkpoint: for norms over the run use "
            f"'gradclip trend {folder}'; to inspect the newest, "
            f"'gradclip inspect {folder / names[-1]}'")
        if fmt == "json":
            assert r.json()["error"] == line.removeprefix("gradclip: ")


def test_inspect_points_a_monitor_log_to_trend(gradclip, tmp_path):
    from gradclip_cli import GradMonitor

    model = torch.nn.Linear(3, 2)
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log, None) as monitor:
        for step in range(3):
            model.zero_grad()
            model(torch.ones(1, 3) * step).sum().backward()
            monitor.step(step)
    for path in (log, tmp_path):
        r = gradclip("inspect", path)
        assert r.code == 3 and len(r.err_lines) == 1, r.err
        assert r.err_lines[0].endswith(f"for norms over the run use 'gradclip trend {path}'")


def test_a_plain_unreadable_file_gets_no_trend_hint(gradclip, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a checkpoint")
    r = gradclip("inspect", path)
    assert r.code == 3 and "gradclip trend" not in r.err


def test_inspect_of_the_samples_folder_does_not_call_it_a_run(gradclip):
    # The folder a newcomer tries first: seven unrelated checkpoints, one of them with a
    # number in its name (bf16.pt). It is no run of per-step files, bf16.pt no newest
    # step, and trend of it refuses (two files at step 100): inspect says what it is.
    from tests.test_readme import REPO

    folder = REPO / "sample_checkpoints"
    r = gradclip("inspect", folder)
    assert r.code == 3 and len(r.err_lines) == 1, r.err
    assert "a run's folder" not in r.err and "newest" not in r.err, r.err
    assert "not a checkpoint gradclip knows" in r.err


def test_a_run_of_one_per_step_file_is_named_in_the_singular(gradclip, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save({"grads": {"w": torch.ones(3)}}, folder / "step_5.pt")
    r = gradclip("inspect", folder)
    assert r.code == 3 and len(r.err_lines) == 1, r.err
    assert r.err_lines[0] == (
        f"gradclip: {folder}: a run's folder of 1 per-step checkpoint file (step_5.pt), not "
        f"one checkpoint: for norms over the run use 'gradclip trend {folder}'; to inspect "
        f"the newest, 'gradclip inspect {folder / 'step_5.pt'}'")
    assert gradclip("inspect", folder / "step_5.pt").code == 0
