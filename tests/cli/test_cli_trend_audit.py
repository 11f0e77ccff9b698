"""The norm audit of ``gradclip trend``: a framework's logged total held against gradclip's.

The disagreeing run is a real Trainer run whose logged ``grad_norm`` is
torch's norm of the first half of the parameters (its accelerator's
``clip_grad_norm_`` replaced for the run), as the expert-parallel norm bugs
logged theirs (Megatron-LM PR#5916, DeepSpeed#8469), beside a GradMonitor
log of the whole norm. The references are torch's half norm, recorded as the
Trainer logged it, and the monitor log's numbers checked against a float64
sum of squares of the gradients in tests/integrations.
"""

from __future__ import annotations

import json
import math
import shutil
import xml.etree.ElementTree as ET

import pytest

from gradclip_cli.report.norm_audit import tolerance
from tests.schemas import validate
from tests.trainer_runs import RUN_FOLDER_LOG, train_with_half_norm

from .support import logical_lines

FORMATS = ("table", "json", "markdown", "github", "junit")


@pytest.fixture(scope="session")
def half_norm_run(tmp_path_factory):
    """10 steps, checkpoint-5/ and checkpoint-10/, the Trainer's grad_norm over half the
    parameters, a GradMonitor log of all of them (made once a session)."""
    return train_with_half_norm(tmp_path_factory.mktemp("hf_half_norm") / "output")


def monitor_totals(run) -> dict[int, float]:
    lines = (run.output_dir / RUN_FOLDER_LOG).read_text().splitlines()
    return {r["step"]: r["total_norm"] for r in map(json.loads, lines)}


