"""The Python inspection API (``gradclip_cli.inspect``, ``trend``, ``render``, ``exit_code``),
``dir(gradclip_cli)``, and ``import gradclip`` (issue 41, item 8).

The API returns the report objects the commands format: rendered as JSON
they are byte for byte what ``--format json`` prints, and their numbers meet
a float64 reference. Errors raise ``GradclipError`` with the command's line
and exit code.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys

import pytest
import torch

import gradclip_cli
from gradclip_cli import GradclipError, GradMonitor, InputError, UsageError
from gradclip_cli.report import InspectReport
from gradclip_cli.report.trend import TrendReport

from .support import REPO, SAMPLES, ref_norm


@pytest.fixture
def grads_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    grads = {
        "h.0.w": torch.randn(64, 32, generator=g),
        "h.0.b": torch.randn(64, generator=g).to(torch.bfloat16),
        "h.1.w": (torch.randn(16, 64, generator=g) * 1e3).to(torch.float16),
        "head.w": torch.randn(8, 16, generator=g, dtype=torch.float64),
    }
    path = tmp_path / "grads.pt"
    torch.save({"grads": grads, "step": 3}, path)
    return path, grads


def test_inspect_returns_the_report_the_command_formats(gradclip, grads_file):
    path, grads = grads_file
    report = gradclip_cli.inspect(path)
    assert isinstance(report, InspectReport)
    assert report.what == "grads" and report.step == 3 and report.status == "ok"
    assert math.isclose(report.total_norm, ref_norm(list(grads.values()), 2.0), rel_tol=1e-6)
    groups = {g.name: g.norm for g in report.groups}
    assert set(groups) == {"h.0", "h.1", "head"}
    assert math.isclose(groups["h.1"], ref_norm([grads["h.1.w"]], 2.0), rel_tol=1e-6)
    # Byte for byte what `gradclip inspect PATH --format json` prints.
    cli = gradclip("inspect", path, "--format", "json")
    assert gradclip_cli.render(report, "json") == cli.out
    assert gradclip_cli.exit_code(report) == cli.code == 0


@pytest.mark.parametrize("fmt", ["table", "markdown", "github", "junit"])
def test_render_gives_every_format_as_the_command_writes_it(gradclip, grads_file, fmt,
                                                            monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    path, _ = grads_file
    cli = gradclip("inspect", path, "--format", fmt, "--max-norm", "1")
    report = gradclip_cli.inspect(path, max_norm=1)
    assert report.status == "exceeded" and gradclip_cli.exit_code(report) == cli.code == 1
    assert gradclip_cli.render(report, fmt) == cli.out


def test_inspect_options_are_the_commands(gradclip, grads_file):
    path, grads = grads_file
    report = gradclip_cli.inspect(path, norm_type="inf", group_by="tensor")
    want = max(float(t.double().abs().max()) for t in grads.values())
    assert report.total_norm == want
    assert [g.name for g in report.groups] == list(grads)
    cli = gradclip("inspect", path, "--norm-type", "inf", "--group-by", "tensor",
                   "--format", "json")
    assert gradclip_cli.render(report, "json") == cli.out


def test_inspect_what_weights_of_a_model_state_dict(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    report = gradclip_cli.inspect(tmp_path / "model.pt", what="weights")
    assert report.what == "weights"
    assert math.isclose(report.total_norm, ref_norm(list(model.state_dict().values()), 2.0),
                        rel_tol=1e-6)


def test_errors_raise_the_commands_line_and_exit_code_not_system_exit(gradclip, tmp_path):
    missing = tmp_path / "missing.pt"
    cli = gradclip("inspect", missing)
    with pytest.raises(InputError) as caught:
        gradclip_cli.inspect(missing)
    assert caught.value.exit_code == cli.code == 3
    assert cli.err == f"gradclip: {caught.value.message}\n"
    assert str(caught.value) == caught.value.message
    with pytest.raises(UsageError) as caught:
        gradclip_cli.inspect(SAMPLES / "healthy.pt", norm_type=-1)
    assert caught.value.exit_code == 2 and "--norm-type must be a number > 0" in str(caught.value)
    with pytest.raises(GradclipError) as caught:
        gradclip_cli.trend([SAMPLES / "healthy.pt"], what="nonsense")
    assert caught.value.exit_code == 2
    with pytest.raises(UsageError, match="format must be one of"):
        gradclip_cli.render(gradclip_cli.inspect(SAMPLES / "healthy.pt"), "yaml")


def test_a_file_the_os_cannot_read_is_an_input_error_as_the_command_says(gradclip, tmp_path):
    folder = tmp_path / "not-a-file.pt"
    folder.mkdir()
    cli = gradclip("inspect", folder)
    with pytest.raises(GradclipError) as caught:
        gradclip_cli.inspect(folder)
    assert caught.value.exit_code == cli.code == 3
    assert cli.err.startswith(f"gradclip: {caught.value.message}")


def test_trend_returns_the_report_the_command_formats(gradclip, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log, None) as monitor:
        for step in range(30):
            x = torch.randn(32, 6)
            loss = model(x).square().mean() * (1000.0 if step == 29 else 1.0)
            loss.backward()
            monitor.step(step)
            model.zero_grad()
    run = gradclip_cli.trend(log)  # one path, not in a list: as trend(PATH)
    assert isinstance(run, TrendReport)
    assert [p.step for p in run.points] == list(range(30))
    assert run.status == "spike" and run.points[-1].spike
    assert gradclip_cli.exit_code(run) == 1
    cli = gradclip("trend", log, "--format", "json")
    assert cli.code == 1 and gradclip_cli.render(run, "json") == cli.out
    logged = [json.loads(line)["total_norm"] for line in log.read_text().splitlines()]
    assert [p.total_norm for p in run.points] == logged
    # The spike rule's options, as the command takes them.
    calm = gradclip_cli.trend([log], z=1e6, fail_on="any")
    assert calm.status == "ok" and gradclip_cli.exit_code(calm) == 0


def test_the_callers_torch_threads_are_left_as_they_were(grads_file):
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        gradclip_cli.inspect(grads_file[0])
        assert torch.get_num_threads() == 3
        with pytest.raises(InputError):
            gradclip_cli.inspect(grads_file[0].with_name("missing.pt"))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO / "tests", capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_dir_lists_every_public_name_before_any_is_loaded():
    # A fresh process: nothing loaded yet, as in a REPL right after the import.
    out = run_python(
        "import gradclip_cli, sys\n"
        "missing = [n for n in gradclip_cli.__all__ if n not in dir(gradclip_cli)]\n"
        "print(missing, 'torch' in sys.modules)\n"
    )
    assert out.split() == ["[]", "False"]  # and listing them imported nothing heavy
    assert {"inspect", "trend", "render", "exit_code", "GradclipError", "GradMonitor",
            "clip_grad_norm_", "save_grads"} <= set(gradclip_cli.__all__)


def test_import_gradclip_gives_the_same_objects():
    gradclip = importlib.import_module("gradclip")  # the distribution's name

    assert gradclip.__all__ == gradclip_cli.__all__
    for name in gradclip_cli.__all__:
        assert getattr(gradclip, name) is getattr(gradclip_cli, name), name
    assert set(gradclip_cli.__all__) <= set(dir(gradclip))
    with pytest.raises(AttributeError):
        gradclip.not_a_name  # noqa: B018
    # ... in a process of its own, started outside the repository's root.
    out = run_python("import gradclip; print(gradclip.clip_grad_norm_.__module__, "
                     "gradclip.__version__)")
    assert out.split() == ["gradclip_cli.api", gradclip_cli.__version__]
