"""The pretraining frameworks' reports name the evidence each layout had
(docs/reference/contract.md, roles), in every format: files and entries of torchtitan,
OLMo-core and Megatron ``torch_dist`` checkpoints their own saving code wrote."""

from __future__ import annotations

import pytest

from tests.evidence_support import assert_evidence_everywhere

_TITAN = "a torchtitan checkpoint: .metadata's train_state.step"
_OLMO = "an OLMo-core checkpoint: .metadata.json and model_and_optim/"
_MEGATRON = "a torch_dist checkpoint: metadata.json sharded_backend torch_dist"


@pytest.mark.parametrize(("step", "what", "measured", "evidence"), [
    (2, "auto", "exp_avg", f"{_TITAN}, optimizer.state.<fqn> entries"),
    (2, "weights", "weights", f"{_TITAN}, model keys at the top level"),
    (3, "auto", "weights", "a torchtitan weights-only export: step-3/ of model tensors alone"),
])  # fmt: skip
def test_torchtitan(gradclip, torchtitan_runs, step, what, measured, evidence):
    folder = torchtitan_runs[1] / "run" / "checkpoint" / f"step-{step}"
    assert_evidence_everywhere(gradclip, folder, what, measured, evidence)


@pytest.mark.parametrize(("what", "evidence"), [
    ("update", f"{_OLMO}'s optim entries"),
    ("weights", f"{_OLMO}'s model entries"),
])  # fmt: skip
def test_olmo_core(gradclip, olmo_core_runs, what, evidence):
    folder = olmo_core_runs[1] / "run" / "step2"
    assert_evidence_everywhere(gradclip, folder, what, what, evidence)


@pytest.mark.parametrize(("what", "evidence"), [
    ("grad_rms", f"{_MEGATRON}, optimizer.state entries, common.pt's step and betas"),
    ("weights", _MEGATRON),
])  # fmt: skip
def test_megatron_torch_dist(gradclip, megatron_runs, what, evidence):
    folder = megatron_runs[1] / "run" / "iter_0000002"
    assert_evidence_everywhere(gradclip, folder, what, what, evidence)


@pytest.mark.parametrize(("kind", "what", "evidence"), [
    ("fp32", "weights", "model"),
    ("fp32", "exp_avg", "optimizer"),
    ("tp2", "weights", "optimizer fp32_from_fp16_params"),
])  # fmt: skip
def test_megatron_legacy(gradclip, megatron_lm_runs, kind, what, evidence):
    folder = megatron_lm_runs[kind] / "run" / "iter_0000002"
    said = "a Megatron legacy checkpoint: mp_rank_XX/model_optim_rng.pt"
    assert_evidence_everywhere(gradclip, folder, what, what, f"{said}'s {evidence}")
