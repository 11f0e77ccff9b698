"""The README's GitHub Actions and GitLab CI jobs, run on the sample checkpoints.

Each job is taken from README.md as written (docs/guides/ci.md shows the same
two) and run the way its CI system runs it: GitHub's step by step (each
``run:`` step under ``bash -e``, which stops at the first failing command;
``uses:`` steps simulated: the checkouts as folders, setup-python as this
interpreter, pip as a check that what it installs is a project the job
checked out), GitLab's script lines in one shell that stops at the first
failing line, with the job's variables pointed at sample checkpoints that
have findings. Every finding each command reports on its own must reach the
job's output. A README edit that breaks a job, or loses a finding, breaks
this test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_checkpoints"


CI_GUIDE = REPO / "docs" / "guides" / "ci.md"


def ci_jobs(page: Path = REPO / "README.md") -> tuple[dict, dict]:
    """(GitHub workflow, GitLab config) from the README's "Fail CI when gradients
    explode" recipe, or from a whole page (the docs site's CI guide)."""
    section = page.read_text(encoding="utf-8")
    if page.name == "README.md":
        section = section[section.index("## Fail CI when gradients explode") :]
        section = section[: section.index("\n## ", 1)]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    github = next(b for b in blocks if "jobs" in b)
    gitlab = next(b for b in blocks if "gradients" in b and "script" in b["gradients"])
    return github, gitlab


def test_the_ci_guide_shows_the_jobs_this_test_runs():
    # The site's guide and the README give the same two jobs: what runs here is both.
    assert ci_jobs(CI_GUIDE) == ci_jobs()


def github_job() -> dict:
    github, _ = ci_jobs()
    return github["jobs"]["gradients"]


def gitlab_script() -> tuple[str, dict, dict]:
    _, gitlab = ci_jobs()
    job = gitlab["gradients"]
    return "\n".join(job["script"]), job["variables"], job["artifacts"]


def test_gitlab_ci_installs_what_it_cloned():
    _, gitlab = ci_jobs()
    job = gitlab["gradients"]
    clone, install = job["before_script"]
    assert clone == 'git clone --depth 1 "$GRADCLIP_GIT" gradclip'
    assert install == "pip install torch==2.13.0 ./gradclip"
    assert job["variables"]["GRADCLIP_GIT"].endswith(".git")


def run_folder(tmp_path: Path, newest: str) -> Path:
    """Six healthy checkpoints, then ``newest``: a run whose last point is judged.

    Each sample records step 100; a run's files each record their own step
    (the same step twice with other norms is two runs, which trend refuses).
    """
    run = tmp_path / "run"
    run.mkdir()
    for step, sample in [*((i, "healthy") for i in range(1, 7)), (7, newest)]:
        saved = torch.load(SAMPLES / f"{sample}.pt", weights_only=True)
        assert saved["step"] == 100
        torch.save({**saved, "step": step}, run / f"step-{step}.pt")
    return run


def shell(script: str, cwd: Path, env: dict, flags: list[str]) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    full = {**os.environ, "PATH": path, **env}
    return subprocess.run(
        ["bash", "--noprofile", "--norc", *flags, "-c", script],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=900,
    )


def checkout(step: dict, workspace: Path) -> None:
    """``actions/checkout``: the job's own repository is the workspace (where the
    artifacts are); a ``repository:`` checkout puts gradclip at its ``path``."""
    path = step.get("with", {}).get("path")
    if step.get("with", {}).get("repository"):
        assert path, "a checkout of another repository needs its own path"
        (workspace / path).symlink_to(REPO, target_is_directory=True)


def fake_pip(bin_dir: Path, log: Path) -> None:
    """``pip`` for the install step: gradclip is installed in this environment
    already, so it checks what the step names instead: every local path (``./x``)
    must be a folder holding a ``pyproject.toml`` that the job has checked out."""
    bin_dir.mkdir()
    pip = bin_dir / "pip"
    pip.write_text(f"""#!/bin/sh
echo "$@" >> {log}
[ "$1" = install ] || exit 2
shift
for arg in "$@"; do
  case "$arg" in
    ./*|/*|../*) [ -f "$arg/pyproject.toml" ] || {{ echo "no project at $arg" >&2; exit 1; }} ;;
  esac
done
""")
    pip.chmod(0o755)


def findings_alone(args: list[str], cwd: Path, env: dict) -> set[str]:
    """The ``::error`` / ``::warning`` lines ``gradclip ARGS --format github`` prints
    when run on its own: what the job must pass on."""
    r = shell(
        " ".join(shlex.quote(a) for a in ["gradclip", *args, "--format", "github"]), cwd, env, []
    )
    return {line for line in r.stdout.splitlines() if line.startswith(("::error", "::warning"))}


