"""Where GradMonitor writes: bad paths refused when it is made, failed writes never end a run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from gradclip_cli import GradMonitor

from .support import read_log


def model_with_grads(nan: bool = False) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    model(torch.randn(8, 4)).square().mean().backward()
    if nan:
        model[1].weight.grad[0, 0] = math.nan
    return model


@pytest.mark.parametrize(
    ("where", "words"),
    [
        (lambda d: {"dump_dir": d / "file"}, r"dump_dir='.*file' is not a folder"),
        (lambda d: {"dump_dir": d / "file" / "spikes"}, r"dump_dir=.* Not a directory"),
        (lambda d: {"log": d}, r"log='.*' is a folder"),
        (lambda d: {"log": d / "file" / "grads.jsonl"}, r"log=.* Not a directory"),
        (lambda d: {"log": d / "fifo"}, r"log='.*fifo' is not a regular file"),
    ],
)
def test_a_path_that_cannot_be_written_is_refused_when_made(tmp_path, where, words):
    (tmp_path / "file").write_text("a regular file\n")
    os.mkfifo(tmp_path / "fifo")
    paths = {"log": tmp_path / "grads.jsonl", "dump_dir": tmp_path / "spikes", **where(tmp_path)}
    with pytest.raises(ValueError, match=words):
        GradMonitor(model_with_grads(), **paths)
    assert (tmp_path / "file").read_text() == "a regular file\n"
    assert sorted(os.listdir(tmp_path)) == ["fifo", "file"]  # nothing made


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any folder")
def test_a_folder_without_write_permission_is_refused_when_made(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot be written to"):
            GradMonitor(model_with_grads(), locked / "grads.jsonl", None)
        with pytest.raises(ValueError, match="cannot be written to"):
            GradMonitor(model_with_grads(), None, locked)
    finally:
        locked.chmod(0o700)


def test_paths_that_do_not_exist_yet_are_made_on_first_use(tmp_path):
    monitor = GradMonitor(
        model_with_grads(nan=True), tmp_path / "a" / "grads.jsonl", tmp_path / "b" / "spikes"
    )
    assert os.listdir(tmp_path) == []  # made only when written
    record = monitor.step(0)
    monitor.close()
    assert read_log(tmp_path / "a" / "grads.jsonl") == [record]
    assert os.listdir(tmp_path / "b" / "spikes") == ["step-0.pt"]


def test_a_dump_that_fails_later_is_told_once_and_the_line_is_kept(tmp_path, capsys):
    model = model_with_grads(nan=True)
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", tmp_path / "spikes")
    (tmp_path / "spikes").write_text("made a file after the monitor was made\n")
    records = [monitor.step(step) for step in range(3)]  # a NaN at every step: a dump each
    monitor.close()
    assert [r["dump"] for r in records] == [None] * 3
    assert read_log(tmp_path / "grads.jsonl") == records
    err = capsys.readouterr().err
    assert err.count("GradMonitor: cannot write") == 1, err
    assert str(tmp_path / "spikes" / "step-0.pt") in err and "training goes on" in err
    assert monitor.dumps == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_log_that_cannot_be_written_is_told_once_and_training_goes_on(capsys):
    # /dev/full: every write fails with ENOSPC, as on a full disk.
    model = model_with_grads()
    monitor = GradMonitor(model, "/dev/full", None)
    before = [p.grad.clone() for p in model.parameters()]
    for step in range(3):
        assert monitor.step(step)["step"] == step
    total = monitor.clip_grad_norm_(1e9, 3)
    monitor.close()
    assert math.isfinite(float(total))
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    err = capsys.readouterr().err
    assert err.count("GradMonitor: cannot write /dev/full") == 1, err
    assert "No space left on device" in err and "training goes on" in err


CUT_SHORT = """
import os, resource, sys, torch
from gradclip_cli import GradMonitor
model = torch.nn.Linear(4, 1)
model(torch.randn(8, 4)).sum().backward()
log = sys.argv[1]
monitor = GradMonitor(model, log, None)
monitor.step(0)
# Files may grow 20 bytes more: the next line is cut short (a real partial write,
# then EFBIG; Python ignores SIGXFSZ).
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(log) + 20,) * 2)
for step in range(1, 4):
    assert monitor.step(step)["step"] == step
print("trained on")
"""


def test_a_line_cut_short_ends_the_log_there(tmp_path):
    log = tmp_path / "grads.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", CUT_SHORT, str(log)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == "trained on\n", done.stderr
    assert done.stderr.count("GradMonitor: cannot write") == 1, done.stderr
    assert "the log stops at this step" in done.stderr
    first, rest = log.read_bytes().split(b"\n", 1)
    assert json.loads(first)["step"] == 0
    # Nothing after the cut line: a later line would make it unreadable.
    assert len(rest) == 20 and b"\n" not in rest and rest.startswith(b'{"schema"')


def test_a_resumed_run_appends_after_a_line_cut_short(tmp_path, gradclip):
    """The run whose line was cut short is resumed (its disk freed): the new monitor
    drops the cut line before appending, and ``trend`` reads the whole log."""
    log = tmp_path / "grads.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", CUT_SHORT, str(log)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    model = model_with_grads()
    with GradMonitor(model, log, None) as monitor:
        for step in range(1, 4):
            monitor.step(step)
    lines = log.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(line)["step"] for line in lines[:-1]] == [0, 1, 2, 3]
    r = gradclip("trend", log, "--format", "json")
    assert r.code == 0, r.err
    assert [p["step"] for p in r.json()["points"]] == [0, 1, 2, 3]
