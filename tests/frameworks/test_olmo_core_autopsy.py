"""``gradclip autopsy`` on real OLMo-core runs with a spike injected into one known layer.

The runs (``olmo_core_spike_run.py``): OLMo-core's ``olmo2_1M`` in its
``TransformerTrainModule``, 50 steps on 1 rank, checkpointed by OLMo-core's own
``Checkpointer`` every 5 steps and at steps 34, 35, 36, watched by gradclip's
``GradMonitor``; at step 35 one layer's gradients are multiplied by 20-100 (a
different layer per seed), or nothing is (the clean runs). The autopsy must
name the injected layer first and the step; on a clean run, find nothing to
explain. The numbers it reports for the injected layer are held against the
generator's float64 reference, taken from the live model and optimizer.

The seeds (``OLMO_CORE_SPIKES``) are the first ones, fixed before any rate was
measured. Over more seeds the spike rule itself flags some clean runs: the
embeddings' gradient norm of this tiny model (128 random tokens a batch)
crosses it by noise (5 of the 20 clean seeds 0-9 and 100-109), a false alarm ``trend`` flags
too, which the autopsy then explains; ``benchmarks/autopsy_rates_olmo_core.py``
measures the rates (docs/guides/autopsy.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli.support import rel_err

from .conftest import OLMO_CORE_SPIKES
from .support import TOL, skip_without_frameworks

skip_without_frameworks()

SPIKE_STEP = 35  # as olmo_core_spike_run.py's
INJECTED = [key for key, inject in OLMO_CORE_SPIKES.items() if inject]
CLEAN = [key for key, inject in OLMO_CORE_SPIKES.items() if not inject]


def _autopsy(gradclip, run, *extra):
    result = gradclip("autopsy", run / "run", "--format", "json", *extra)
    return result.code, json.loads(result.out)


def test_the_runs_are_olmo_cores_checkpoints_and_a_monitor_log(olmo_core_spike_runs):
    run = olmo_core_spike_runs[INJECTED[0]] / "run"
    steps = sorted(int(p.name[4:]) for p in run.glob("step*"))
    assert steps == [5, 10, 15, 20, 25, 30, 34, 35, 36, 40, 45, 50]
    assert (
        b"olmo_core.distributed.checkpoint.filesystem"
        in (run / "step35" / "model_and_optim" / ".metadata").read_bytes()
    )
    lines = (run / "grads.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 51))


@pytest.mark.parametrize("key", INJECTED, ids=lambda k: f"seed{k[1]}")
def test_the_injected_layer_is_named_first_at_its_step(gradclip, olmo_core_spike_runs, key):
    layer, factor = OLMO_CORE_SPIKES[key]
    run = olmo_core_spike_runs[key]
    code, doc = _autopsy(gradclip, run)
    assert (code, doc["status"], doc["step"]) == (1, "explained", SPIKE_STEP)
    first = doc["groups"][0]
    assert (first["name"], first["onset"]) == (layer, SPIKE_STEP), doc["verdict"]
    assert doc["verdict"].startswith(f"step {SPIKE_STEP}: spike; began in {layer} at step")

    reference = torch.load(run / "reference" / "spike.pt", weights_only=True)
    grads = first["changes"]["grads"]
    assert grads["after_step"] == SPIKE_STEP
    assert rel_err(grads["after"], reference["grads"][layer]) < TOL
    # The moments come from OLMo-core's checkpoints of the steps before and at the spike.
    exp_avg = first["changes"]["exp_avg"]
    assert (exp_avg["before_step"], exp_avg["after_step"]) == (SPIKE_STEP - 1, SPIKE_STEP)
    assert exp_avg["before_source"] == str(run / "run" / f"step{SPIKE_STEP - 1}")
    assert exp_avg["after_source"] == str(run / "run" / f"step{SPIKE_STEP}")
    assert rel_err(exp_avg["before"], reference["exp_avg"][SPIKE_STEP - 1][layer]) < TOL
    assert rel_err(exp_avg["after"], reference["exp_avg"][SPIKE_STEP][layer]) < TOL
    # The monitor dumped the spike's gradients: the injected layer's outliers are measured.
    assert (run / "run" / "spikes" / f"step-{SPIKE_STEP}.pt").is_file()
    assert first["outliers"] is not None and first["outliers"] > 0


@pytest.mark.parametrize("key", CLEAN, ids=lambda k: f"seed{k[1]}")
def test_a_clean_run_has_nothing_to_explain(gradclip, olmo_core_spike_runs, key):
    code, doc = _autopsy(gradclip, olmo_core_spike_runs[key])
    assert (code, doc["status"]) == (0, "nothing"), doc["verdict"]
    # Nor does the step the others were injected at, named.
    code, doc = _autopsy(gradclip, olmo_core_spike_runs[key], "--step", SPIKE_STEP)
    assert (code, doc["status"]) == (0, "nothing"), doc["verdict"]
