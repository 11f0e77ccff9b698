"""The step vocabulary every layout and command shares (``source/vocabulary.py``).

One name rule: the names each framework gives its numbered folders, which numbers
a folder's name holds, and what marks a run's folder for inspect's hint. One value
rule: a step read from a checkpoint is a whole number >= 0, a whole-number float
(torch's Adam keeps its step as a float tensor) or a one-element tensor holding one.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import gradclip_cli
from gradclip_cli.errors import InputError
from gradclip_cli.source.layouts import dcp_frameworks
from gradclip_cli.source.logs.tracker import checked_point
from gradclip_cli.source.untrusted import is_count, is_int, is_number
from gradclip_cli.source.vocabulary import (
    NUMBERED_NAME,
    last_number,
    step_after,
    step_in_name,
    step_value,
)

GRADS = {"grads": {"a.weight": torch.ones(3)}}


@pytest.mark.parametrize(("name", "prefix", "step"), [
    ("checkpoint-5", "checkpoint-", 5),  # the HF Trainer's folder
    ("step-00000004", "step-", 4),  # torchtitan's
    ("step9", "step", 9),  # OLMo-core's
    ("iter_0000003", "iter_", 3),  # Megatron's
    ("global_step7", "global_step", 7),  # DeepSpeed's
    ("step-3", "step", None), ("step3", "step-", None), ("checkpoint_5", "checkpoint-", None),
    ("checkpoint-5.bak", "checkpoint-", None), ("step-3a", "step-", None),
    ("iter_", "iter_", None), ("xstep3", "step", None), ("checkpoint-", "checkpoint-", None),
])  # fmt: skip
def test_step_after_reads_one_frameworks_folder_name(name, prefix, step):
    assert step_after(name, prefix) == step


@pytest.mark.parametrize(("name", "numbered"), [
    *[(n, True) for n in ("checkpoint-5", "checkpoint_5", "global_step5", "step-5", "step5",
                          "step_5", "iter_0000005")],
    *[(n, False) for n in ("epoch_2", "run7", "version_0", "checkpoint-", "step", "iter_5x",
                           "checkpoint-5x", "latest")],
])  # fmt: skip
def test_a_run_folders_numbered_checkpoints(name, numbered):
    """inspect's run-folder hint: every step name, and accelerate's checkpoint_N (numbered
    saves), but not epochs or tracker versions."""
    assert bool(NUMBERED_NAME.fullmatch(name)) is numbered
    # A step name is a numbered checkpoint; accelerate's checkpoint_N numbers saves alone.
    assert (step_in_name(name) is not None) == (numbered and name != "checkpoint_5")


@pytest.mark.parametrize(("name", "number"), [
    ("step_19", 19), ("v2-run10", 10), ("checkpoint_3", 3), ("epoch_2", 2), ("latest", None),
    ("", None),
])  # fmt: skip
def test_last_number(name, number):
    assert last_number(name) == number


@pytest.mark.parametrize("value", [3, 3.0, torch.tensor(3.0), torch.tensor(3),
                                   torch.tensor([3], dtype=torch.int64),
                                   torch.tensor(3.0, dtype=torch.bfloat16)])
def test_a_whole_number_is_a_step_in_every_form(value):
    assert step_value(value) == 3 and type(step_value(value)) is int
    # The parser the DCP frameworks (torchtitan's train_state.step, Megatron's iteration)
    # use follows the same rule: a whole-number float step was refused there before.
    assert dcp_frameworks.int_value(value, "ckpt", "train_state.step") == 3


@pytest.mark.parametrize(("value", "shown"), [
    (3.5, "3.5"), (-1, "-1"), (-1.0, "-1.0"), (True, "True"), ("3", "'3'"), (None, "None"),
    (math.nan, "nan"), (math.inf, "inf"), (torch.tensor(True), "True"), (torch.tensor(-1), "-1"),
    (torch.ones(2), "tensor([1., 1.])"), (torch.tensor(2.5), "tensor(2.5000)"),
    (torch.tensor(1 + 0j), "(1+0j)"), ([3], "[3]"),
])  # fmt: skip
def test_anything_else_is_no_step(value, shown):
    assert step_value(value) is None
    with pytest.raises(InputError) as raised:
        dcp_frameworks.int_value(value, "ckpt", "train_state.step")
    assert str(raised.value) == f"ckpt: train_state.step is {shown}, not a step count"


def _dcp_save(state, path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # no process group: DCP says it saves as one rank
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


@pytest.mark.parametrize("step", [4, 4.0, torch.tensor(4.0)])
def test_a_dcp_checkpoints_step_in_every_form(gradclip, tmp_path, step):
    """The DCP reader's step (``dcp_folder``), the other former parser: one rule."""
    _dcp_save({"model": {"a.weight": torch.ones(3)}, "step": step}, tmp_path / "ckpt")
    r = gradclip("inspect", tmp_path / "ckpt", "--format", "json")
    assert r.code == 0, r.err
    assert r.json()["step"] == 4