def run_github_job(workspace: Path, grads: Path, run: Path) -> tuple[list, Path]:
    """Every step of the README's job in order, as the runner does: ``uses:`` steps
    simulated, each ``run:`` step under ``bash -e`` with the job's env (its paths
    pointed at ``grads`` and ``run``). Returns each run step's result and the
    step summary file."""
    job = github_job()
    summary = workspace / "summary.md"
    pip_log = workspace / "pip.log"
    fake_pip(workspace / "bin", pip_log)
    env = {
        **job["env"],
        "GRADS": str(grads),
        "RUN": str(run),
        "GITHUB_STEP_SUMMARY": str(summary),
        "PATH": f"{workspace / 'bin'}{os.pathsep}{Path(sys.executable).parent}"
        f"{os.pathsep}{os.environ['PATH']}",
    }
    results = []
    for step in job["steps"]:
        uses = step.get("uses", "")
        if uses.startswith("actions/checkout@"):
            checkout(step, workspace)
        elif uses.startswith("actions/setup-python@"):
            continue  # this interpreter stands in
        elif "run" in step:
            r = shell(step["run"], workspace, env, ["-e"])
            results.append((step.get("name"), r))
            if r.returncode:
                break  # the runner skips the steps after a failed one
        else:
            pytest.fail(f"a step this test cannot run: {step}")
    assert pip_log.read_text().split() == ["install", "torch==2.13.0", "./gradclip"]
    return results, summary


def test_github_actions_install_step_installs_what_the_job_checked_out(tmp_path):
    # The install line names ./gradclip: a checkout step must put gradclip there.
    results, _ = run_github_job(tmp_path, SAMPLES / "healthy.pt", run_folder(tmp_path, "healthy"))
    assert [name for name, _ in results] == ["Install gradclip", "Gradient check"]
    assert results[0][1].returncode == 0, results[0][1].stderr
    job = github_job()
    paths = [
        s["with"]["path"]
        for s in job["steps"]
        if s.get("uses", "").startswith("actions/checkout@") and "path" in s.get("with", {})
    ]
    assert paths == ["gradclip"]


# Each case runs the job once (gradclip four times) and every command alone once
# more: a pass, and findings from both commands at once.
@pytest.mark.parametrize("grads, newest, code", [
    ("healthy", "healthy", 0),
    ("nonfinite", "exploding", 1),   # inspect: non-finite; trend: a spike at the newest point
    ("exploding", "nonfinite", 1),   # inspect: above --max-norm; trend: non-finite newest point
])  # fmt: skip
def test_github_actions_job_under_bash_e_reports_every_finding(tmp_path, grads, newest, code):
    run = run_folder(tmp_path, newest)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    results, summary = run_github_job(workspace, SAMPLES / f"{grads}.pt", run)
    name, r = results[-1]
    assert name == "Gradient check"
    assert r.returncode == code, r.stderr
    # Both Markdown reports reach the summary page, whatever the verdict.
    assert summary.read_text().count("### gradclip ") == 2
    commands = r.stdout.splitlines()
    assert commands and all(line.startswith("::") for line in commands)
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    inspect_found = findings_alone(
        ["inspect", str(SAMPLES / f"{grads}.pt"), "--max-norm", "1e3"], workspace, env
    )
    trend_found = findings_alone(["trend", str(run)], workspace, env)
    if code == 0:
        assert {line.split(" ", 1)[0] for line in commands} == {"::notice"}
        assert not inspect_found and not trend_found
    else:
        # Both commands found something, and the job passed on every line of it.
        assert any(line.startswith("::error") for line in inspect_found)
        assert any(line.startswith("::error") for line in trend_found)
        assert inspect_found | trend_found <= set(commands)


@pytest.mark.parametrize("sample, code", [("healthy", 0), ("exploding", 1)])
def test_gitlab_ci_job(tmp_path, sample, code):
    script, variables, artifacts = gitlab_script()
    assert set(variables) == {"GRADS", "RUN", "GRADCLIP_GIT"} and artifacts["when"] == "always"
    env = {"GRADS": str(SAMPLES / f"{sample}.pt"), "RUN": str(run_folder(tmp_path, sample))}
    r = shell(script, tmp_path, env, ["-e"])
    assert r.returncode == code, r.stderr
    reports = sorted(tmp_path.glob(artifacts["reports"]["junit"]))
    assert [p.name for p in reports] == ["gradclip-inspect.xml", "gradclip-trend.xml"]
    for path in reports:
        root = ET.parse(path).getroot()
        assert root.tag == "testsuites" and root.find("testsuite/testcase") is not None
        # Each command's findings reach its own report: the script went on past the first.
        assert (int(root.get("failures")) > 0) == (code == 1), path.name
