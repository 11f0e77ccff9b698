"""OLMo-core ``stepN/``: real runs on 1 rank and on 2 FSDP gloo ranks (``olmo_core_run.py``).

References never go through gradclip: OLMo-core's own ``unshard_checkpoint``
writes each step's model and flattened optimizer state as torch files (in
the frameworks venv), and the moments' bias corrections and updates are
computed here in float64.
"""

from __future__ import annotations

import pickle
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
    flat_optimizer,
    matches_reference,
    norm,
    one_line_exit_3,
    same_under_torchrun,
    skip_without_frameworks,
)

skip_without_frameworks()

STEPS = (1, 2, 3)


def _reference(run: Path, step: int) -> tuple[dict, dict]:
    folder = run / "reference" / f"step{step}"
    return (
        torch.load(folder / "model.pt", weights_only=True),
        torch.load(folder / "optim.pt", weights_only=True),
    )


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks-fsdp"])
def run(request, olmo_core_runs) -> Path:
    return olmo_core_runs[request.param]


def test_the_fixture_is_olmo_cores_layout(run):
    folder = run / "run" / "step2"
    assert (folder / ".metadata.json").is_file() and (folder / "train" / "rank0.pt").is_file()
    with pytest.raises(Exception, match="numpy"):  # the RNG state: not weights-only loadable
        torch.load(folder / "train" / "rank0.pt", weights_only=True)
    assert (
        b"olmo_core.distributed.checkpoint.filesystem"
        in (folder / "model_and_optim" / ".metadata").read_bytes()
    )


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_against_olmo_cores_unsharding(gradclip, run, step, what):
    model, optim = _reference(run, step)
    expected = adam_measured(*flat_optimizer(optim), what)
    result = gradclip("inspect", run / "run" / f"step{step}", "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("olmo-core", step, what)
    assert set(expected) == set(model)
    matches_reference(doc, expected, model)
    groups = {g["name"]: g for g in doc["groups"]}
    layer = [f for f in expected if f.startswith("blocks.1.")]
    assert rel_err(groups["blocks.1"]["norm"], norm(expected[f] for f in layer)) <= TOL


def test_weights_and_auto(gradclip, run):
    model, _ = _reference(run, 3)
    result = gradclip("inspect", run / "run" / "step3", "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    assert rel_err(result.json()["total_norm"], norm(model.values())) <= TOL
    auto = gradclip("inspect", run / "run" / "step3", "--format", "json")
    assert auto.code == 0 and auto.json()["what"] == "exp_avg", auto.err
    grads = gradclip("inspect", run / "run" / "step3", "--what", "grads")
    one_line_exit_3(grads, "OLMo-core checkpoint saves no gradients", "--what exp_avg")
    one_line_exit_3(gradclip("inspect", run / "run" / "step3", "--key", "optim"), "--key")


def test_trend_over_the_run_folder(gradclip, run):
    result = gradclip("trend", run / "run", "--what", "update", "--format", "json")
    assert result.code == 0, result.err
    points = result.json()["points"]
    assert [p["step"] for p in points] == list(STEPS)
    for point, step in zip(points, STEPS):
        expected = adam_measured(*flat_optimizer(_reference(run, step)[1]), "update")
        assert rel_err(point["total_norm"], norm(expected.values())) <= TOL


# --------------------------------------------------------------------- hostile copies


@pytest.fixture
def copy(run, tmp_path) -> Path:
    target = tmp_path / "step2"
    shutil.copytree(run / "run" / "step2", target)
    return target


def test_train_state_outside_the_folder(gradclip, copy, tmp_path):
    outside = tmp_path / "elsewhere.pt"
    (copy / "train" / "rank0.pt").rename(outside)
    (copy / "train" / "rank0.pt").symlink_to(outside)
    one_line_exit_3(gradclip("inspect", copy), "outside its folder")


def test_truncated_train_state(gradclip, copy):
    state = copy / "train" / "rank0.pt"
    state.write_bytes(state.read_bytes()[:200])
    one_line_exit_3(gradclip("inspect", copy), "rank0.pt")


def test_metadata_json_that_is_not_json(gradclip, copy):
    (copy / ".metadata.json").write_bytes(b"{not json")
    one_line_exit_3(gradclip("inspect", copy), ".metadata.json", "not valid JSON")


def test_truncated_chunk_file(gradclip, copy):
    shard = sorted((copy / "model_and_optim").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:10])
    one_line_exit_3(gradclip("inspect", copy, "--what", "update"), shard.name)


def test_dcp_metadata_naming_other_code_is_refused(gradclip, copy, tmp_path):
    # Torch's reader cannot unpickle OLMo-core's records here (olmo_core is not installed
    # in this venv): write a fresh metadata, torch's own, that also names os.system.
    from torch.distributed.checkpoint.metadata import Metadata

    marker = tmp_path / "ran"
    meta = Metadata(state_dict_metadata={}, storage_meta=RunsCode(marker))
    (copy / "model_and_optim" / ".metadata").write_bytes(pickle.dumps(meta))
    one_line_exit_3(gradclip("inspect", copy), "refused", "--trust-pickle", ".metadata")
    assert not marker.exists()


def test_the_trainer_state_given_alone_names_its_checkpoint(gradclip, copy):
    """``stepN/train/`` (or its ``rankR.pt``) is the trainer's state alone: the refusal
    names the checkpoint folder to give instead. ``train/`` was called a run's folder of
    per-step checkpoint files (the rank in ``rank0.pt`` taken for a step), with ``trend``
    of it and ``inspect`` of ``rank0.pt`` offered, and that file's refusal offered
    ``--trust-pickle``: each of them failed."""
    for part in (copy / "train", copy / "train" / "rank0.pt"):
        for flags in ((), ("--trust-pickle",)):
            result = gradclip("inspect", part, *flags)
            one_line_exit_3(result, "OLMo-core checkpoint", f"give the checkpoint folder: {copy}")
            assert "gradclip trend" not in result.err and "--trust-pickle" not in result.err


# --------------------------------------------------------------------- under torchrun


def test_two_ranks_print_the_one_process_report(olmo_core_runs, tmp_path):
    run = olmo_core_runs[2]
    jobs = [
        {
            "args": [
                "inspect",
                str(run / "run" / "step3"),
                "--what",
                what,
                "--format",
                fmt,
                "--no-progress",
            ]
        }
        for what in (*QUANTITIES, "weights")
        for fmt in ("table", "json")
    ]
    jobs.append({"args": ["trend", str(run / "run"), "--what", "exp_avg", "--format", "json"]})
    same_under_torchrun(jobs, tmp_path)


# --------------------------------------------------------------------- gradient dumps


DUMP_STEP, SAMPLED = 2, 3  # olmo_core_run.py's
DUMPS = ("gradient_dumper", f"step{DUMP_STEP}")


def _dump(run: Path, mode: str) -> Path:
    return run.joinpath(f"dump_{mode}", *DUMPS)


def _true_gradients(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "reference" / f"grads_step{DUMP_STEP}.pt", weights_only=True)


@pytest.mark.parametrize("given", ["", "full_gradients"])
def test_a_full_dump_is_the_gradients_the_optimizer_stepped_on(gradclip, run, given):
    expected = _true_gradients(run)
    path = _dump(run, "full") / given if given else _dump(run, "full")
    result = gradclip("inspect", path, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("olmo-core-gradients", 2, "grads")
    assert "GradientDumperCallback" in doc["measured"]["evidence"]
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
        assert row["max_abs"] == pytest.approx(float(expected[name].abs().max()), rel=1e-6)


def test_a_sampled_dump_is_said_to_be_a_sample(gradclip, run):
    expected = {n: g.narrow(0, 0, min(SAMPLED, g.shape[0]))
                for n, g in _true_gradients(run).items()}
    result = gradclip("inspect", _dump(run, "sampled"), "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == "grads"
    assert "first 3 rows" in " ".join(doc["description"])
    assert "sample" in doc["measured"]["evidence"]
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    assert {t["name"]: t["shape"] for t in doc["tensors"]} == {
        n: list(t.shape) for n, t in expected.items()}
    table = gradclip("inspect", _dump(run, "sampled"))
    assert "a sample, not the whole gradients" in " ".join(table.out.split())


def test_clip_writes_a_full_dump_back_and_refuses_a_sample(gradclip, run, tmp_path):
    target = tmp_path / "work"
    shutil.copytree(run / "dump_full", target)
    step = target.joinpath(*DUMPS)
    clipped = gradclip("clip", step, "--max-norm", "0.5", "--in-place")
    assert clipped.code == 0, clipped.err
    check = gradclip("inspect", step, "--max-norm", "0.5", "--format", "json")
    assert check.code == 0, check.err
    assert check.json()["total_norm"] <= 0.5
    assert rel_err(check.json()["total_norm"], 0.5) <= 1e-5
    one_line_exit_3(gradclip("clip", _dump(run, "sampled"), "--max-norm", "1",
                             "-o", tmp_path / "out"), "first rows", "not clipped")


def test_a_damaged_sample_is_one_line(gradclip, run, tmp_path):
    target = tmp_path / "work"
    shutil.copytree(run / "dump_sampled", target)
    sampled = target.joinpath(*DUMPS, "sampled_gradients")
    first = sorted(sampled.iterdir())[0]
    renamed = first.rename(sampled / first.name.replace("_first3", "_first2"))
    one_line_exit_3(gradclip("inspect", target.joinpath(*DUMPS)), "first 2 rows")
    renamed.rename(first)
    (sampled / "notes.txt").write_text("x")
    one_line_exit_3(gradclip("inspect", target.joinpath(*DUMPS)), "not a sampled gradient")


def test_both_dumps_in_one_step_are_refused(gradclip, run, tmp_path):
    target = tmp_path / "work"
    shutil.copytree(run / "dump_full", target)
    shutil.copytree(_dump(run, "sampled") / "sampled_gradients",
                    target.joinpath(*DUMPS, "sampled_gradients"))
    one_line_exit_3(gradclip("inspect", target.joinpath(*DUMPS)), "holds both")
    full = gradclip("inspect", target.joinpath(*DUMPS, "full_gradients"), "--format", "json")
    assert full.code == 0 and "first" not in " ".join(full.json()["description"])


def test_two_ranks_print_the_one_process_report_of_dumps(olmo_core_runs, tmp_path):
    run = olmo_core_runs[2]
    jobs = [{"args": ["inspect", str(_dump(run, mode)), "--format", fmt, "--no-progress"]}
            for mode in ("full", "sampled") for fmt in ("table", "json")]
    same_under_torchrun(jobs, tmp_path)
