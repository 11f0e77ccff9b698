"""The frameworks' checkpoints, given whole or by a part: every refusal offers only what
works (docs/reference/contract.md, --what), and no path or --key makes their weights or
optimizer state gradients.

The checkpoints are the session's fixtures, written by the frameworks themselves.
Each is walked by ``walk_refusals`` over the paths a user may give for it: the
checkpoint, and its parts that are checkpoints of their own (a DCP folder's
``.metadata``, OLMo-core's ``model_and_optim/``, Megatron's ``common.pt``). The
torchtune, litgpt and timm walks are in their own test files.
"""

from __future__ import annotations

import pytest

from tests.cli.support import rel_err, walk_refusals

from .support import TOL, skip_without_frameworks

skip_without_frameworks()


def _iteration(run):
    return run / "run" / "iter_0000002"


def _titan_step(run, step):
    return run / "run" / "checkpoint" / f"step-{step}"


# fixture -> the checkpoint folders whose .metadata a user may give instead: torchtitan's
# full step and its weights-only export, Megatron's iteration (plain, the distributed
# optimizer's buckets, a Mixture-of-Experts model's chained optimizers).
DCP_FOLDERS = {
    "torchtitan_runs": lambda r: [_titan_step(r[2], 2), _titan_step(r[2], 3)],
    "megatron_runs": lambda r: [_iteration(r[1])],
    "megatron_distopt_run": lambda r: [_iteration(r)],
    "megatron_moe_ep_distopt_run": lambda r: [_iteration(r)],
}


@pytest.mark.parametrize("fixture", list(DCP_FOLDERS))
def test_a_metadata_given_itself_is_read_as_its_framework_folder(gradclip, request,
                                                                 fixture):
    """``step-N/.metadata`` or ``iter_N/.metadata`` measures what its folder does: read as
    a plain DCP folder, Megatron's flat keys (weights, moments, buckets) were one flat
    mapping measured as gradients, and torchtitan's export's weights too."""
    for folder in DCP_FOLDERS[fixture](request.getfixturevalue(fixture)):
        whole = gradclip("inspect", folder, "--format", "json").json()
        given = gradclip("inspect", folder / ".metadata", "--format", "json").json()
        assert (given["what"], given["format"]) == (whole["what"], whole["format"])
        assert whole["what"] != "grads"
        assert rel_err(given["total_norm"], whole["total_norm"]) <= TOL
        assert gradclip("inspect", folder / ".metadata", "--what", "grads").code == 3


# fixture -> the paths a user may give for it.
PATHS = {
    "torchtitan_runs": lambda r: [_titan_step(r[2], 2), _titan_step(r[2], 2) / ".metadata",
                                  _titan_step(r[1], 3) / ".metadata"],
    "olmo_core_runs": lambda r: [r[2] / "run" / "step2", r[2] / "run" / "step2" /
                                 "model_and_optim"],
    "megatron_runs": lambda r: [r[1] / "run", _iteration(r[2]) / ".metadata",
                                _iteration(r[1]) / "common.pt"],
    "megatron_distopt_run": lambda r: [_iteration(r) / ".metadata"],
    "megatron_moe_ep_distopt_run": lambda r: [_iteration(r), _iteration(r) / ".metadata"],
}


@pytest.mark.parametrize("fixture", list(PATHS))
def test_every_refusal_offers_only_what_works(gradclip, request, tmp_path, fixture):
    paths = PATHS[fixture](request.getfixturevalue(fixture))
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    assert refusals >= 2 * len(paths) and followed >= len(paths)


def test_olmo_cores_model_and_optim_folder_holds_its_optimizer(gradclip, olmo_core_runs):
    """``stepN/model_and_optim/`` alone is a DCP folder whose ``optim`` entry is the optimizer
    flattened by parameter name: measured as the step folder measures it, never offered as
    a --key for gradients (it was, and --key optim measured the moments as gradients)."""
    step = olmo_core_runs[2] / "run" / "step2"
    part = step / "model_and_optim"
    for what in ("exp_avg", "update"):
        whole = gradclip("inspect", step, "--what", what, "--format", "json").json()
        alone = gradclip("inspect", part, "--what", what, "--format", "json").json()
        assert rel_err(alone["total_norm"], whole["total_norm"]) <= TOL
    assert gradclip("inspect", part, "--format", "json").json()["what"] == "exp_avg"
    refused = gradclip("inspect", part, "--what", "grads")
    assert refused.code == 3 and "--key" not in refused.err
    assert gradclip("inspect", part, "--key", "optim", "--format", "json").json()["what"] == \
        "exp_avg"
    inside = gradclip("inspect", part, "--key", "optim.state")
    assert inside.code == 3 and "lies inside 'optim'" in inside.err