def test_a_dcp_checkpoints_fractional_step_is_refused(gradclip, tmp_path):
    _dcp_save({"model": {"a.weight": torch.ones(3)}, "step": 4.5}, tmp_path / "ckpt")
    r = gradclip("inspect", tmp_path / "ckpt")
    assert r.code == 3 and r.err_lines == [
        f"gradclip: {tmp_path / 'ckpt' / '.metadata'}: 'step' is 4.5, not a step count"]


@pytest.mark.parametrize(("folders", "newest"), [
    (("iter_0000001", "iter_0000002"), "iter_0000002"),  # Megatron's (the hint missed it)
    (("step_1", "step_2"), "step_2"),
    (("checkpoint_0", "checkpoint_1"), "checkpoint_1"),  # accelerate's numbered saves
])  # fmt: skip
def test_inspect_points_every_run_folder_to_trend(gradclip, tmp_path, folders, newest):
    run = tmp_path / "run"
    for name in folders:
        (run / name).mkdir(parents=True)
        torch.save(GRADS, run / name / "grads.pt")
    r = gradclip("inspect", run)
    assert r.code == 3 and r.err_lines == [
        f"gradclip: {run}: a run's folder of 2 numbered checkpoints ({folders[0]} .. "
        f"{newest}), not one checkpoint: for norms over the run use 'gradclip trend {run}'; "
        f"to inspect the newest, 'gradclip inspect {run / newest}'"]


@pytest.mark.parametrize(("value", "whole", "count", "size", "number"), [
    (0, True, True, False, True), (3, True, True, True, True), (-1, True, False, False, True),
    (True, False, False, False, False), (False, False, False, False, False),
    (2.0, False, False, False, True), ("3", False, False, False, False),
    (None, False, False, False, False), (math.nan, False, False, False, True),
])  # fmt: skip
def test_values_read_from_untrusted_dicts(value, whole, count, size, number):
    """A bool is an int in Python; no count, size or number read from a file is one."""
    assert is_int(value) is whole
    assert is_count(value) is count
    assert is_count(value, 1) is size
    assert is_number(value) is number


def _monitor_log(path, steps):
    path.write_text("".join(json.dumps({
        "schema": "gradclip.monitor/1", "step": s, "total_norm": 1.0, "norm_type": 2.0,
        "groups": {"a": 1.0}}) + "\n" for s in steps))
    return path


def _trainer_state(path, steps):
    path.write_text(json.dumps({"log_history": [{"grad_norm": 1.0, "step": s} for s in steps]}))
    return path


@pytest.mark.parametrize("write", [_monitor_log, _trainer_state], ids=["monitor", "trainer"])
def test_logs_read_steps_by_the_same_value_rule_as_checkpoints(write, tmp_path):
    """A log's step is read as a checkpoint's is: ``3.0`` is step 3; ``2.5`` and ``-1``
    are refused, each in one line naming the file."""
    name = "m.jsonl" if write is _monitor_log else "trainer_state.json"
    report = gradclip_cli.trend([str(write(tmp_path / name, [0.0, 1, 2.0, 3]))])
    assert [p.step for p in report.points] == [0, 1, 2, 3]
    for bad in (2.5, -1, True, "3"):
        with pytest.raises(gradclip_cli.GradclipError) as refused:
            gradclip_cli.trend([str(write(tmp_path / name, [0, 1, bad]))])
        assert refused.value.exit_code == 3
        assert name in refused.value.message and "whole number >= 0" in refused.value.message
        assert "\n" not in refused.value.message


@pytest.mark.parametrize(("step", "kept"), [(3, 3), (3.0, 3), (0, 0)])
def test_a_tracker_point_takes_the_step_rule(step, kept):
    assert checked_point(step, 1.5, "run") == (kept, 1.5)


@pytest.mark.parametrize(("step", "words"), [
    (2.5, "is not a whole number"), (True, "is not a whole number"),
    ("7", "is not a whole number"), (-1, "is negative"), (-2.0, "is negative"),
])  # fmt: skip
def test_a_tracker_point_with_no_step_is_refused(step, words):
    with pytest.raises(InputError, match=words):
        checked_point(step, 1.0, "run")