def test_every_step_disagrees_and_each_is_reported_with_both_values(gradclip, half_norm_run):
    run = half_norm_run
    r = gradclip("trend", run.output_dir, "--format", "json")
    assert r.code == 1, r.err  # a disagreement is a finding, even with no spike
    doc = r.json()
    validate(doc, "trend-1")
    assert doc["status"] == "ok"  # the spike rule's status: no spike, nothing non-finite
    [audit] = doc["audit"]
    assert audit["framework"] == {"source": str(run.output_dir / "trainer_state.json"),
                                  "kind": "Trainer grad_norm"}
    assert audit["gradclip"] == {"source": str(run.output_dir / RUN_FOLDER_LOG),
                                 "kind": "gradclip monitor log"}
    assert audit["precision"] == "float32"  # torch's float32 total, as the Trainer logs it
    assert audit["tolerance"] == tolerance("float32")
    assert audit["steps_compared"] == run.steps and audit["agrees"] is False
    whole = monitor_totals(run)
    assert [d["step"] for d in audit["disagreements"]] == list(range(1, run.steps + 1))
    for d in audit["disagreements"]:
        # Both values as logged: torch's norm of half the parameters, the monitor's of all.
        assert d["framework"] == run.half_norms[d["step"]]
        assert d["gradclip"] == whole[d["step"]]
        assert d["framework"] < d["gradclip"]  # a part of the gradients has the smaller norm
        want = (d["gradclip"] - d["framework"]) / d["gradclip"]
        assert math.isclose(d["relative_difference"], want, rel_tol=1e-12)
        assert d["relative_difference"] > audit["tolerance"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_says_so_and_exits_1(gradclip, half_norm_run, fmt):
    run = half_norm_run
    r = gradclip("trend", run.output_dir, "--format", fmt)
    assert r.code == 1, r.err
    first = min(run.half_norms)
    if fmt == "table":
        lines = logical_lines(r.out)
        audit = next(line for line in lines if line.startswith("norm audit:"))
        assert f"DISAGREE at {run.steps} of {run.steps} step(s)" in audit
        assert f"step {first}: {run.half_norms[first]:.6g} vs " in audit
        assert lines[-1].startswith("FAIL: the logged total norm disagrees with gradclip's "
                                    f"at {run.steps} step(s) (step {first}: ")
        assert lines[-1].endswith("(exit 1)")
    elif fmt == "json":
        assert not r.json()["audit"][0]["agrees"]
    elif fmt == "markdown":
        text = r.out.replace("\\", "")  # Markdown's escapes off
        assert f"DISAGREE at {run.steps} of {run.steps} step(s)" in text
        assert "**❌ FAIL: the logged total norm disagrees" in text
    elif fmt == "github":
        errors = [line for line in r.out.splitlines() if line.startswith("::error")]
        assert len(errors) == run.steps
        assert all("logged total norm disagrees at step" in line for line in errors)
    else:
        suite = ET.fromstring(r.out)
        failures = suite.findall(".//failure")
        assert len(failures) == run.steps
        assert all("logged total norm disagrees" in f.get("message") for f in failures)


def test_quiet_says_the_verdict_and_each_step_on_stderr(gradclip, half_norm_run):
    run = half_norm_run
    r = gradclip("trend", run.output_dir, "-q")
    assert r.code == 1
    assert r.out.startswith("FAIL: the logged total norm disagrees")
    assert len([line for line in r.err_lines if "Trainer grad_norm" in line]) == run.steps


def test_without_the_monitor_log_there_is_nothing_to_audit(gradclip, half_norm_run, tmp_path):
    copy = tmp_path / "output"
    shutil.copytree(half_norm_run.output_dir, copy)
    (copy / RUN_FOLDER_LOG).unlink()
    r = gradclip("trend", copy, "--format", "json")
    assert r.code == 0, r.err
    assert r.json()["audit"] == []


def test_a_spike_and_a_disagreement_both_fail(gradclip, half_norm_run, tmp_path):
    # The newest point blown up in the monitor log: the spike's verdict, the audit's finding.
    copy = tmp_path / "output"
    shutil.copytree(half_norm_run.output_dir, copy)
    log = copy / RUN_FOLDER_LOG
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records[-1]["total_norm"] *= 1000
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = gradclip("trend", copy, "--format", "json")
    assert r.code == 1
    doc = r.json()
    assert doc["status"] == "spike" and not doc["audit"][0]["agrees"]
    r = gradclip("trend", copy)
    assert logical_lines(r.out)[-1].startswith("FAIL: gradient spike at the newest point")


def test_the_python_apis_exit_code_counts_the_audit(half_norm_run):
    import gradclip_cli

    report = gradclip_cli.trend(half_norm_run.output_dir)
    assert report.status == "ok" and report.disagreeing
    assert gradclip_cli.exit_code(report) == 1


def test_a_framework_total_that_overflowed_is_said_to_have_overflowed(gradclip, tmp_path):
    """The Trainer's own grad_norm is torch's float32 norm: at a step whose gradients are
    finite but whose squares pass float32's range it logs inf, while gradclip's monitor
    logs the finite norm. The audit finds the step, and the verdict says the framework's
    norm overflowed, not that it was taken over other gradients (it was not)."""
    pytest.importorskip("transformers")
    from tests.trainer_runs import OVERFLOW_AUDIT_STEP, train_callback_overflowing

    reference = train_callback_overflowing(tmp_path)
    assert math.isfinite(reference[OVERFLOW_AUDIT_STEP])
    result = gradclip("trend", tmp_path, "--format", "json")
    assert result.code == 1, result.err
    (audit,) = result.json()["audit"]
    (found,) = audit["disagreements"]
    assert found["step"] == OVERFLOW_AUDIT_STEP and found["framework"] == "inf"
    assert found["gradclip"] == pytest.approx(reference[OVERFLOW_AUDIT_STEP], rel=1e-6)
    verdict = gradclip("trend", tmp_path).out.strip().splitlines()[-1]
    assert verdict.startswith("FAIL: the logged total norm disagrees"), verdict
    assert "overflowed" in verdict and "other gradients" not in verdict, verdict
