"""``trend`` reads every checkpoint kind ``inspect`` reads, through the same layouts and
``--what``: each point's total and group norms are ``inspect``'s for the same path
(whose own tests check them against float64), and its step is the layout's."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.cli.support import assert_no_report, rel_err
from tests.schemas import validate


def inspect_groups(gradclip, path, what):
    doc = gradclip("inspect", path, "--what", what, "--format", "json").json()
    return doc["what"], doc["total_norm"], {g["name"]: g["norm"] for g in doc["groups"]}


def assert_point_is_inspects(point, inspected):
    what, total, groups = inspected
    assert point["what"] == what
    assert rel_err(point["total_norm"], total) <= 1e-12
    assert point["groups"].keys() == groups.keys()
    for name, norm in groups.items():
        assert rel_err(point["groups"][name], norm) <= 1e-12, name


@pytest.mark.parametrize("fixture, what, step", [
    ("trainer_run", "exp_avg", 4),
    ("trainer_run", "grad_rms", 4),
    ("trainer_run", "update", 4),
    ("trainer_run", "weights", 4),
    ("lightning_ckpt", "auto", 3),  # the run saved its last gradients: grads
    ("lightning_ckpt", "exp_avg", 3),
    # No step stored: the last number in the folder's name (pytest's mktemp suffix).
    ("sharded_pretrained", "auto", "name"),
    ("sharded_bin", "weights", "name"),
])  # fmt: skip
def test_one_checkpoint_of_each_kind(gradclip, request, fixture, what, step):
    path = request.getfixturevalue(fixture)
    r = gradclip("trend", path, "--what", what, "--format", "json")
    assert r.code == 0, r.err
    doc = r.json()
    validate(doc, "trend-1")
    [point] = doc["points"]
    if step == "name":
        step = int(re.search(r"(\d+)\D*$", path.name).group(1))
    assert point["source"] == str(path) and point["step"] == step
    inspected = inspect_groups(gradclip, path, what)
    assert doc["what"] == inspected[0] and doc["status"] == "insufficient_history"
    assert_point_is_inspects(point, inspected)


def test_trainer_output_dir_is_one_point_per_checkpoint_in_step_order(gradclip, trainer_run,
                                                                      tmp_path):
    # An output_dir with checkpoint-4/ and copies as checkpoint-12/ and checkpoint-8/:
    # folder names sort 12 < 4 < 8 as text; points come in step order.
    run = tmp_path / "output"
    run.mkdir()
    for step in (4, 12, 8):
        target = run / f"checkpoint-{step}"
        shutil.copytree(trainer_run, target)
        state = target / "trainer_state.json"
        state.write_text(state.read_text().replace('"global_step": 4', f'"global_step": {step}'))
    r = gradclip("trend", run, "--what", "exp_avg", "--format", "json")
    assert r.code == 0, r.err
    doc = r.json()
    assert [p["step"] for p in doc["points"]] == [4, 8, 12]
    folders = [str(run / f"checkpoint-{s}") for s in (4, 8, 12)]
    assert [p["source"] for p in doc["points"]] == folders
    inspected = inspect_groups(gradclip, trainer_run, "exp_avg")
    for point in doc["points"]:
        assert_point_is_inspects(point, inspected)


def test_a_damaged_checkpoint_in_a_run_is_exit_3_naming_its_file(gradclip, trainer_run,
                                                                 tmp_path):
    run = tmp_path / "output"
    for step in (4, 5):
        shutil.copytree(trainer_run, run / f"checkpoint-{step}")
    (run / "checkpoint-5" / "trainer_state.json").write_text(
        (trainer_run / "trainer_state.json").read_text().replace('"global_step": 4',
                                                                  '"global_step": 5'))
    optimizer = run / "checkpoint-5" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:200])
    # --what exp_avg: the checkpoints are the series (with no flag, the finer-grained
    # log_history of checkpoint-5/trainer_state.json would be judged instead).
    r = gradclip("trend", run, "--what", "exp_avg", "--format", "json")
    assert r.code == 3 and len(r.err_lines) == 1
    assert str(optimizer) in r.err
    assert_no_report(r)
