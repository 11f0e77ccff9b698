"""GradMonitor records its own clipping, and ``trend`` says who clipped (issue 41, item 3).

A real Hugging Face Trainer run with the Trainer's clipping off
(``max_grad_norm=0``) and ``GradMonitorCallback(max_norm=1.0)`` clipping
instead, and a plain loop with ``monitor.clip_grad_norm_(max_norm=1.0)``:
every step whose gradients were scaled logs ``clip_coef`` and ``clipped_to``,
checked against float64 norms of the gradients recorded just before and just
after the monitor (torch's formula ``min(1, max_norm / (total + 1e-6))``).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from gradclip_cli import GradMonitor
from tests.cli.support import logical_lines, ref_norm

from .support import read_log

transformers = pytest.importorskip("transformers")

from tests.trainer_runs import (  # noqa: E402
    CALLBACK_CLIP_MAX_NORM,
    CALLBACK_CLIP_SPIKE_STEP,
    CALLBACK_CLIP_STEPS,
    train_with_callback_clipping,
)


@pytest.fixture(scope="session")
def callback_run(tmp_path_factory):
    """30 steps, max_grad_norm=0, the callback clipping to 1.0, a spike at step 22 (once)."""
    return train_with_callback_clipping(tmp_path_factory.mktemp("callback_clip") / "output")


def torch_coef(total: float, max_norm: float) -> float:
    return min(1.0, max_norm / (total + 1e-6))


def assert_coefficient(record: dict, coef: float, max_norm: float) -> None:
    """The logged coefficient is torch's formula on the logged total (float64 arithmetic:
    a few ulps), and that total is within 1e-6 of the float64 reference, so the
    coefficient is within 1e-6 of the reference's."""
    own = torch_coef(record["total_norm"], max_norm)
    assert math.isclose(record["clip_coef"], own, rel_tol=1e-12), record
    assert math.isclose(record["clip_coef"], coef, rel_tol=1e-6), record


def test_every_step_the_callback_scaled_logs_its_coefficient_and_target(callback_run):
    run = callback_run
    records = read_log(run.output_dir / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(1, CALLBACK_CLIP_STEPS + 1))
    clipped = 0
    for record in records:
        step = record["step"]
        total = run.before[step]
        assert math.isclose(record["total_norm"], total, rel_tol=1e-6)
        coef = torch_coef(total, CALLBACK_CLIP_MAX_NORM)
        # What the optimizer got: the gradients times the logged coefficient.
        assert math.isclose(run.after[step], total * coef, rel_tol=1e-5), step
        if coef < 1:
            clipped += 1
            assert record["clipped_to"] == CALLBACK_CLIP_MAX_NORM, record
            assert_coefficient(record, coef, CALLBACK_CLIP_MAX_NORM)
        else:
            assert record["clipped_to"] is None and record["clip_coef"] is None, record
    # This tiny GPT-2's gradients are near 1 (0.7-1.1): the spike and a few others clip.
    assert 2 <= clipped < CALLBACK_CLIP_STEPS


def test_a_spike_in_the_warm_up_says_why_it_has_no_dump(callback_run):
    records = read_log(callback_run.output_dir / "grads.jsonl")
    spike = records[CALLBACK_CLIP_SPIKE_STEP - 1]
    assert spike["step"] == CALLBACK_CLIP_SPIKE_STEP and spike["spike"]
    assert spike["dump"] is None
    assert spike["dump_skipped"].startswith("warm-up: a spike is dumped once its series has 25 ")
    assert not (callback_run.output_dir / "spikes").exists()
    # It was clipped all the same: the callback's max_norm does not wait for the warm-up.
    assert spike["clipped_to"] == CALLBACK_CLIP_MAX_NORM and spike["clip_coef"] < 1e-2


