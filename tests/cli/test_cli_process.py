"""A handful of real processes: ``python -m gradclip_cli`` and the ``gradclip`` script.

These check what only a real process shows: exit statuses as the shell sees them, and
stdout and stderr as two separate pipes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .support import SAMPLES, assert_no_report, ref_norm, rel_err, run_process, verdict


def test_inspect_json_streams(tmp_path, grads):
    path = tmp_path / "g.pt"
    torch.save({"grads": grads}, path)
    result = run_process("inspect", path, "--format", "json", "--max-norm", "1")
    assert result.code == 1
    doc = json.loads(result.out)  # stdout is the document alone
    assert doc["status"] == "exceeded"
    assert rel_err(doc["total_norm"], ref_norm(grads.values(), 2)) <= 1e-6
    # No progress, no logs, no import-time warnings (torch's "Failed to initialize NumPy"
    # where numpy is absent) on a piped stderr.
    assert result.err == ""


def test_table_in_a_pipe_is_plain(tmp_path):
    result = run_process(
        "inspect",
        SAMPLES / "nonfinite.pt",
        env={"TERM": "xterm-256color", "COLORTERM": "truecolor"},
    )
    assert result.code == 1
    assert "\x1b[" not in result.out and "\x1b[" not in result.err
    assert verdict(result.out).startswith("FAIL")
    assert result.err == ""


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["clip", "{healthy}", "--max-norm", "1", "--clip-value", "1"], 2),
        (["inspect", "{healthy}", "--no-such-flag"], 2),
        (["inspect", "{tmp}/missing.pt"], 3),
    ],
)
def test_error_exit_status_and_one_line(tmp_path, args, code):
    argv = [a.format(healthy=SAMPLES / "healthy.pt", tmp=tmp_path) for a in args]
    result = run_process(*argv)
    assert result.code == code
    assert_no_report(result)
    assert "Traceback" not in result.err
    assert len(result.err.splitlines()) == 1, result.err


def test_clip_writes_and_exits_0(tmp_path, grads):
    path = tmp_path / "g.pt"
    torch.save({"grads": grads, "step": 1}, path)
    result = run_process("clip", "g.pt", "--max-norm", "0.5", "--format", "json", cwd=tmp_path)
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert doc["output"] == "g.clipped.pt"
    out = torch.load(tmp_path / "g.clipped.pt", weights_only=True)
    total = ref_norm(grads.values(), 2)
    expected = total * min(1.0, 0.5 / (total + 1e-6))
    assert rel_err(ref_norm(out["grads"].values(), 2), expected) <= 1e-6


def test_console_script_is_the_same_command(tmp_path):
    script = Path(sys.executable).parent / "gradclip"
    if not script.exists():
        pytest.skip("the gradclip console script is not installed beside this interpreter")
    proc = subprocess.run(
        [
            str(script),
            "inspect",
            str(SAMPLES / "exploding.pt"),
            "--max-norm",
            "100",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["status"] == "exceeded"


def test_debug_keeps_exit_codes(tmp_path):
    result = run_process("inspect", tmp_path / "missing.pt", "--debug")
    assert "Traceback" in result.err  # --debug shows it...
    assert result.code == 3  # ...but the status still follows the contract


def many_tensors(tmp_path) -> Path:
    path = tmp_path / "many.pt"
    torch.save({f"model.layers.{i}.w": torch.ones(2) for i in range(2000)}, path)
    return path


@pytest.mark.parametrize(
    "fmt",
    [
        "json",
        "table",
    ],
)  # fmt: skip
def test_reader_closing_the_pipe_is_not_a_finding(tmp_path, fmt):
    path = many_tensors(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradclip_cli", "inspect", str(path), "--format", fmt,
         "--group-by", "tensor", "--top", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc.stdout.read(16)  # like `| head -c 16`: the output is far larger than a pipe holds
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=600)
    proc.stderr.close()
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert proc.returncode not in (1, 2, 3), (proc.returncode, err)
