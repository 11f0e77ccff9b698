"""Ranks given different command lines or different files stop before any work (exit 3).

Rank 0 reading ``g0.pt`` (norm 44.72) and rank 1 ``g1.pt`` (norm 447.2) once
gave a report of 317.80, a number of neither file, and ``clip`` wrote a copy
of norm 0.14 for ``--max-norm 1``. Now every rank exits 3, rank 0 prints one
line naming the ranks that differ, rank 1 prints nothing, and nothing is
written. The same path naming different files on each rank (node-local
disks: here each rank runs in its own folder) is caught by the files'
identity, even with the same size and modification time; identical copies
(the same bytes and times under different folders) are one input.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from gradclip_cli.distributed.agreement import input_identity
from tests.distributed.launch import HARNESS, results, torchrun, write_jobs


def gradients(scale: float) -> dict:
    """Four tensors (so both ranks read a share) of total norm ``scale * sqrt(20)``."""
    return {"grads": {f"layers.{i}.weight": torch.full((5,), scale) for i in range(4)}, "step": 3}


def norm(scale: float) -> float:
    return float(torch.tensor([scale] * 20, dtype=torch.float64).norm())


LINE_DIFFERS = (
    "gradclip: the ranks were not given the same command line: rank 1 differs "
    "from rank 0; every rank must run the same command on the same files "
    "(nothing was read or written)"
)


def files_differ(name: str) -> str:
    return (
        "gradclip: the ranks do not see the same input files: rank 1 differs from rank 0 "
        f"in {name} (size, modification time or header); every rank must read the same "
        "files (nothing was read or written)"
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    g0, g1 = tmp / "g0.pt", tmp / "g1.pt"
    torch.save(gradients(10.0), g0)
    torch.save(gradients(100.0), g1)
    # The same name in each rank's folder: other bytes, then also the same size and times.
    rank_dirs = {}
    for label, second in (("other", g1), ("same_times", g1), ("copy", g0)):
        folders = [tmp / label / "r0", tmp / label / "r1"]
        for folder in folders:
            folder.mkdir(parents=True)
        shutil.copy2(g0, folders[0] / "g.pt")
        shutil.copy2(second, folders[1] / "g.pt")
        rank_dirs[label] = {str(r): str(f) for r, f in enumerate(folders)}
    times = os.stat(g0)
    os.utime(tmp / "same_times" / "r1" / "g.pt", ns=(times.st_atime_ns, times.st_mtime_ns))
    assert os.path.getsize(g0) == os.path.getsize(g1)  # only the bytes tell them apart
    out = tmp / "out"
    out.mkdir()
    jobs = [
        # the example: each rank names its own file
        {
            "args": ["inspect", "-"],
            "rank_args": {
                "0": ["inspect", str(g0), "--format", "json"],
                "1": ["inspect", str(g1), "--format", "json"],
            },
        },
        {
            "args": ["clip", "-"],
            "rank_args": {
                "0": ["clip", str(g0), "--max-norm", "1", "-o", str(out / "c.pt")],
                "1": ["clip", str(g1), "--max-norm", "1", "-o", str(out / "c.pt")],
            },
        },
        # the same file, one flag more on rank 1
        {
            "args": ["inspect", str(g0)],
            "rank_args": {"1": ["inspect", str(g0), "--max-norm", "50"]},
        },
        # one command line, a relative path naming other files
        {"args": ["inspect", "g.pt", "--format", "json"], "rank_cwd": rank_dirs["other"]},
        {"args": ["clip", "g.pt", "--max-norm", "1", "-o", "c.pt"], "rank_cwd": rank_dirs["other"]},
        {"args": ["inspect", "g.pt"], "rank_cwd": rank_dirs["same_times"]},
        {
            "args": ["trend", "g.pt", str(g0), "--format", "json"],
            "rank_cwd": rank_dirs["same_times"],
        },
        # identical copies agree, and the work goes on
        {"args": ["inspect", "g.pt", "--format", "json"], "rank_cwd": rank_dirs["copy"]},
    ]
    jobs_file = write_jobs(tmp, jobs)
    done = torchrun(HARNESS, jobs_file, out)
    assert done.returncode == 0, done.stderr
    return {
        "tmp": tmp,
        "out": out,
        "dirs": rank_dirs,
        "g0": g0,
        "ranks": [results(out, r, len(jobs)) for r in range(2)],
    }


def _refused(launched, i: int, line: str) -> str:
    (code0, out0, err0), (code1, out1, err1) = (r[i] for r in launched["ranks"])
    assert (code0, code1) == (3, 3)
    assert (out1, err1) == ("", "")  # rank 1 says nothing
    assert [x for x in err0.splitlines() if x] == [line]
    assert "317.8" not in out0 + err0
    return out0


def test_ranks_reading_g0_and_g1_report_nothing(launched):
    out = _refused(launched, 0, LINE_DIFFERS)
    doc = json.loads(out)
    assert doc["schema"] == "gradclip.error/1" and doc["exit_code"] == 3
    assert doc["error"] == LINE_DIFFERS.removeprefix("gradclip: ")
    assert "total_norm" not in doc


def test_clip_with_different_inputs_writes_nothing(launched):
    assert _refused(launched, 1, LINE_DIFFERS) == ""
    assert _refused(launched, 4, files_differ("g.pt")) == ""
    # the launch's own result files alone: no copy, no temporary file
    assert [p.name for p in launched["out"].iterdir() if not p.name.startswith("rank")] == []
    for folder in launched["dirs"]["other"].values():
        assert os.listdir(folder) == ["g.pt"]


def test_one_flag_more_on_one_rank(launched):
    assert _refused(launched, 2, LINE_DIFFERS) == ""


def test_one_path_naming_other_files(launched):
    doc = json.loads(_refused(launched, 3, files_differ("g.pt")))
    assert doc["error"] == files_differ("g.pt").removeprefix("gradclip: ")


def test_same_size_and_times_other_bytes(launched):
    assert _refused(launched, 5, files_differ("g.pt")) == ""
    out = _refused(launched, 6, files_differ("g.pt"))  # only the differing input is named
    assert json.loads(out)["exit_code"] == 3


def test_identical_copies_agree(launched):
    (code0, out0, err0), (code1, out1, _) = (r[7] for r in launched["ranks"])
    assert (code0, code1) == (0, 0), err0
    assert out1 == ""
    assert json.loads(out0)["total_norm"] == pytest.approx(norm(10.0), rel=1e-6)


def _write(path: Path, data: bytes, like: os.stat_result | None = None) -> None:
    path.write_bytes(data)
    if like is not None:
        os.utime(path, ns=(like.st_atime_ns, like.st_mtime_ns))


def test_a_folder_identity_covers_every_file_cheaply(tmp_path):
    folder = tmp_path / "set"
    (folder / "sub").mkdir(parents=True)
    _write(folder / "model.safetensors.index.json", b'{"weight_map": {"a": "x"}}')
    big = bytes(range(256)) * 4096 * 2  # 2 MiB: only its first and last 64 KiB are hashed
    _write(folder / "sub" / "shard.bin", big)
    first = input_identity(str(folder))
    assert input_identity(str(folder)) == first
    # the index's bytes change, its size and times do not
    index = folder / "model.safetensors.index.json"
    like = os.stat(index)
    _write(index, b'{"weight_map": {"b": "x"}}', like)
    assert input_identity(str(folder)) != first
    _write(index, b'{"weight_map": {"a": "x"}}', like)
    assert input_identity(str(folder)) == first
    # a shard's header changes; a byte in its middle is not read (cheap by design)
    shard = folder / "sub" / "shard.bin"
    like = os.stat(shard)
    _write(shard, b"\x01" + big[1:], like)
    assert input_identity(str(folder)) != first
    middle = len(big) // 2
    _write(shard, big[:middle] + b"\x01" + big[middle + 1 :], like)
    assert input_identity(str(folder)) == first
    assert input_identity(str(folder)) == first
    # a new file, or a file's time
    (folder / "latest").write_text("step1")
    assert input_identity(str(folder)) != first
    os.unlink(folder / "latest")
    os.utime(shard, ns=(like.st_atime_ns, like.st_mtime_ns + 1))
    assert input_identity(str(folder)) != first


def test_special_files_are_never_opened(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "link").symlink_to("/dev/zero")
    # a FIFO with no writer would block an open for reading; /dev/zero never ends
    assert input_identity(str(fifo)) == input_identity(str(fifo))
    assert input_identity(str(tmp_path)) == input_identity(str(tmp_path))
    assert input_identity(str(tmp_path / "missing")) != input_identity(str(fifo))
