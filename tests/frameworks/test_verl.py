"""verl's FSDP checkpoints: a real run of verl's ``FSDPCheckpointManager`` on 2 gloo ranks.

The references never go through gradclip: ``verl_run.py`` loads each checkpoint
back with the same manager's ``load_checkpoint`` into a fresh FSDP2 model and
optimizer and saves their ``full_tensor()`` values; the moments' bias
corrections and updates are computed here in float64.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.support import rel_err

from .support import (
    QUANTITIES,
    TOL,
    RunsCode,
    adam_measured,
    grouped_optimizer,
    inspect_json,
    matches_reference,
    norm,
    one_line_exit_3,
    same_under_torchrun,
    weights_match_reference,
)

STEPS = (1, 2)


def _actor(run: Path, step: int) -> Path:
    return run / "run" / f"global_step_{step}" / "actor"


def _reference(run: Path, step: int) -> dict:
    return torch.load(run / "reference" / f"global_step_{step}.pt", weights_only=True)


def test_the_fixture_is_verls_layout(verl_run):
    actor = _actor(verl_run, 2)
    names = sorted(p.name for p in actor.glob("*.pt"))
    assert names == sorted(
        f"{kind}_world_size_2_rank_{rank}.pt"
        for kind in ("model", "optim", "extra_state")
        for rank in (0, 1)
    )
    assert json.loads((actor / "fsdp_config.json").read_text()) == {
        "FSDP_version": 2,
        "world_size": 2,
    }
    ref = _reference(verl_run, 2)
    # Sizes that 2 ranks do not split evenly: the shards differ.
    assert ref["weights"]["model.embed_tokens.weight"].shape == (37, 12)
    assert all(float(s["step"]) == 2 for s in ref["state"].values())


@pytest.mark.parametrize("step", STEPS)
def test_weights_against_verls_loader(gradclip, verl_run, step):
    weights = _reference(verl_run, step)["weights"]
    doc = inspect_json(gradclip, _actor(verl_run, step), "weights")
    assert (doc["format"], doc["step"], doc["what"]) == ("verl-fsdp", step, "weights")
    weights_match_reference(doc, weights)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_against_verls_loader(gradclip, verl_run, step, what):
    ref = _reference(verl_run, step)
    expected = adam_measured(*grouped_optimizer(ref), what)
    doc = inspect_json(gradclip, _actor(verl_run, step), what)
    assert (doc["format"], doc["step"], doc["what"]) == ("verl-fsdp", step, what)
    matches_reference(doc, expected, ref["weights"])


def test_second_moment_against_verls_loader(gradclip, verl_run):
    """``grad_rms`` is the square root of the bias-corrected ``exp_avg_sq``: its norm
    squared is the sum of ``exp_avg_sq / (1 - beta2^step)``, checked here from the raw
    moments."""
    state, hyper = grouped_optimizer(_reference(verl_run, 2))
    total = sum(
        float(s["exp_avg_sq"].double().sum()) / (1 - hyper[n]["betas"][1] ** float(s["step"]))
        for n, s in state.items()
    )
    doc = inspect_json(gradclip, _actor(verl_run, 2), "grad_rms")
    assert rel_err(doc["total_norm"] ** 2, total) <= 2 * TOL


def test_auto_measures_the_first_moment(gradclip, verl_run):
    assert inspect_json(gradclip, _actor(verl_run, 2), "auto")["what"] == "exp_avg"


def test_no_gradients_says_what_it_holds(gradclip, verl_run):
    result = gradclip("inspect", _actor(verl_run, 2), "--what", "grads")
    one_line_exit_3(result, "verl FSDP checkpoint saves no gradients", "--what weights")
    keyed = gradclip("inspect", _actor(verl_run, 2), "--key", "model")
    one_line_exit_3(keyed, "--key 'model'", "saves no gradients")


def test_trust_pickle_reads_torchs_own_dtensors_alike(gradclip, verl_run):
    """With --trust-pickle torch unpickles its real DTensors: the same numbers."""
    for what in ("weights", "update"):
        plain = inspect_json(gradclip, _actor(verl_run, 2), what)
        trusted = gradclip(
            "inspect", _actor(verl_run, 2), "--what", what, "--format", "json", "--trust-pickle"
        )
        assert trusted.code == 0, trusted.err
        assert trusted.json()["tensors"] == plain["tensors"]


def test_tied_embedding_is_one_parameter(gradclip, verl_tied_run):
    """``lm_head.weight`` is ``model.embed_tokens.weight``: both weights listed, the
    moments once, under the embedding's name, as verl's loader has them."""
    ref = _reference(verl_tied_run, 2)
    assert "lm_head.weight" in ref["weights"] and "lm_head.weight" not in ref["state"]
    weights = inspect_json(gradclip, _actor(verl_tied_run, 2), "weights")
    rows = {t["name"]: t for t in weights["tensors"]}
    assert set(rows) == set(ref["weights"])
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([ref["weights"][name]])) <= TOL, name
    for what in QUANTITIES:
        expected = adam_measured(*grouped_optimizer(ref), what)
        doc = inspect_json(gradclip, _actor(verl_tied_run, 2), what)
        rows = {t["name"]: t for t in doc["tensors"]}
        assert set(rows) == set(expected), what
        for name, row in rows.items():
            assert rel_err(row["norm"], norm([expected[name]])) <= TOL, (what, name)
        assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL, what


# --------------------------------------------------------------------- hostile copies


@pytest.fixture
def copy(verl_run, tmp_path) -> Path:
    target = tmp_path / "global_step_2" / "actor"
    shutil.copytree(_actor(verl_run, 2), target)
    return target


def test_truncated_rank_file(gradclip, copy):
    shard = copy / "model_world_size_2_rank_1.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    one_line_exit_3(
        gradclip("inspect", copy, "--what", "weights"), "truncated", "model_world_size_2_rank_1.pt"
    )


@pytest.mark.parametrize("kind", ["model", "optim"])
def test_missing_rank(gradclip, copy, kind):
    (copy / f"{kind}_world_size_2_rank_1.pt").unlink()
    one_line_exit_3(
        gradclip("inspect", copy, "--what", "exp_avg"),
        f"{kind}_world_size_2_rank_1.pt: missing",
        "rank 1 of 2",
    )


def test_rank_file_from_another_world_size(gradclip, copy):
    shutil.copy(copy / "model_world_size_2_rank_0.pt", copy / "model_world_size_4_rank_3.pt")
    one_line_exit_3(
        gradclip("inspect", copy, "--what", "weights"),
        "model_world_size_4_rank_3.pt",
        "world size of 4",
        "fsdp_config.json says 2",
    )


def test_rank_file_copied_under_another_ranks_name(gradclip, copy):
    shutil.copy(copy / "optim_world_size_2_rank_0.pt", copy / "optim_world_size_2_rank_1.pt")
    one_line_exit_3(
        gradclip("inspect", copy, "--what", "update"),
        "optim_world_size_2_rank_1.pt",
        "holds the shards of rank 0",
    )


def test_ranks_naming_other_tensors(gradclip, copy):
    file = copy / "model_world_size_2_rank_1.pt"
    state = torch.load(file, weights_only=False)  # the fixture's own file: trusted
    renamed = {("model.renamed" if i == 0 else k): v for i, (k, v) in enumerate(state.items())}
    torch.save(renamed, file)
    one_line_exit_3(
        gradclip("inspect", copy, "--what", "weights"),
        "model_world_size_2_rank_1.pt",
        "'model.renamed'",
        "not of one model",
    )


def test_pickle_that_runs_code_is_refused(gradclip, copy, tmp_path):
    marker = tmp_path / "ran"
    file = copy / "model_world_size_2_rank_0.pt"
    state = torch.load(file, weights_only=False)  # the fixture's own file: trusted
    state["model.norm.weight"] = RunsCode(marker)
    torch.save(state, file)
    one_line_exit_3(
        gradclip("inspect", copy, "--what", "weights"),
        "refused",
        "--trust-pickle",
        "model_world_size_2_rank_0.pt",
    )
    assert not marker.exists()


def test_fsdp1_checkpoint_is_refused_saying_so(gradclip, copy):
    (copy / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 2}))
    one_line_exit_3(gradclip("inspect", copy), "FSDP1", "ShardedTensor")


# --------------------------------------------------------------------- under torchrun


def test_two_ranks_print_the_one_process_report(verl_run, tmp_path):
    jobs = [
        {
            "args": [
                "inspect",
                str(_actor(verl_run, 2)),
                "--what",
                what,
                "--format",
                fmt,
                "--no-progress",
            ]
        }
        for what in (*QUANTITIES, "weights", "auto")
        for fmt in ("table", "json")
    ]
    same_under_torchrun(jobs, tmp_path)
