"""NeMo 2 checkpoints: a real run of NeMo's trainer, strategy and ``ModelCheckpoint``.

The references never go through gradclip: ``nemo2_run.py`` loads each checkpoint back with
NeMo's own ``MegatronCheckpointIO.load_checkpoint`` into the sharded dicts NeMo's strategy
saves, and keeps the plain tensors by Megatron's names; the moments' bias corrections and
updates are computed here in float64.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.launch import same_under_torchrun

from .support import (
    QUANTITIES,
    RunsCode,
    adam_measured,
    grouped_optimizer,
    inspect_json,
    matches_reference,
    one_line_exit_3,
    weights_match_reference,
)

STEPS = (1, 2, 3)


def _reference(run: Path, step: int) -> dict:
    return torch.load(run / "reference" / f"step_{step}.pt", weights_only=True)


def test_the_fixture_is_nemos_layout(nemo_run):
    folder = nemo_run / "run" / "step_3"
    assert sorted(p.name for p in (folder / "weights").iterdir()) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json"
    ]
    assert {"io.json", "model.yaml"} <= {p.name for p in (folder / "context").iterdir()}
    assert json.loads((folder / "context" / "io.json").read_text())["root"]
    ref = _reference(nemo_run, 3)
    assert ref["global_step"] == 3
    assert len(ref["weights"]) == len(ref["state"]) == 28
    assert all(float(s["step"]) == 3 for s in ref["state"].values())


@pytest.mark.parametrize("step", STEPS)
def test_weights_against_nemos_loader(gradclip, nemo_run, step):
    weights = _reference(nemo_run, step)["weights"]
    doc = inspect_json(gradclip, nemo_run / "run" / f"step_{step}", "weights")
    assert (doc["format"], doc["step"], doc["what"]) == ("nemo", step, "weights")
    weights_match_reference(doc, weights)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("what", QUANTITIES)
def test_every_quantity_against_nemos_loader(gradclip, nemo_run, step, what):
    ref = _reference(nemo_run, step)
    expected = adam_measured(*grouped_optimizer(ref), what)
    doc = inspect_json(gradclip, nemo_run / "run" / f"step_{step}", what)
    assert (doc["format"], doc["step"], doc["what"]) == ("nemo", step, what)
    matches_reference(doc, expected, ref["weights"])


def test_its_weights_folder_reads_as_the_checkpoint(gradclip, nemo_run):
    folder = nemo_run / "run" / "step_2"
    for what in ("weights", "update"):
        whole = inspect_json(gradclip, folder, what)
        assert inspect_json(gradclip, folder / "weights", what)["tensors"] == whole["tensors"]


def test_the_report_names_nemo(gradclip, nemo_run):
    result = gradclip("inspect", nemo_run / "run" / "step_3", "--what", "weights")
    assert result.code == 0, result.err
    assert "NeMo 2 checkpoint at iteration 3: 28 model tensors" in " ".join(result.out.split())
    assert inspect_json(gradclip, nemo_run / "run" / "step_3", "auto")["what"] == "exp_avg"


def test_no_gradients_says_what_it_holds(gradclip, nemo_run):
    result = gradclip("inspect", nemo_run / "run" / "step_3", "--what", "grads")
    one_line_exit_3(result, "NeMo 2 checkpoint saves no gradients")


def test_two_ranks_print_the_one_process_report(nemo_run, tmp_path):
    jobs = [{"args": ["inspect", str(nemo_run / "run" / f"step_{step}"), "--what", what,
                      "--format", fmt, "--no-progress"]}
            for step in (1, 3) for what in ("weights", "update") for fmt in ("table", "json")]
    same_under_torchrun(jobs, tmp_path)


@pytest.fixture
def copy(nemo_run, tmp_path) -> Path:
    folder = tmp_path / "step_3"
    shutil.copytree(nemo_run / "run" / "step_3", folder)
    return folder


def test_a_common_pt_that_runs_code_is_refused(gradclip, copy, tmp_path):
    marker = tmp_path / "ran"
    torch.save({"global_step": RunsCode(marker)}, copy / "weights" / "common.pt")
    result = gradclip("inspect", copy, "--what", "weights")
    one_line_exit_3(result, "common.pt", "refused", "system")
    assert not marker.exists()


def test_a_context_that_is_no_object_is_refused(gradclip, copy):
    (copy / "context" / "io.json").write_text("[1, 2]")
    one_line_exit_3(gradclip("inspect", copy, "--what", "weights"), "io.json", "not a JSON object")
    (copy / "context" / "io.json").write_text("{not json")
    one_line_exit_3(gradclip("inspect", copy, "--what", "weights"), "io.json")


def test_another_backend_is_refused(gradclip, copy):
    (copy / "weights" / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    one_line_exit_3(gradclip("inspect", copy, "--what", "weights"), "metadata.json", "zarr")


def test_a_missing_shard_is_refused(gradclip, copy):
    (copy / "weights" / "__0_1.distcp").unlink()
    one_line_exit_3(gradclip("inspect", copy, "--what", "weights"), "__0_1.distcp")


def test_a_path_in_common_pt_that_is_not_text_is_refused(gradclip, copy, tmp_path):
    import pathlib

    class NotText:
        def __reduce__(self):
            return (pathlib.PosixPath, (7,))

    common = torch.load(copy / "weights" / "common.pt", weights_only=False)
    common["callbacks"] = {"ModelCheckpoint": {"dirpath": NotText()}}
    torch.save(common, copy / "weights" / "common.pt")
    one_line_exit_3(gradclip("inspect", copy, "--what", "weights"), "common.pt", "PosixPath")


def test_the_layout_page_shows_this_runs_output(nemo_run):
    """The example on the layout page is this run's report, byte for byte (the run is
    seeded: NeMo's mock data and the model's initialisation)."""
    import os
    import subprocess
    import sys

    page = (Path(__file__).resolve().parents[2] / "docs" / "layouts" / "_examples" / "nemo.md")
    shown = page.read_text(encoding="utf-8").split("```text\n", 1)[1].split("```", 1)[0]
    command, expected = shown.split("\n", 1)
    assert command == "$ gradclip inspect step_3 --top 3"
    done = subprocess.run(
        [sys.executable, "-m", "gradclip_cli", "inspect", "step_3", "--top", "3", "--no-progress"],
        cwd=nemo_run / "run", capture_output=True, text=True,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout + done.stderr == expected
