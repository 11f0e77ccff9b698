"""A terminal that reports no width, and what a command writes before it fails (issue 41, 1 and 5).

``script``, ``expect`` and CI runners give a pseudo-terminal whose size is
``0 0``; every command must draw at a sane width there. No command writes an
output (clip's checkpoint, trend's plot, a ``--output-file``) and then exits
non-zero over its report: the report is drawn first. With ``--output-file``
the verdict line goes to stderr too, so a CI job's log says why it failed.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios

import pytest
import torch

from gradclip_cli.format.fitting import PIPE_WIDTH

from .support import SAMPLES, logical_lines, verdict

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_in_pty(*args: object, cols: int = 0, rows: int = 0, cwd=None) -> tuple[int, str]:
    """``python -m gradclip_cli ARGS`` with stdin, stdout and stderr a pseudo-terminal of
    ``cols`` x ``rows`` (0 x 0: what ``stty size`` says under ``script``)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE")}
    proc = subprocess.Popen([sys.executable, "-m", "gradclip_cli", *map(str, args)],
                            stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                            close_fds=True)
    os.close(slave)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 600)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        code = proc.wait(timeout=600)
        os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    return code, ANSI.sub("", text)


def _grads_run(folder, steps=7):
    folder.mkdir()
    torch.manual_seed(0)
    for step in range(steps):
        grads = {f"layer.{i}.w": torch.randn(8) for i in range(2)}
        torch.save({"grads": grads, "step": step}, folder / f"ckpt-{step}.pt")
    return folder


def test_the_pty_reports_zero_width():
    """The premise: a terminal of size 0 x 0, as ``stty size`` reads it."""
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        assert os.get_terminal_size(slave) == os.terminal_size((0, 0))
    finally:
        os.close(slave)
        os.close(master)


def test_every_command_draws_on_a_zero_width_terminal(tmp_path):
    run = _grads_run(tmp_path / "run")
    out = tmp_path / "o2.pt"
    commands = {
        "inspect": ["inspect", SAMPLES / "healthy.pt"],
        "clip": ["clip", SAMPLES / "healthy.pt", "--max-norm", "1", "-o", out],
        "trend": ["trend", run],
        "compare": ["compare", run / "ckpt-0.pt", run / "ckpt-1.pt"],
    }
    for name, args in commands.items():
        code, text = run_in_pty(*args)
        assert code == 0, (name, text)
        assert "ValueError" not in text and "invalid width" not in text, text
        lines = [line for line in text.splitlines() if line.strip()]
        # Drawn at the pipe width: every line fits it, and the table is there.
        assert max(map(len, lines)) <= PIPE_WIDTH, (name, text)
        if name != "clip":
            assert verdict(text).startswith("OK: "), (name, text)
    assert torch.load(out, weights_only=True)  # clip wrote its copy and exited 0


def test_quiet_prints_the_verdict_for_every_command_on_a_zero_width_terminal(tmp_path):
    run = _grads_run(tmp_path / "run")
    for args in (["inspect", SAMPLES / "nonfinite.pt"], ["trend", run],
                 ["compare", run / "ckpt-0.pt", run / "ckpt-1.pt"]):
        code, text = run_in_pty(*args, "-q")
        said = [line for line in logical_lines(text) if not line.startswith("gradclip: ")]
        assert len(said) == 1 and re.match(r"(OK|FAIL): .* \(exit [01]\)$", said[0]), text
        assert code == (1 if "nonfinite" in str(args[1]) else 0)


def test_a_real_terminal_keeps_its_own_width(tmp_path):
    code, text = run_in_pty("inspect", SAMPLES / "healthy.pt", cols=70, rows=20)
    assert code == 0
    assert max(map(len, text.splitlines())) <= 70


# -- nothing written, then a failure ---------------------------------------------


def _broken_render(*_args, **_kwargs):
    raise ValueError("the report could not be drawn")


@pytest.mark.parametrize("format", ["table", "json", "markdown", "github", "junit"])
def test_clip_writes_nothing_when_its_report_cannot_be_drawn(gradclip, tmp_path, monkeypatch,
                                                              format):
    """Drawing comes before writing: a report that fails leaves no clipped copy behind."""
    from gradclip_cli.format import FORMATS

    monkeypatch.setattr(FORMATS[format], "render_clip", _broken_render)
    out = tmp_path / "o2.pt"
    r = gradclip("clip", SAMPLES / "healthy.pt", "--max-norm", "1", "-o", out,
                 "--format", format)
    assert r.code == 3 and "the report could not be drawn" in r.err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary file either


def test_a_failed_write_leaves_no_report_file(gradclip, tmp_path, monkeypatch):
    """The report file is staged before the checkpoint is written and discarded when
    the write fails: a report never says what was not done."""
    from gradclip_cli.errors import OutputError
    from gradclip_cli.sink import write_back

    def refuse(*_args, **_kwargs):
        raise OutputError("o2.pt: cannot write: no space left on the device")

    monkeypatch.setattr(write_back, "write_checkpoint", refuse)
    report = tmp_path / "report.txt"
    r = gradclip("clip", SAMPLES / "healthy.pt", "--max-norm", "1", "-o", tmp_path / "o2.pt",
                 "--output-file", report)
    assert r.code == 3 and "no space left" in r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_trend_writes_no_plot_when_its_report_cannot_be_drawn(gradclip, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from gradclip_cli.format import FORMATS

    run = _grads_run(tmp_path / "run")
    monkeypatch.setattr(FORMATS["table"], "render_trend", _broken_render)
    plot = tmp_path / "norms.png"
    r = gradclip("trend", run, "--plot", plot, "--no-progress")
    assert r.code == 3 and not plot.exists()


# -- the verdict on stderr with --output-file -------------------------------------


@pytest.mark.parametrize("format", ["table", "markdown", "json", "github", "junit"])
def test_output_file_runs_print_the_verdict_on_stderr(gradclip, tmp_path, format):
    run = _grads_run(tmp_path / "run")
    report = tmp_path / "report.out"
    cases = [
        (["inspect", SAMPLES / "nonfinite.pt"], 1),
        (["trend", run], 0),
        (["compare", run / "ckpt-0.pt", run / "ckpt-1.pt", "--fail-above", "1.01"], 1),
        (["clip", SAMPLES / "healthy.pt", "--max-norm", "1", "-o", tmp_path / "o.pt"], 0),
    ]
    for args, code in cases:
        table = gradclip(*args)  # the same run to stdout: its verdict is the last line
        r = gradclip(*args, "--format", format, "--output-file", report, "--no-progress")
        assert r.code == code == table.code, r.err
        assert r.out == "" and report.exists()
        said = r.err_lines[-1]
        if args[0] == "clip":
            summary = [x for x in logical_lines(table.out) if x.startswith("gradient total")]
            assert said == f"gradclip: {summary[0]}"
            assert said.startswith("gradclip: gradient total norm (p=2): 2.23462 -> 1; ")
        else:
            assert said == f"gradclip: {verdict(table.out)}"
        report.unlink()