def test_trend_says_gradclip_clipped_not_that_the_optimizer_saw_every_gradient(
    callback_run, gradclip
):
    run = callback_run
    records = read_log(run.output_dir / "grads.jsonl")
    clipped = sum(r["clip_coef"] is not None for r in records)
    doc = gradclip("trend", run.output_dir, "--format", "json").json()
    [clipping] = doc["clipping"]
    assert clipping["clipped"] is False and clipping["max_grad_norm"] == 0
    assert clipping["monitor"] == {
        "source": str(run.output_dir / "grads.jsonl"), "logged_steps": CALLBACK_CLIP_STEPS,
        "clipped_steps": clipped, "clipped_to": [CALLBACK_CLIP_MAX_NORM],
    }  # fmt: skip
    note = clipping["note"]
    assert note.startswith("clipping: the Trainer did not clip (max_grad_norm 0 in ")
    assert "saw every gradient as logged" not in note
    assert (f"gradclip's GradMonitor ({run.output_dir / 'grads.jsonl'}) clipped {clipped} of "
            f"{CALLBACK_CLIP_STEPS} logged steps to total norm 1") in note
    assert "the optimizer (and the Adam moments in the checkpoints) saw the clipped" in note
    assert note in doc["notes"]
    assert sum("GradMonitor" in n for n in doc["notes"]) == 1  # said once, not per series
    table = gradclip("trend", run.output_dir)
    assert any(line.startswith("clipping: the Trainer did not clip") and "GradMonitor" in line
               for line in logical_lines(table.out)), table.out


def test_the_moments_saw_the_clipped_gradients(callback_run, gradclip):
    # What the note says, measured: Adam's exp_avg after the spike is that of
    # gradients of norm <= 1, not of the spike's (x1000) gradient.
    run = callback_run
    spike_total = run.before[CALLBACK_CLIP_SPIKE_STEP]
    assert spike_total > 100
    doc = gradclip("trend", run.output_dir, "--what", "exp_avg", "--format", "json").json()
    [after_spike] = [p for p in doc["points"] if p["step"] == 30]
    # A bias-corrected average of gradients each of norm <= max_norm stays <= max_norm.
    assert after_spike["total_norm"] <= CALLBACK_CLIP_MAX_NORM * (1 + 1e-6)


def test_a_run_folder_without_training_args_still_names_the_monitors_clipping(
    callback_run, gradclip, tmp_path
):
    folder = tmp_path / "output"
    shutil.copytree(callback_run.output_dir, folder)
    for args in folder.rglob("training_args.bin"):
        args.unlink()
    [clipping] = gradclip("trend", folder, "--format", "json").json()["clipping"]
    assert clipping["max_grad_norm"] is None and clipping["clipped"] is None
    log = folder / "grads.jsonl"
    assert clipping["note"].startswith(f"clipping: gradclip's GradMonitor ({log}) clipped ")


def regressor() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def grads64(model):
    return [p.grad.detach().double().clone() for p in model.parameters()]


@pytest.mark.parametrize("max_norm", [1.0, 0.05])
def test_plain_loop_clip_grad_norm_logs_what_it_applied(tmp_path, max_norm):
    torch.manual_seed(0)
    model = regressor()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=g)
    y = x.sum(1, keepdim=True).sin()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen = []
    with GradMonitor(model, tmp_path / "grads.jsonl", None) as monitor:
        for step in range(12):
            loss = torch.nn.functional.mse_loss(model(x), y) * (1 + 5 * (step % 3))
            loss.backward()
            before = grads64(model)
            returned = monitor.clip_grad_norm_(max_norm=max_norm, step=step)
            seen.append((ref_norm(before, 2.0), before, grads64(model), float(returned)))
            optimizer.step()
            optimizer.zero_grad()
    records = read_log(tmp_path / "grads.jsonl")
    scaled = 0
    for record, (total, before, after, returned) in zip(records, seen):
        assert math.isclose(returned, total, rel_tol=1e-6)
        coef = torch_coef(total, max_norm)
        for b, a in zip(before, after):
            torch.testing.assert_close(a, b * coef, rtol=1e-6, atol=0)
        if coef < 1:
            scaled += 1
            assert record["clipped_to"] == max_norm
            assert_coefficient(record, coef, max_norm)
        else:
            assert record["clipped_to"] is None and record["clip_coef"] is None
            assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert 0 < scaled  # both limits clip some of these steps
    if max_norm == 1.0:
        assert scaled < len(records)  # ... and 1.0 leaves others as they are


