"""torchtitan ``checkpoint/step-N/``: real runs on 1 and 2 gloo ranks (``torchtitan_run.py``).

References never go through gradclip: torch's own ``dcp_to_torch_save``
reassembles each step into one torch file (in the frameworks venv), and the
moments' bias corrections and updates are computed here in float64.
"""

from __future__ import annotations

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
    norm,
    one_line_exit_3,
    rewrite_metadata,
    same_under_torchrun,
    skip_without_frameworks,
)

skip_without_frameworks()


def _reference(run: Path, step: int) -> dict:
    return torch.load(run / "reference" / f"step-{step}.pt", weights_only=True)


def _step_folder(run: Path, step: int) -> Path:
    return run / "run" / "checkpoint" / f"step-{step}"


def _weights(ref: dict) -> dict[str, torch.Tensor]:
    return {n: t for n, t in ref.items() if isinstance(t, torch.Tensor)}


def _weight_of(ref: dict, fqn: str) -> list[torch.Tensor]:
    """The weights of optimizer parameter ``fqn``: a fused wqkv's are wq, wk and wv."""
    weights = _weights(ref)
    if fqn in weights:
        return [weights[fqn]]
    base = fqn.removesuffix("wqkv.weight")
    return [weights[f"{base}{w}.weight"] for w in ("wq", "wk", "wv")]


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def run(request, torchtitan_runs) -> Path:
    return torchtitan_runs[request.param]


def test_the_fixture_is_torchtitans_layout(run):
    ref = _reference(run, 2)
    assert ref["train_state"]["step"] == 2
    state, _ = flat_optimizer(ref["optimizer"])
    fused = [f for f in state if f.endswith("qkv_linear.wqkv.weight")]
    assert len(fused) == 2 and not any(f in ref for f in fused)
    assert "layers.0.attention.qkv_linear.wq.weight" in ref
    export = _reference(run, 3)
    assert set(export) == set(_weights(ref))  # the last save: the model alone


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_against_torch_reassembled(gradclip, run, step, what):
    ref = _reference(run, step)
    expected = adam_measured(*flat_optimizer(ref["optimizer"]), what)
    result = gradclip("inspect", _step_folder(run, step), "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"], doc["what"]) == ("torchtitan", step, what)
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for fqn, row in rows.items():
        assert rel_err(row["norm"], norm([expected[fqn]])) <= TOL, fqn
        # ratio: the same elements on both sides, a fused wqkv's weights being wq, wk, wv
        assert rel_err(row["ratio"], norm([expected[fqn]]) / norm(_weight_of(ref, fqn))) <= TOL, fqn
    groups = {g["name"]: g for g in doc["groups"]}
    layer = [f for f in expected if f.startswith("layers.1.")]
    weights = [w for f in layer for w in _weight_of(ref, f)]
    assert (
        rel_err(groups["layers.1"]["ratio"], norm(expected[f] for f in layer) / norm(weights))
        <= TOL
    )


def test_auto_measures_the_first_moment(gradclip, run):
    result = gradclip("inspect", _step_folder(run, 2), "--format", "json")
    assert result.code == 0, result.err
    assert result.json()["what"] == "exp_avg"


@pytest.mark.parametrize("step", [2, 3], ids=["full", "export"])
def test_weights_against_torch_reassembled(gradclip, run, step):
    weights = _weights(_reference(run, step))
    result = gradclip("inspect", _step_folder(run, step), "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert (doc["format"], doc["step"]) == ("torchtitan", step)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(weights)  # wq, wk, wv as stored: no fused weight among them
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([weights[name]])) <= TOL, name
    assert rel_err(doc["total_norm"], norm(weights.values())) <= TOL


def test_no_gradients_says_what_it_holds(gradclip, run):
    full = gradclip("inspect", _step_folder(run, 2), "--what", "grads")
    assert full.code == 3 and len(full.err_lines) == 1, full.err
    assert "torchtitan checkpoint saves no gradients" in full.err
    assert "--what exp_avg, --what grad_rms, --what update, --what weights" in full.err
    keyed = gradclip("inspect", _step_folder(run, 2), "--key", "optimizer")
    one_line_exit_3(keyed, "--key 'optimizer'", "saves no gradients")
    export = gradclip("inspect", _step_folder(run, 3), "--what", "exp_avg")
    assert export.code == 3 and len(export.err_lines) == 1, export.err
    assert "no optimizer state" in export.err and "--what weights" in export.err


def test_trend_over_the_run_folder(gradclip, run):
    result = gradclip("trend", run / "run" / "checkpoint", "--what", "weights", "--format", "json")
    assert result.code == 0, result.err
    points = result.json()["points"]
    assert [p["step"] for p in points] == [1, 2, 3]
    for point, step in zip(points, (1, 2, 3)):
        assert rel_err(point["total_norm"], norm(_weights(_reference(run, step)).values())) <= TOL


# --------------------------------------------------------------------- hostile copies


@pytest.fixture
def copy(run, tmp_path) -> Path:
    target = tmp_path / "step-2"
    shutil.copytree(_step_folder(run, 2), target)
    return target


