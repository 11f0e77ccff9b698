"""``inspect --previous`` on DeepSpeed's own checkpoints: no layout code of its own.

The stage-0 runs of ``deepspeed_runs.py`` save ``global_step1/`` and
``global_step2/`` of one run (DeepSpeed's torch AdamW in fp32; its fp16 and
bf16 optimizers' fp32 master moments). The pair is read as ``--what exp_avg``
reads one checkpoint, and the second moments agree with the reconstructed
gradients to within the cross-check's bound: two independent files of a real
run tell the same story, to the rounding of their float32 state. (The
reference beside the runs holds the last step's state alone, not the
gradients, so the norms are compared with nothing else here;
tests/cli/test_cli_previous.py compares them with saved gradients.)
"""

from __future__ import annotations

import json

import pytest

from gradclip_cli.source.previous import CHECK_BOUND
from tests.hardening.support import run_cli


@pytest.mark.parametrize("run, kind, steps", [
    ("zero0", "AdamW", (1, 2)),
    # DeepSpeed's fp16/bf16 optimizers take one step with zero gradients to create their
    # state: their Adam counts one more step than the engine.
    ("zero0_bf16", "AdamW", (2, 3)),
    ("zero0_fp16", "AdamW", (2, 3)),
])
def test_consecutive_deepspeed_checkpoints(deepspeed_runs, run, kind, steps):
    curr, prev = deepspeed_runs / run / "global_step2", deepspeed_runs / run / "global_step1"
    result = run_cli("inspect", curr, "--previous", prev, "--format", "json")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert doc["what"] == "grads"
    before, after = steps
    assert doc["measured"]["evidence"] == (
        f"reconstructed from the {kind} states of steps {before} and {after} in {prev} "
        f"and {curr}")
    check = doc["measured"]["cross_check"]
    assert check["max_units"] <= CHECK_BOUND and check["unit"] == 2.0**-24
    assert doc["num_tensors"] == 4  # the frozen layer has no state: no gradient
    assert 0 < doc["total_norm"] < float("inf")


def test_a_deepspeed_pair_of_two_runs_is_refused(deepspeed_runs):
    # The fp16 run's step 2 and the bf16 run's step 1: the same model, Adam counters 3
    # and 2, every shape the same; the second moments say they are not one step apart.
    curr = deepspeed_runs / "zero0_fp16" / "global_step2"
    prev = deepspeed_runs / "zero0_bf16" / "global_step1"
    result = run_cli("inspect", curr, "--previous", prev)
    assert result.code == 3
    assert len(result.err.strip().splitlines()) == 1
    assert str(curr) in result.err and str(prev) in result.err
    assert "exp_avg_sq disagrees" in result.err and "not one AdamW step apart" in result.err
