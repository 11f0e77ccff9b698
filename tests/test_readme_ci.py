"""The README's GitHub Actions and GitLab CI jobs, run on the sample checkpoints.

The gradclip lines of each job are taken from README.md as written and run
the way each CI system runs them (GitHub: ``bash -eo pipefail``; GitLab: the
script lines in one shell that stops at the first failing line), with the
job's variables pointed at the samples. A README edit that breaks a job
breaks this test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_checkpoints"


def ci_jobs() -> tuple[dict, dict]:
    """(GitHub workflow, GitLab config) from the README's "In CI" section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## In CI"):]
    section = section[:section.index("\n## ", 1)]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    github = next(b for b in blocks if "jobs" in b)
    gitlab = next(b for b in blocks if "gradients" in b and "script" in b["gradients"])
    return github, gitlab


def github_script() -> tuple[str, dict]:
    github, _ = ci_jobs()
    job = github["jobs"]["gradients"]
    step = next(s for s in job["steps"] if s.get("name") == "Gradient check")
    return step["run"], job["env"]


def gitlab_script() -> tuple[str, dict, dict]:
    _, gitlab = ci_jobs()
    job = gitlab["gradients"]
    return "\n".join(job["script"]), job["variables"], job["artifacts"]


def run_folder(tmp_path: Path, newest: str) -> Path:
    """Six healthy checkpoints, then ``newest``: a run whose last point is judged."""
    run = tmp_path / "run"
    run.mkdir()
    for i in range(1, 7):
        shutil.copy(SAMPLES / "healthy.pt", run / f"step-{i}.pt")
    shutil.copy(SAMPLES / f"{newest}.pt", run / "step-7.pt")
    return run


def shell(script: str, cwd: Path, env: dict, flags: list[str]) -> subprocess.CompletedProcess:
    full = {**os.environ, **env,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "--noprofile", "--norc", *flags, "-c", script], cwd=cwd,
                          env=full, capture_output=True, text=True, timeout=900)


# Each case starts gradclip four times (GitHub) or twice (GitLab): a pass and a
# failure each, the two failure kinds split between them.
@pytest.mark.parametrize("sample, code", [("healthy", 0), ("nonfinite", 1)])
def test_github_actions_job(tmp_path, sample, code):
    script, job_env = github_script()
    assert set(job_env) == {"GRADS", "RUN"}
    summary = tmp_path / "summary.md"
    env = {"GRADS": str(SAMPLES / f"{sample}.pt"), "RUN": str(run_folder(tmp_path, sample)),
           "GITHUB_STEP_SUMMARY": str(summary)}
    r = shell(script, tmp_path, env, ["-eo", "pipefail"])
    assert r.returncode == code, r.stderr
    # Both Markdown reports reach the summary page, whatever the verdict.
    assert summary.read_text().count("### gradclip ") == 2
    commands = r.stdout.splitlines()
    assert commands and all(line.startswith("::") for line in commands)
    if code == 0:
        assert {line.split(" ", 1)[0] for line in commands} == {"::notice"}
    else:
        assert any(line.startswith("::error file=") for line in commands)


@pytest.mark.parametrize("sample, code", [("healthy", 0), ("exploding", 1)])
def test_gitlab_ci_job(tmp_path, sample, code):
    script, variables, artifacts = gitlab_script()
    assert set(variables) == {"GRADS", "RUN"} and artifacts["when"] == "always"
    env = {"GRADS": str(SAMPLES / f"{sample}.pt"), "RUN": str(run_folder(tmp_path, sample))}
    r = shell(script, tmp_path, env, ["-e"])
    assert r.returncode == code, r.stderr
    reports = sorted(tmp_path.glob(artifacts["reports"]["junit"]))
    assert [p.name for p in reports] == ["gradclip-inspect.xml", "gradclip-trend.xml"]
    failures = 0
    for path in reports:
        root = ET.parse(path).getroot()
        assert root.tag == "testsuites" and root.find("testsuite/testcase") is not None
        failures += int(root.get("failures"))
    assert (failures > 0) == (code == 1)
