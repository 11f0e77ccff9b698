"""One step rule for ``inspect`` and ``trend``, over every layout (``source/vocabulary.py``).

The step is what the checkpoint records (its layout's own field, else a
top-level step entry), else the step its name gives, else its folder's name:
``checkpoint-N``, ``global_stepN``, ``step-N``, ``stepN``, ``iter_0000N``.
accelerate's ``checkpoint_N`` counts saves and torchtune's ``epoch_N`` epochs:
neither is a step. Where the file records one step and its folder another, the
recorded one is the step (the contract's order) and the report says both.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from gradclip_cli.source.vocabulary import checkpoint_step, step_in_name
from tests.cli.support import logical_lines

GRADS = {"grads": {"a.weight": torch.ones(3), "b.weight": torch.full((2,), 2.0)}}


def _steps(gradclip, path) -> tuple[int | None, int | None]:
    """(inspect's step, trend's step) for one checkpoint."""
    inspected = gradclip("inspect", path, "--format", "json")
    assert inspected.code == 0, inspected.err
    trended = gradclip("trend", path, "--format", "json")
    assert trended.code == 0, trended.err
    (point,) = trended.json()["points"]
    return inspected.json()["step"], point["step"]


@pytest.mark.parametrize(("folder", "step"), [
    ("checkpoint-5", 5), ("global_step4", 4), ("step-00000004", 4), ("step9", 9),
    ("step_12", 12), ("iter_0000003", 3),
])  # fmt: skip
def test_a_plain_file_takes_its_folders_step(gradclip, tmp_path, folder, step):
    path = tmp_path / "run" / folder / "grads.pt"
    path.parent.mkdir(parents=True)
    torch.save(GRADS, path)
    assert _steps(gradclip, path) == (step, step)


@pytest.mark.parametrize("name", ["step-11.pt", "checkpoint-11.pt", "iter_0000011.pt"])
def test_a_file_named_by_its_step(gradclip, tmp_path, name):
    torch.save(GRADS, tmp_path / name)
    assert _steps(gradclip, tmp_path / name) == (11, 11)


@pytest.mark.parametrize("folder", ["epoch_2", "checkpoint_3", "run7"])
def test_names_that_are_not_steps(gradclip, tmp_path, folder):
    path = tmp_path / folder / "grads.pt"
    path.parent.mkdir()
    torch.save(GRADS, path)
    assert _steps(gradclip, path) == (None, None)


@pytest.mark.parametrize(("epoch", "step"), [(11, None), (2, 11)])
def test_a_name_numbered_by_the_recorded_epoch_is_no_step(gradclip, tmp_path, epoch, step):
    """timm's CheckpointSaver names ``checkpoint-N.pth.tar`` by its epoch: a number the
    file records as its ``epoch`` counts epochs; any other number in the name is a step.
    trend still orders by the name's last number (the contract's last resort)."""
    path = tmp_path / "checkpoint-11.pth.tar"
    torch.save({**GRADS, "epoch": epoch}, path)
    assert _steps(gradclip, path) == (step, 11)


@pytest.mark.parametrize("key", ["step", "global_step", "iteration", "iter_num"])
def test_the_recorded_step_wins_and_both_are_named(gradclip, tmp_path, key):
    path = tmp_path / "step-3" / "grads.pt"
    path.parent.mkdir()
    torch.save({**GRADS, key: torch.tensor(7)}, path)
    note = "step 7, as the checkpoint records it; its name step-3 says 3"
    assert _steps(gradclip, path) == (7, 7)
    doc = gradclip("inspect", path, "--format", "json").json()
    assert note in doc["description"]
    assert note in logical_lines(gradclip("inspect", path).out)
    assert f"{path}: {note}" in gradclip("trend", path, "--format", "json").json()["notes"]
    # A folder that agrees says nothing more.
    agreeing = tmp_path / "step-7" / "grads.pt"
    agreeing.parent.mkdir()
    torch.save({**GRADS, key: 7}, agreeing)
    assert not any(
        "records it" in d
        for d in gradclip("inspect", agreeing, "--format", "json").json()["description"]
    )


def test_a_hostile_folder_name_in_the_note_is_escaped(tmp_path):
    folder = tmp_path / "step-3.\x1b[31m"
    folder.mkdir()
    (folder / "grads.pt").touch()
    found = checkpoint_step(None, {"step": 7}, folder / "grads.pt")
    assert found.step == 7 and "\x1b" not in found.note and "\\x1b[31m" in found.note


def test_step_in_name():
    assert [
        step_in_name(n)
        for n in (
            "checkpoint-5",
            "global_step5",
            "step-05",
            "step5",
            "step_5",
            "iter_0000005",
            "step-5.pt",
            "step-5.tar.gz",
        )
    ] == [5] * 8
    assert [
        step_in_name(n)
        for n in ("checkpoint_5", "epoch_5", "xstep5", "step-5a", "5", "steps5", "iter-5")
    ] == [None] * 7


# -- every layout: inspect and trend read one step ------------------------------


def test_real_layouts_inspect_and_trend_agree(
    gradclip, tmp_path, trainer_run, lightning_ckpt, dcp_checkpoint, accelerate_fsdp_run
):
    cases = {
        trainer_run: 4,  # trainer_state.json's global_step, as checkpoint-4 says
        accelerate_fsdp_run / "checkpoint-2": 2,
    }
    for path, step in cases.items():
        assert _steps(gradclip, path) == (step, step), path
    lightning = gradclip("inspect", lightning_ckpt, "--format", "json").json()["step"]
    assert lightning is not None and _steps(gradclip, lightning_ckpt) == (lightning, lightning)
    # The same DCP folder, saved by FSDP2 ranks without a step entry, then moved
    # under a step-numbered name: the name gives the step.
    recorded = gradclip("inspect", dcp_checkpoint, "--format", "json").json()["step"]
    moved = tmp_path / "step-6"
    shutil.copytree(dcp_checkpoint, moved)
    expected = 6 if recorded is None else recorded
    assert _steps(gradclip, moved) == (expected, expected)


def test_deepspeed_and_accelerate_steps(gradclip, deepspeed_runs, accelerate_auto_runs):
    for stage in ("zero1", "zero2", "zero3"):
        inspected, trended = _steps(gradclip, deepspeed_runs / stage)
        assert inspected == trended is not None
    for i, step in ((0, 2), (1, 4)):  # checkpoint_i counts saves; the optimizer its steps
        assert _steps(gradclip, accelerate_auto_runs / f"checkpoint_{i}") == (step, step)
