"""``gradclip autopsy`` under ``torchrun``: each checkpoint's norms split across 2 gloo
ranks as ``trend`` splits them, rank 0 printing the one-process report byte for byte."""

from __future__ import annotations

from benchmarks import autopsy_rates as A
from tests.distributed.launch import same_under_torchrun


def test_autopsy_under_two_ranks_is_the_one_process_report(tmp_path):
    clean = A.make_run("torch", 1, False, tmp_path / "clean")
    spiked = A.make_run("torch", 1, True, tmp_path / "spiked")
    jobs = [
        {"args": ["autopsy", str(clean.folder), "--format", "json"]},
        # A step asked for that is clean: exit 0, with every group's changes and notes.
        {"args": ["autopsy", str(spiked.folder), "--step", "30", "--format", "json"]},
        {"args": ["autopsy", str(spiked.folder), "--step", "30", "--format", "markdown"]},
    ]
    same_under_torchrun(jobs, tmp_path)
