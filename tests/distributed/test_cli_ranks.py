"""The CLI under a launcher: 2 gloo ranks give the one-process report, byte for byte.

One launch of ``torchrun`` runs every command (ranks_cli.py), and one run of
the same commands without a launcher gives the reference. A last launch runs
``torchrun -m gradclip_cli`` itself, the way users start it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli.support import SAMPLES
from tests.distributed.launch import (
    HARNESS,
    REPO,
    env,
    one_process,
    results,
    torchrun,
    write_jobs,
)

SAMPLE_FILES = sorted(p.name for p in SAMPLES.iterdir() if p.suffix in (".pt", ".safetensors"))


def multi_tensor_checkpoint(path: Path) -> Path:
    """Tensors of every size class (stacked, one row, several rows) and dtype, one tie."""
    g = torch.Generator().manual_seed(7)
    grads = {}
    for i in range(6):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        magnitude = 10.0 ** (i - 3)
        grads[f"layers.{i}.attn.weight"] = (torch.randn(96, 96, generator=g) * magnitude).to(dtype)
        grads[f"layers.{i}.attn.bias"] = torch.randn(96, generator=g).to(dtype)
        grads[f"layers.{i}.mlp.weight"] = torch.randn(600, 512, generator=g).to(dtype)
        grads[f"layers.{i}.norm.weight"] = torch.rand(96, generator=g)
    grads["embed.weight"] = torch.randn(1100, 256, generator=g)
    grads["lm_head.weight"] = grads["embed.weight"]
    torch.save({"grads": grads, "step": 12}, path)
    return path


def _jobs(tmp: Path, multi: Path) -> list[dict]:
    jobs = []
    for name in SAMPLE_FILES:
        for fmt in ("table", "json"):
            jobs.append({"args": ["inspect", str(SAMPLES / name), "--format", fmt]})
    for extra in ([], ["--norm-type", "3", "--group-by", "tensor"], ["--norm-type", "inf"],
                  ["--norm-type", "0.7", "--max-norm", "10"]):
        for fmt in ("table", "json"):
            jobs.append({"args": ["inspect", str(multi), "--format", fmt, *extra]})
    for fmt in ("table", "json"):
        jobs.append({"args": ["clip", str(multi), "--max-norm", "1", "--format", fmt,
                              "-o", str(tmp / f"clipped.{fmt}.pt")]})
    # trend and compare: every checkpoint split across the ranks, one report.
    jobs.append({"args": ["trend", str(SAMPLES / "healthy.pt"), str(multi),
                          str(SAMPLES / "exploding.pt"), "--format", "json"]})
    jobs.append({"args": ["compare", str(SAMPLES / "healthy.pt"),
                          str(SAMPLES / "exploding.pt"), "--format", "markdown"]})
    for fmt in ("table", "json"):
        jobs.append({"args": ["inspect", str(multi), "--format", fmt], "fail_rank": 1,
                     "expect_error": True})
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    multi = multi_tensor_checkpoint(tmp / "multi.pt")
    jobs = _jobs(tmp, multi)
    jobs_file = write_jobs(tmp, jobs)
    single, launched = tmp / "single", tmp / "launched"
    single.mkdir()
    launched.mkdir()
    one = one_process(jobs_file, single)
    assert one.returncode == 0, one.stderr
    for fmt in ("table", "json"):
        shutil.move(tmp / f"clipped.{fmt}.pt", tmp / f"clipped.{fmt}.single.pt")
    two = torchrun(HARNESS, jobs_file, launched)
    assert two.returncode == 0, two.stderr
    n = len(jobs)
    return {"jobs": jobs, "tmp": tmp, "multi": multi, "single": results(single, 0, n),
            "ranks": [results(launched, r, n) for r in range(2)]}


def test_two_ranks_print_the_one_process_report(runs):
    checked = 0
    for i, job in enumerate(runs["jobs"]):
        if job.get("expect_error"):
            continue
        code, out, err = runs["single"][i]
        (code0, out0, err0), (code1, out1, err1) = (r[i] for r in runs["ranks"])
        assert (code0, code1) == (code, code), job["args"]
        assert out0 == out, job["args"]  # byte for byte
        assert out1 == "" and err1.strip() == "", job["args"]  # rank 1 says nothing
        checked += 1
    assert checked == len(SAMPLE_FILES) * 2 + 12


def test_clip_under_two_ranks_writes_the_one_process_file(runs):
    tmp = runs["tmp"]
    for fmt in ("table", "json"):
        one = torch.load(tmp / f"clipped.{fmt}.single.pt", weights_only=True)
        two = torch.load(tmp / f"clipped.{fmt}.pt", weights_only=True)
        assert one["step"] == two["step"] == 12
        assert one["grads"].keys() == two["grads"].keys()
        for name, t in one["grads"].items():
            assert t.dtype == two["grads"][name].dtype
            assert torch.equal(t, two["grads"][name]), name
        # the tie survives: one storage under two names
        assert two["grads"]["lm_head.weight"].data_ptr() == two["grads"]["embed.weight"].data_ptr()


def test_an_error_on_rank_1_is_reported_once_by_rank_0(runs):
    multi = runs["multi"]
    expected = f"rank 1: {multi}: cannot read: Input/output error"
    for i, job in enumerate(runs["jobs"]):
        if not job.get("expect_error"):
            continue
        (code0, out0, err0), (code1, out1, err1) = (r[i] for r in runs["ranks"])
        assert code0 == code1 == 3
        assert out1 == "" and err1 == ""
        assert [line for line in err0.splitlines() if line] == [f"gradclip: {expected}"]
        if "json" in job["args"]:
            doc = json.loads(out0)
            assert doc == {"schema": "gradclip.error/1", "exit_code": 3, "error": expected,
                           "source": str(multi)}
        else:
            assert out0 == ""
    # the group outlives the error: the next job ran as usual
    assert runs["ranks"][0][-1][0] == 3 and len(runs["ranks"][1]) == len(runs["jobs"])


def test_torchrun_module_entry_point(runs, tmp_path):
    multi = runs["multi"]
    single = [r for j, r in zip(runs["jobs"], runs["single"])
              if j["args"] == ["inspect", str(multi), "--format", "table"]][0]
    done = torchrun("-m", "gradclip_cli", "inspect", multi, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert done.stdout == single[1]
    assert "gradclip:" not in done.stderr


def test_any_launcher_and_a_rank_that_dies(runs, tmp_path):
    """Two processes started by hand (RANK, WORLD_SIZE, MASTER_ADDR/PORT: any launcher).
    Rank 1 dies while rank 0 waits for its sums: rank 0 does not hang; it
    reports the lost rank once and exits 3."""
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([{"args": ["inspect", str(runs["multi"]), "--format", "table"],
                                 "die_rank": 1}]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        rank_env = {**env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "GRADCLIP_DIST_TIMEOUT": "300"}
        procs.append(subprocess.Popen([sys.executable, str(HARNESS), str(jobs), str(tmp_path)],
                                      cwd=REPO, env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    codes = [p.wait(timeout=900) for p in procs]
    assert codes[1] == 9
    (code, out, err), = results(tmp_path, 0, 1)
    assert code == 3 and out == ""
    lines = [line for line in err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("gradclip: rank 0: lost the other ranks"), err
