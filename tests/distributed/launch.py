"""Running gradclip commands as ranks of a launched group, for the tests.

``run_jobs`` runs a list of commands twice: once in one process (no
launcher), once under ``torchrun`` with 2 gloo ranks, each through
``ranks_cli.py`` so that torch and the process group start once per launch.

Timeouts are sized for a loaded machine (a load average of 10 on 2 cores
makes a launch of many jobs take minutes): each collective may wait
``COLLECTIVE_TIMEOUT_S`` for the other rank (a rank that hangs or dies is
caught there), and a whole launch ``LAUNCH_TIMEOUT_S``, a last resort only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("ranks_cli.py")
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

Result = tuple[int, str, str]  # exit code, stdout, stderr
COLLECTIVE_TIMEOUT_S = 600
LAUNCH_TIMEOUT_S = 3600


def env() -> dict[str, str]:
    """This environment without a launcher's variables, and a collective timeout."""
    out = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    out["GRADCLIP_DIST_TIMEOUT"] = str(COLLECTIVE_TIMEOUT_S)
    return out


def torchrun(*args: object, ranks: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", *map(str, args)]
    return subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)


def killed_by_signal(done: subprocess.CompletedProcess) -> bool:
    """Whether a ``torchrun`` failed because a rank was killed by a signal (torchrun's
    "Signal 6 (SIGABRT) received by PID ..."), not by an exception of its own.

    A gloo rank can abort in C++ ("terminate called without an active
    exception"), seen in CI runs where the same code passed before and after;
    launches that can be repeated run again once then, as the spawned-rank
    fixtures do (``tests/layouts/conftest.py``).
    """
    signalled = re.search(r"Signal \d+ \(SIG\w+\) received", done.stderr)
    return done.returncode != 0 and signalled is not None


def one_process(jobs_file: Path, outdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HARNESS), str(jobs_file), str(outdir)],
                          cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)


def results(outdir: Path, rank: int, count: int) -> list[Result]:
    stems = [outdir / f"rank{rank}.job{i}" for i in range(count)]
    return [(int(Path(f"{s}.code").read_text()), Path(f"{s}.out").read_text(),
             Path(f"{s}.err").read_text()) for s in stems]


def write_jobs(folder: Path, jobs: list[dict]) -> Path:
    path = folder / "jobs.json"
    path.write_text(json.dumps(jobs))
    return path


def same_under_torchrun(jobs: list[dict], tmp_path: Path) -> None:
    """Each job alone and as 2 gloo ranks: rank 0 prints the one-process output byte for byte,
    rank 1 nothing, every rank the same exit code (0). A launch whose rank was killed by a
    signal (``killed_by_signal``) runs once more."""
    jobs_file = write_jobs(tmp_path, jobs)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    done = one_process(jobs_file, one)
    assert done.returncode == 0, done.stderr
    for attempt in (1, 2):
        if two.exists():
            shutil.rmtree(two)
        two.mkdir()
        launched = torchrun(HARNESS, jobs_file, two)
        if attempt == 2 or not killed_by_signal(launched):
            break
    assert launched.returncode == 0, launched.stderr[-3000:]
    single = results(one, 0, len(jobs))
    ranks = [results(two, r, len(jobs)) for r in range(2)]
    for job, (code, out, err), (code0, out0, _), (code1, out1, err1) in zip(jobs, single, *ranks):
        assert code == 0, (job["args"], err)
        assert (code0, code1) == (code, code), job["args"]
        assert out0 == out, job["args"]  # byte for byte
        assert out1 == "" and err1.strip() == "", job["args"]
