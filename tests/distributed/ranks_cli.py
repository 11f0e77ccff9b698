"""Run several gradclip commands in one process, as one rank of a launched group.

    torchrun --nproc-per-node 2 tests/distributed/ranks_cli.py JOBS.json OUTDIR
    python tests/distributed/ranks_cli.py JOBS.json OUTDIR      # one process, no group

Starting torch and a process group takes seconds on a busy machine, so the
tests run every command of a check in one launch: the group is created here,
once, and gradclip uses it as it would a training script's. Each job's exit
code, stdout and stderr go to ``OUTDIR/rank{R}.job{I}.{code,out,err}``.

A job may name ``fail_rank``: on that rank alone, reading the gradients
fails as a failing disk would make it fail (an ``InputError`` naming the
file), which is how the tests see an error on one rank only. ``die_rank``:
that rank's process ends there, without a word (``os._exit``), as a killed
or crashed rank would. ``full_disk_rank``: on that rank, writing a shard of
a set (a shard, or a copied file of a DCP set) fails as a full disk makes
it fail (``ENOSPC``). ``rank_args``: ``{"R": [...]}``, the arguments rank R
runs instead of ``args``; ``rank_cwd``: ``{"R": folder}``, the folder rank R
runs the job in (a relative path then names another file on each rank, as
node-local disks make it).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
from datetime import timedelta
from pathlib import Path


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    if "RANK" in os.environ:
        import torch.distributed as dist

        timeout = float(os.environ.get("GRADCLIP_DIST_TIMEOUT", "600"))
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    # Every measurement goes through gradclip_cli/measuring.py, which calls the
    # core's tensor_power_sums.
    from gradclip_cli import cli, measuring
    from gradclip_cli.errors import InputError
    from gradclip_cli.sink import sharded_set

    modules = (measuring,)
    real = measuring.tensor_power_sums
    real_write_shard, real_copy = sharded_set._write_shard, sharded_set._copy

    def full_disk(source, out, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out))
    for index, job in enumerate(jobs):
        if job.get("fail_rank") == rank:
            path = job["args"][1]

            def failing(*args, _path=path, **kwargs):
                raise InputError(f"{_path}: cannot read: Input/output error")

            for module in modules:
                module.tensor_power_sums = failing
        if job.get("full_disk_rank") == rank:
            sharded_set._write_shard = sharded_set._copy = full_disk
        if job.get("die_rank") == rank:
            for module in modules:
                module.tensor_power_sums = lambda *args, **kwargs: os._exit(9)
        args = job.get("rank_args", {}).get(str(rank), job["args"])
        home = os.getcwd()
        os.chdir(job.get("rank_cwd", {}).get(str(rank), home))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(args)
            except SystemExit as exit_:
                code = exit_.code
        os.chdir(home)
        for module in modules:
            module.tensor_power_sums = real
        sharded_set._write_shard, sharded_set._copy = real_write_shard, real_copy
        stem = outdir / f"rank{rank}.job{index}"
        Path(f"{stem}.code").write_text(str(code))
        Path(f"{stem}.out").write_text(out.getvalue())
        Path(f"{stem}.err").write_text(err.getvalue())
    if "RANK" in os.environ:
        # Close the group with the other rank (unless a job made one die) and exit
        # without the interpreter's teardown, where gloo's threads aborted ranks
        # under load (tests/gloo.py).
        if not any("die_rank" in job for job in jobs):
            dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