def test_a_nan_total_logs_the_nan_coefficient_it_applied(tmp_path):
    model = regressor()
    model(torch.ones(2, 6)).sum().backward()
    model[0].weight.grad[0, 0] = math.nan
    with GradMonitor(model, tmp_path / "grads.jsonl", None) as monitor:
        monitor.clip_grad_norm_(max_norm=1.0, step=0)
    [record] = read_log(tmp_path / "grads.jsonl")
    # torch multiplies by clamp(1 / (nan + 1e-6), max=1) = nan, and so does the monitor.
    assert record["clip_coef"] == "nan" and record["clipped_to"] == 1.0
    assert all(p.grad.isnan().all() for p in model.parameters())
    assert record["dump_skipped"] == "no dump_dir"


def test_trend_of_the_log_alone_says_the_monitor_clipped(callback_run, gradclip):
    log = callback_run.output_dir / "grads.jsonl"
    clipped = sum(r["clip_coef"] is not None for r in read_log(log))
    doc = gradclip("trend", log, "--format", "json").json()
    assert doc["notes"] == [
        f"clipping: gradclip's GradMonitor ({log}) clipped {clipped} of {CALLBACK_CLIP_STEPS} "
        f"logged steps to total norm 1, clip_coef down to "
        f"{min(r['clip_coef'] for r in read_log(log) if r['clip_coef'] is not None):.3g}: the "
        "logged norms are from before its clipping, the optimizer saw the clipped gradients"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("clip_spikes", [False, True])
def test_a_clip_refused_by_error_if_nonfinite_logs_no_coefficient(tmp_path, bad, clip_spikes):
    model = regressor()
    model(torch.ones(2, 6)).sum().backward()
    model[0].weight.grad[0, 0] = bad
    before = grads64(model)
    with GradMonitor(model, tmp_path / "grads.jsonl", None, clip_spikes=clip_spikes) as monitor:
        with pytest.raises(RuntimeError, match="non-finite"):
            monitor.clip_grad_norm_(max_norm=1.0, step=0, error_if_nonfinite=True)
    for b, a in zip(before, grads64(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    [record] = read_log(tmp_path / "grads.jsonl")
    # Nothing was scaled, so nothing is said to have been (trend counts these as clipped).
    assert record["total_norm"] == str(bad)
    assert record["clip_coef"] is None and record["clipped_to"] is None


def test_a_nan_coefficient_is_no_clip_to_the_limit_in_trends_note(tmp_path, gradclip):
    """A step whose total is NaN is scaled by NaN (torch's formula): trend's note counts it
    apart, by its step, not as a step clipped to max_norm."""
    model = regressor()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(0))
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log, None) as monitor:
        for step in range(6):
            model.zero_grad()
            (model(x * 10).pow(2).sum()).backward()
            if step == 3:
                model[0].weight.grad[0, 0] = math.nan
            monitor.clip_grad_norm_(max_norm=1.0, step=step)
    records = read_log(log)
    coefs = [r["clip_coef"] for r in records]
    assert coefs[3] == "nan" and all(isinstance(c, float) and c < 1 for i, c in
                                     enumerate(coefs) if i != 3)
    doc = gradclip("trend", log, "--format", "json").json()
    assert doc["notes"] == [
        f"clipping: gradclip's GradMonitor ({log}) clipped 5 of 6 logged steps to total "
        f"norm 1, clip_coef down to {min(c for i, c in enumerate(coefs) if i != 3):.3g}; "
        "clip_coef NaN at 1 non-finite step(s) (3): their gradients scaled to NaN, as torch's "
        "clip_grad_norm_ does: the logged norms are from before its clipping, the optimizer "
        "saw the clipped gradients"]
