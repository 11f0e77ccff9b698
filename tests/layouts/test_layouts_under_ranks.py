"""Every checkpoint layout under ``torchrun``: 2 gloo ranks print the one-process report.

The real fixtures of this folder (``save_pretrained`` and
``save_torch_state_dict`` sets, a Trainer ``checkpoint-N/``, a Lightning
``.ckpt`` file and a sharded ``.ckpt`` folder, FSDP2 DCP folders with
``.metadata`` and in the Hugging Face layout, accelerate's FSDP folder,
DeepSpeed ZeRO-2 and ZeRO-3 folders, a Trainer + DeepSpeed ``checkpoint-N/``)
are inspected with several ``--what`` once in one process and once under
``torchrun --nproc-per-node 2``; rank 0's report must be the same byte for
byte, and rank 1 says nothing. ``clip`` of a gradient set writes each shard
from the rank that read it: the set it writes is the one-process set, file for
file (a DCP Hugging Face set's replicated piece too, scaled alike by the two
ranks whose files hold it), and a full disk on rank 1 is reported once, naming
rank 1, with the input untouched and nothing left behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import (
    HARNESS,
    killed_by_signal,
    one_process,
    results,
    torchrun,
    write_jobs,
)

WHATS = {
    "pretrained": ["auto", "weights"],
    "pretrained_bin": ["weights"],
    "trainer": ["auto", "exp_avg", "grad_rms", "update", "weights"],
    "lightning": ["auto", "grads", "exp_avg", "update", "weights"],
    "dcp": ["auto", "exp_avg", "update", "weights"],
    "lightning_sharded": ["auto", "update"],
    "dcp_hf": ["weights"],
    "zero2": ["auto", "grad_rms", "weights"],
    "zero3": ["update"],
    "accelerate_fsdp": ["auto", "update", "weights"],
    "deepspeed_trainer": ["auto", "weights"],
}


def _gradient_set(folder: Path, dtype: torch.dtype, seed: int) -> None:
    """A set of saved gradients, sharded by huggingface_hub, plus a file that is not a shard."""
    from huggingface_hub import save_torch_state_dict

    g = torch.Generator().manual_seed(seed)
    grads = {f"h.{i}.w": (torch.randn(3000, generator=g) * (i + 1)).to(dtype) for i in range(8)}
    grads["h.0.half"] = torch.randn(64, generator=g).half()
    folder.mkdir()
    save_torch_state_dict(grads, folder, max_shard_size=16000, metadata={"producer": "test"})
    (folder / "README.txt").write_text("not a shard: copied as it is\n")


def _digests(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
            for n in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, sharded_pretrained, sharded_bin, trainer_run, lightning_ckpt,
             lightning_sharded, dcp_checkpoint, dcp_hf_checkpoint, dcp_hf_grads,
             deepspeed_runs, accelerate_fsdp_run, deepspeed_trainer_run):
    tmp = tmp_path_factory.mktemp("layouts_ranks")
    paths = {"pretrained": sharded_pretrained, "pretrained_bin": sharded_bin,
             "trainer": trainer_run, "lightning": lightning_ckpt, "dcp": dcp_checkpoint,
             "lightning_sharded": lightning_sharded, "dcp_hf": dcp_hf_checkpoint,
             "zero2": deepspeed_runs / "zero2", "zero3": deepspeed_runs / "zero3",
             "accelerate_fsdp": accelerate_fsdp_run / "checkpoint-2",
             "deepspeed_trainer": deepspeed_trainer_run / "checkpoint-3"}
    jobs: list[dict] = []
    for kind, whats in WHATS.items():
        for what in whats:
            for fmt in ("table", "json"):
                jobs.append({"args": ["inspect", str(paths[kind]), "--what", what,
                                      "--format", fmt, "--no-progress"]})
    jobs.append({"args": ["inspect", str(trainer_run), "--what", "exp_avg", "--group-by",
                          "tensor", "--norm-type", "inf", "--no-progress"]})
    # trend: every checkpoint's pieces shared by the ranks, one report
    jobs.append({"args": ["trend", str(trainer_run), str(lightning_ckpt), str(dcp_checkpoint),
                          "--what", "exp_avg", "--format", "json"]})
    jobs.append({"args": ["trend", str(accelerate_fsdp_run), "--what", "update"]})
    lone = sorted(sharded_pretrained.glob("model-*.safetensors"))[1]
    jobs.append({"args": ["inspect", str(lone), "--format", "json"]})
    grads, halves = tmp / "grads", tmp / "halves"
    _gradient_set(grads, torch.float32, 5)
    _gradient_set(halves, torch.bfloat16, 6)
    pristine = {folder: tmp / f"{folder.name}.pristine" for folder in (grads, halves)}
    for folder, copy in pristine.items():
        shutil.copytree(folder, copy)
    clips = [
        ["clip", str(grads), "--max-norm", "1", "--format", "json", "-o", str(tmp / "out")],
        # a DCP folder's gradients: the ranks share the reading, rank 0 writes the set
        ["clip", str(dcp_checkpoint), "--max-norm", "0.01", "--format", "json",
         "-o", str(tmp / "dcp_out")],
        ["clip", str(grads), "--clip-value", "0.5", "--no-progress", "-o", str(tmp / "outv")],
        # bf16: rounding leaves the total above 0.5 unless the coefficient is lowered
        ["clip", str(halves), "--max-norm", "0.5", "--format", "json"],
        ["clip", str(grads), "--max-norm", "2", "--in-place", "--format", "json"],
        # DCP's HF layout: each rank writes its safetensors file, both the replicated piece
        ["clip", str(dcp_hf_grads), "--max-norm", "1", "--format", "json",
         "-o", str(tmp / "dcp_hf_out")],
        ["clip", str(dcp_hf_grads), "--clip-value", "1", "--format", "json",
         "-o", str(tmp / "dcp_hf_outv")],
    ]
    jobs += [{"args": args} for args in clips]
    for source, name in ((grads, "never"), (dcp_checkpoint, "never_dcp"),
                         (dcp_hf_grads, "never_dcp_hf")):
        jobs.append({"args": ["clip", str(source), "--max-norm", "1", "--format", "json",
                              "-o", str(tmp / name)], "full_disk_rank": 1})
    jobs_file = write_jobs(tmp, jobs)
    outputs = [tmp / "out", tmp / "dcp_out", tmp / "outv", tmp / "halves.clipped", grads,
               tmp / "dcp_hf_out", tmp / "dcp_hf_outv"]

    one, two = tmp / "one", tmp / "two"
    one.mkdir()
    two.mkdir()
    done = one_process(jobs_file, one)
    assert done.returncode == 0, done.stderr
    single_sets = {}
    for out in outputs:
        single_sets[out] = tmp / f"{out.name}.single"
        shutil.copytree(out, single_sets[out])
        if out != grads:  # the in-place job's input is put back below
            shutil.rmtree(out)
    for attempt in (1, 2):
        for out in [*outputs, *(tmp / n for n in ("never", "never_dcp", "never_dcp_hf"))]:
            # (one process has no rank 1 to fail: its never* sets are removed too)
            if out != grads and out.exists():
                shutil.rmtree(out)
        for folder, copy in pristine.items():
            if folder.exists():
                shutil.rmtree(folder)
            shutil.copytree(copy, folder)
        shutil.rmtree(two)
        two.mkdir()
        done = torchrun(HARNESS, jobs_file, two)
        if attempt == 2 or not killed_by_signal(done):
            break
        warnings.warn("a rank was killed by a signal; the launch runs again", stacklevel=1)
    assert done.returncode == 0, done.stderr
    n = len(jobs)
    return {"jobs": jobs, "tmp": tmp, "single": results(one, 0, n),
            "ranks": [results(two, r, n) for r in range(2)], "sets": single_sets,
            "grads": grads, "pristine": pristine[grads]}


def test_two_ranks_print_the_one_process_report_for_every_layout(launched):
    checked = 0
    for i, job in enumerate(launched["jobs"]):
        if "full_disk_rank" in job:
            continue
        code, out, err = launched["single"][i]
        (code0, out0, _), (code1, out1, err1) = (r[i] for r in launched["ranks"])
        assert code == 0, (job["args"], err)
        assert (code0, code1) == (code, code), job["args"]
        assert out0 == out, job["args"]  # byte for byte
        assert out1 == "" and err1.strip() == "", job["args"]
        checked += 1
    assert checked == 2 * sum(map(len, WHATS.values())) + 4 + 7


def test_each_rank_writes_its_shards_of_the_one_process_set(launched):
    for launched_set, single_set in launched["sets"].items():
        assert _digests(launched_set) == _digests(single_set), launched_set.name
    reports = {tuple(job["args"]): launched["ranks"][0][i][1]
               for i, job in enumerate(launched["jobs"])}
    halves = [out for args, out in reports.items() if "0.5" in args and "halves" in args[1]]
    assert '"coef_lowered": true' in halves[0]  # the lowering loop ran under the ranks too


def test_a_full_disk_on_rank_1_is_reported_once_and_changes_nothing(launched):
    """Rank 1 writes shards of every set (an HF set's shard, a DCP set's .distcp copy, a
    DCP HF set's safetensors file): its failure is rank 0's one line, and neither the
    target nor a temporary folder stays."""
    tmp = launched["tmp"]
    failing = [(i, job) for i, job in enumerate(launched["jobs"]) if "full_disk_rank" in job]
    assert len(failing) == 3
    for i, job in failing:
        (code0, out0, err0), (code1, out1, err1) = (r[i] for r in launched["ranks"])
        target = Path(job["args"][-1])
        assert code0 == code1 == 3
        assert out1 == "" and err1 == ""
        lines = [line for line in err0.splitlines() if line]
        assert lines == [f"gradclip: rank 1: {target}: cannot write: no space left on the "
                         "device; nothing was changed"], err0
        assert '"exit_code": 3' in out0
        assert not target.exists()
        assert not [n for n in os.listdir(tmp) if n.startswith(f".{target.name}.clipped-")]
    # the input (clipped in place by the job before) is as that job left it
    assert _digests(launched["grads"]) == _digests(launched["sets"][launched["grads"]])