def test_truncated_chunk_file(gradclip, copy):
    shard = copy / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    one_line_exit_3(gradclip("inspect", copy, "--what", "exp_avg"), "truncated", "__0_0.distcp")


def test_chunk_file_outside_the_folder(gradclip, copy, tmp_path):
    outside = tmp_path / "elsewhere.distcp"
    (copy / "__0_0.distcp").rename(outside)
    (copy / "__0_0.distcp").symlink_to(outside)
    one_line_exit_3(gradclip("inspect", copy, "--what", "update"), "outside its folder")


def test_storage_path_leaving_the_folder(gradclip, copy):
    def escape(meta):
        for info in meta.storage_data.values():
            info.relative_path = "../../escaped.distcp"

    rewrite_metadata(copy, escape)
    one_line_exit_3(gradclip("inspect", copy, "--what", "weights"), "outside its folder")


def test_metadata_that_runs_code_is_refused(gradclip, copy, tmp_path):
    marker = tmp_path / "ran"

    def arm(meta):
        meta.storage_meta = RunsCode(marker)

    rewrite_metadata(copy, arm)
    one_line_exit_3(
        gradclip("inspect", copy, "--what", "exp_avg"), "refused", "--trust-pickle", ".metadata"
    )
    assert not marker.exists()


def test_metadata_that_is_not_a_pickle(gradclip, copy):
    (copy / ".metadata").write_bytes(b"\x00not a pickle\n" * 8)
    one_line_exit_3(gradclip("inspect", copy), "not DCP metadata", ".metadata")


def _renamed(old: str, new: str):
    """A ``rewrite_metadata`` change: every key, index and planner path naming ``old``
    names ``new`` (the data files stay as they are: their bytes are found by offset)."""
    import dataclasses

    def rename(meta):
        meta.state_dict_metadata = {
            k.replace(old, new): v for k, v in meta.state_dict_metadata.items()
        }
        meta.storage_data = {
            dataclasses.replace(i, fqn=i.fqn.replace(old, new)): v
            for i, v in meta.storage_data.items()
        }
        meta.planner_data = {
            k.replace(old, new): tuple(str(p).replace(old, new) for p in v)
            for k, v in meta.planner_data.items()
        }

    return rename


def test_a_fused_parameters_name_is_escaped_in_the_table(gradclip, copy):
    """A module's name is the checkpoint's data: the table's line naming the fused
    parameters shows a terminal escape in it escaped, as the rows do (it was printed raw)."""
    rewrite_metadata(copy, _renamed("layers.0.attention", "layers.0.att\x1b[31mention"))
    result = gradclip("inspect", copy, "--what", "exp_avg")
    assert result.code == 0, result.err
    assert "\x1b" not in result.out
    assert "att\\x1b[31mention.qkv_linear.wqkv.weight" in result.out.replace("\n  ", "")


def test_a_step_folder_without_its_metadata_says_so(gradclip, copy):
    """A copy or an interrupted save that lost ``.metadata`` leaves data files no reader
    can place: the refusal names the missing index, and offers no command that fails (it
    offered ``trend`` of the folder and ``inspect`` of a ``.distcp``, taking the rank's
    number in ``__0_0.distcp`` for a step)."""
    (copy / ".metadata").unlink()
    for command in (("inspect", copy), ("inspect", copy, "--format", "json")):
        result = gradclip(*command)
        assert result.code == 3 and len(result.err_lines) == 1, result.err
        assert ".metadata" in result.err and "no .metadata" in result.err, result.err
        assert "gradclip trend" not in result.err and "per-step" not in result.err


# --------------------------------------------------------------------- under torchrun


def test_trust_pickle_opens_dcp_metadata_with_the_warning(gradclip, copy, tmp_path):
    marker = tmp_path / "ran"

    def arm(meta):
        meta.storage_meta = RunsCode(marker)

    rewrite_metadata(copy, arm)
    refused = gradclip("inspect", copy, "--what", "weights", "--format", "json")
    assert refused.code == 3 and not marker.exists()
    trusted = gradclip("inspect", copy, "--what", "weights", "--format", "json", "--trust-pickle")
    assert trusted.code == 0, trusted.err
    assert marker.exists()  # full unpickling ran what the file names, as asked
    assert "loaded with --trust-pickle" in trusted.err
    assert trusted.json()["format"] == "torchtitan"


def test_two_ranks_print_the_one_process_report(torchtitan_runs, tmp_path):
    run = torchtitan_runs[2]
    jobs = [
        {
            "args": [
                "inspect",
                str(_step_folder(run, 2)),
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
    jobs.append(
        {"args": ["inspect", str(_step_folder(run, 3)), "--what", "weights", "--no-progress"]}
    )
    jobs.append(
        {
            "args": [
                "trend",
                str(run / "run" / "checkpoint"),
                "--what",
                "weights",
                "--format",
                "json",
            ]
        }
    )
    same_under_torchrun(jobs, tmp_path)
