"""Each layout's report names the evidence it had for what it measured
(docs/reference/contract.md, roles):
its own files and entries, never a generic "the layout", in every format.

Real checkpoints written by the libraries (the session's fixtures); each --what the
checkpoint holds, in JSON, the table, Markdown and JUnit.
"""

from __future__ import annotations

import pytest

from tests.evidence_support import assert_evidence_everywhere

_DS_OPTIM = "zero_pp_rank_*_mp_rank_00_optim_states.pt (2 ranks)"
_LIGHTNING = "a Lightning sharded checkpoint (meta.pt beside DCP's .metadata)"
_DCP_HF = (
    "DCP's Hugging Face layout: safetensors shards with DCP_SHARDING_INFO, a flat "
    "name -> tensor set that nothing marks as something else"
)

CASES = [
    ("dcp_checkpoint", "", "auto", "grads", "a DCP checkpoint: its 'grads' entry"),
    ("dcp_checkpoint", "", "weights", "weights", "a DCP checkpoint: its 'model' entry"),
    (
        "dcp_checkpoint",
        "",
        "update",
        "update",
        "a DCP checkpoint: its 'optim' entry, state and param_groups",
    ),
    ("dcp_hf_checkpoint", "", "grads", "grads", _DCP_HF),
    (
        "accelerate_fsdp_run",
        "checkpoint-2",
        "auto",
        "exp_avg",
        "an accelerate FSDP checkpoint: optimizer_0/",
    ),
    (
        "accelerate_fsdp_run",
        "checkpoint-2",
        "weights",
        "weights",
        "an accelerate FSDP checkpoint: pytorch_model_fsdp_0/",
    ),
    (
        "lightning_sharded",
        "",
        "grad_rms",
        "grad_rms",
        f"{_LIGHTNING}: its 'optimizer_0' entry, state and param_groups",
    ),
    ("lightning_sharded", "", "weights", "weights", f"{_LIGHTNING}: its 'state_dict' entry"),
    ("deepspeed_runs", "zero1", "auto", "exp_avg", f"a DeepSpeed checkpoint: {_DS_OPTIM}"),
    (
        "deepspeed_runs",
        "zero2",
        "weights",
        "weights",
        f"a DeepSpeed checkpoint: mp_rank_00_model_states.pt, fp32 master weights in {_DS_OPTIM}",
    ),
    (
        "deepspeed_runs",
        "zero3",
        "weights",
        "weights",
        "a DeepSpeed checkpoint: zero_pp_rank_0_mp_rank_00_model_states.pt, fp32 master weights "
        f"in {_DS_OPTIM}",
    ),
    (
        "deepspeed_tp_runs",
        "zero2_legacy",
        "grad_rms",
        "grad_rms",
        "a DeepSpeed checkpoint of 2 model-parallel ranks: "
        "zero_pp_rank_0_mp_rank_00_optim_states.pt, zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ),
]


@pytest.mark.parametrize(
    ("fixture", "sub", "what", "measured", "evidence"),
    CASES,
    ids=[f"{c[0]}-{c[1] or '.'}-{c[2]}" for c in CASES],
)
def test_each_layout_names_its_evidence(gradclip, request, fixture, sub, what, measured, evidence):
    path = request.getfixturevalue(fixture)
    assert_evidence_everywhere(gradclip, path / sub if sub else path, what, measured, evidence)


def test_a_key_into_a_dcp_folder_is_the_evidence(gradclip, dcp_checkpoint):
    doc = gradclip("inspect", dcp_checkpoint, "--key", "grads", "--format", "json").json()
    assert doc["measured"]["evidence"] == "a DCP checkpoint: --key grads"


def test_evidence_from_a_hostile_key_is_escaped_in_every_format(gradclip, tmp_path):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    key = "g\u202erads\x1b[31m"  # a bidi override and a terminal escape, both in the key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP saves as one process
        dcp.save({key: {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "ckpt"))
    shown = "a DCP checkpoint: --key g\\u202erads\\x1b[31m"
    for fmt in ("json", "table", "markdown", "junit", "github"):
        result = gradclip("inspect", tmp_path / "ckpt", "--key", key, "--format", fmt)
        assert result.code == 0, result.err
        assert "\u202e" not in result.out and "\x1b" not in result.out, fmt
    doc = gradclip("inspect", tmp_path / "ckpt", "--key", key, "--format", "json").json()
    assert doc["measured"]["evidence"] == shown
