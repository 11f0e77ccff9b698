"""``gradclip trend OUTPUT_DIR`` of a real Hugging Face Trainer run: every series the
folder holds is found, the finest-grained one is judged, each is named with where it
came from, and whether the Trainer clipped is said (``source/run_folder.py``)."""

from __future__ import annotations

import json
import math
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch

from tests.schemas import validate
from tests.trainer_runs import RUN_FOLDER_LOG, train_run_folder

from .support import logical_lines, rel_err


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory):
    """20 steps, checkpoint-5/ .. checkpoint-20/, max_grad_norm 1.0, a GradMonitor log,
    transformer.h.1's gradients x1000 at step 12 (made once a session)."""
    return train_run_folder(tmp_path_factory.mktemp("hf_run_folder") / "output")


def copy_without(run, tmp_path, *names):
    """The run's output_dir copied, without the top-level files ``names``."""
    copy = tmp_path / "output"
    shutil.copytree(run.output_dir, copy)
    for name in names:
        (copy / name).unlink()
    return copy


def logged_grad_norms(state_file) -> dict[int, float]:
    history = json.loads(state_file.read_text())["log_history"]
    return {e["step"]: e["grad_norm"] for e in history if "grad_norm" in e}


def series_of(doc) -> dict[str, dict]:
    return {s["kind"]: s for s in doc["series"]}


def test_output_dir_with_no_flags_finds_the_spikes_step_and_layer(gradclip, run_folder):
    run = run_folder
    r = gradclip("trend", run.output_dir, "--format", "json", "--fail-on", "any")
    assert r.code == 1, r.err
    doc = r.json()
    validate(doc, "trend-1")
    # The monitor log is judged: every step, every layer.
    log = str(run.output_dir / RUN_FOLDER_LOG)
    assert {p["source"] for p in doc["points"]} == {log} and doc["what"] == "grads"
    assert [p["step"] for p in doc["points"]] == list(range(1, run.steps + 1))
    spike = next(p for p in doc["points"] if p["step"] == run.spike_step)
    assert spike["spike"] and run.spike_layer in spike["spike_groups"]
    # Only the injected layer spiked at that step; the others stayed in their history.
    assert spike["spike_groups"] == [run.spike_layer]
    for point in doc["points"]:
        ref = run.reference[point["step"]]
        assert rel_err(point["total_norm"], ref["total"]) <= 1e-6, point["step"]
        assert set(point["groups"]) == set(ref) - {"total"}
        for layer, norm in point["groups"].items():
            assert rel_err(norm, ref[layer]) <= 1e-6, (point["step"], layer)
    # The blow-up is 10x and more of every other step's total.
    others = [ref["total"] for step, ref in run.reference.items() if step != run.spike_step]
    assert run.reference[run.spike_step]["total"] > 10 * max(others)


def test_every_series_is_named_with_its_source_and_only_one_is_judged(gradclip, run_folder):
    run = run_folder
    doc = gradclip("trend", run.output_dir, "--format", "json").json()
    found = series_of(doc)
    assert set(found) == {"gradclip-monitor", "trainer-state", "checkpoints"}
    assert [s["kind"] for s in doc["series"] if s["judged"]] == ["gradclip-monitor"]
    assert found["gradclip-monitor"]["source"] == str(run.output_dir / RUN_FOLDER_LOG)
    assert found["gradclip-monitor"]["points"] == run.steps
    assert found["gradclip-monitor"]["per_group"] is True
    # The newest trainer_state.json: the run's own, which save_state wrote at the end.
    state = found["trainer-state"]
    assert state["source"] == str(run.output_dir / "trainer_state.json")
    assert state["points"] == run.steps and state["per_group"] is False
    assert "total only" in state["why_not"]
    checkpoints = found["checkpoints"]
    saved = run.steps // run.save_steps
    assert checkpoints["points"] == saved
    assert checkpoints["source"] == (
        f"{run.output_dir / f'checkpoint-{run.save_steps}'} .. "
        f"{run.output_dir / f'checkpoint-{run.steps}'}"
    )
    assert f"({saved} < {run.steps})" in checkpoints["why_not"]
    assert "--what exp_avg" in checkpoints["why_not"]


def test_whether_the_trainer_clipped_is_read_from_its_training_args(gradclip, run_folder):
    run = run_folder
    newest = run.output_dir / f"checkpoint-{run.steps}" / "training_args.bin"
    # The reference: the arguments object itself, unpickled by torch (our own file).
    expected = torch.load(newest, weights_only=False).max_grad_norm
    assert expected == run.max_grad_norm == 1.0
    doc = gradclip("trend", run.output_dir, "--format", "json").json()
    [clipping] = doc["clipping"]
    assert clipping["source"] == str(newest)
    assert clipping["max_grad_norm"] == expected and clipping["clipped"] is True
    assert "only saw clipped gradients" in clipping["note"]
    assert "exp_avg" in clipping["note"]
    assert clipping["note"] in doc["notes"]


def test_the_moments_saw_only_clipped_gradients(gradclip, run_folder):
    # What the clipping note says, measured: the spike is 100x the run's gradient
    # norms in the log, and hardly moves Adam's first moment in the checkpoints.
    run = run_folder
    doc = gradclip("trend", run.output_dir, "--what", "exp_avg", "--format", "json").json()
    assert [s["kind"] for s in doc["series"] if s["judged"]] == ["checkpoints"]
    assert series_of(doc)["gradclip-monitor"]["why_not"] == "a log of gradient norms, not exp_avg"
    norms = {p["step"]: p["total_norm"] for p in doc["points"]}
    assert list(norms) == list(range(run.save_steps, run.steps + 1, run.save_steps))
    # Checkpoint 15 is three steps after the spike: exp_avg keeps beta1**3 = 0.73 of it.
    assert norms[15] < 1.5 * norms[10]
    assert doc["clipping"][0]["clipped"] is True


def test_every_format_says_where_the_series_came_from_and_that_the_trainer_clipped(
    gradclip, run_folder
):
    run = run_folder
    log = str(run.output_dir / RUN_FOLDER_LOG)
    table = gradclip("trend", run.output_dir)
    lines = logical_lines(table.out)
    assert lines[1].startswith(f"judged: {log} (gradclip monitor log")
    assert any(line.startswith("not judged: ") and "trainer_state.json" in line for line in lines)
    assert any(
        line.startswith("clipping: the Trainer clipped gradients to max_grad_norm 1 ")
        for line in lines
    )
    assert any(
        line.startswith(f"│   {run.spike_step} ") and run.spike_layer in line for line in lines
    )
    markdown = gradclip("trend", run.output_dir, "--format", "markdown").out
    assert "- judged\\: " in markdown and "- clipping\\: the Trainer clipped" in markdown
    github = gradclip("trend", run.output_dir, "--format", "github").out.splitlines()
    notices = [line for line in github
               if line.startswith("::notice title=gradclip trend%3A note")]
    assert len(notices) == len(
        gradclip("trend", run.output_dir, "--format", "json").json()["notes"]
    )
    assert any("::clipping: the Trainer clipped" in line for line in notices)
    assert any(
        f"spike at step {run.spike_step}" in line and run.spike_layer in line for line in github
    )
    junit = ET.fromstring(gradclip("trend", run.output_dir, "--format", "junit").out)
    text = junit.find("testsuite/system-out").text
    assert f"judged: {log}" in text and "clipping: the Trainer clipped" in text


def test_without_a_monitor_log_the_trainer_state_is_judged_and_the_layer_unknown(
    gradclip, run_folder, tmp_path
):
    run = run_folder
    folder = copy_without(run, tmp_path, RUN_FOLDER_LOG)
    r = gradclip("trend", folder, "--format", "json", "--fail-on", "any")
    assert r.code == 1, r.err
    doc = r.json()
    state = folder / "trainer_state.json"
    assert {p["source"] for p in doc["points"]} == {str(state)}
    assert {p["step"]: p["total_norm"] for p in doc["points"]} == logged_grad_norms(state)
    assert [p["step"] for p in doc["points"] if p["spike"]] == [run.spike_step]
    assert all(p["groups"] == {} for p in doc["points"])
    assert any(n.startswith("layer: log_history holds the total norm only") for n in doc["notes"])


def test_the_newest_checkpoints_trainer_state_stands_in_for_the_folders_own(
    gradclip, run_folder, tmp_path
):
    run = run_folder
    folder = copy_without(run, tmp_path, RUN_FOLDER_LOG, "trainer_state.json")
    doc = gradclip("trend", folder, "--format", "json").json()
    newest = folder / f"checkpoint-{run.steps}" / "trainer_state.json"
    assert series_of(doc)["trainer-state"]["source"] == str(newest)
    assert [p["step"] for p in doc["points"]] == list(range(1, run.steps + 1))
    assert {p["step"]: p["total_norm"] for p in doc["points"]} == logged_grad_norms(newest)


def test_a_run_folder_and_its_own_log_given_together_are_one_series(gradclip, run_folder):
    run = run_folder
    doc = gradclip(
        "trend", run.output_dir, run.output_dir / RUN_FOLDER_LOG, "--format", "json"
    ).json()
    assert [p["step"] for p in doc["points"]] == list(range(1, run.steps + 1))


def test_training_args_naming_another_global_leaves_clipping_unknown_and_runs_nothing(
    gradclip, run_folder, tmp_path
):
    run = run_folder
    folder = copy_without(run, tmp_path)
    for checkpoint in folder.glob("checkpoint-*"):
        torch.save(Payload(), checkpoint / "training_args.bin")
    r = gradclip("trend", folder, "--format", "json")
    assert r.code == 0, r.err
    [clipping] = r.json()["clipping"]
    assert clipping["max_grad_norm"] is None and clipping["clipped"] is None
    assert clipping["note"].startswith("clipping: unknown (")
    assert "_mark_ran" in clipping["note"] and "never unpickles" in clipping["note"]
    assert not Payload.ran


class Payload:
    """A class a hostile training_args.bin names: unpickling it would run code."""

    ran = False

    def __setstate__(self, state):
        Payload.ran = True

    def __reduce__(self):
        return (_mark_ran, ())


def _mark_ran():
    Payload.ran = True
    return Payload.__new__(Payload)


def test_a_run_that_did_not_clip_says_so(gradclip, tmp_path, run_folder):
    # The same run folder, its newest arguments saying max_grad_norm 0 (set through
    # the real TrainingArguments object, saved as the Trainer saves it).
    run = run_folder
    folder = copy_without(run, tmp_path)
    newest = folder / f"checkpoint-{run.steps}" / "training_args.bin"
    args = torch.load(newest, weights_only=False)
    args.max_grad_norm = 0.0
    torch.save(args, newest)
    doc = gradclip("trend", folder, "--format", "json").json()
    [clipping] = doc["clipping"]
    assert clipping["clipped"] is False and math.isclose(clipping["max_grad_norm"], 0.0)
    assert clipping["note"].startswith("clipping: the Trainer did not clip")


def test_training_args_too_large_to_be_arguments_is_not_opened(gradclip, run_folder, tmp_path):
    run = run_folder
    folder = copy_without(run, tmp_path)
    newest = folder / f"checkpoint-{run.steps}" / "training_args.bin"
    torch.save({"padding": torch.zeros(1 << 19)}, newest)  # 2 MiB of tensor data
    doc = gradclip("trend", folder, "--format", "json").json()
    [clipping] = doc["clipping"]
    assert clipping["clipped"] is None and "too large for a Trainer's arguments" in clipping["note"]
    # The spike is still found: the arguments only add the note.
    assert any(p["spike"] and p["step"] == run.spike_step for p in doc["points"])


def test_a_trainer_state_without_grad_norm_is_named_not_ignored(gradclip, run_folder, tmp_path):
    run = run_folder
    folder = copy_without(run, tmp_path, RUN_FOLDER_LOG)
    for state in folder.rglob("trainer_state.json"):
        document = json.loads(state.read_text())
        for entry in document["log_history"]:
            entry.pop("grad_norm", None)  # as transformers < 4.38 wrote it
        state.write_text(json.dumps(document))
    doc = gradclip("trend", folder, "--format", "json").json()
    assert [s["kind"] for s in doc["series"]] == ["checkpoints"]
    unread = [n for n in doc["notes"] if n.startswith("not read: ")]
    assert len(unread) == 2 and all("no log_history entry has a grad_norm" in n for n in unread)
    assert doc["status"] == "insufficient_history"  # 4 checkpoints: too few to judge


def test_a_coarser_monitor_log_loses_to_log_history_and_is_named(gradclip, run_folder, tmp_path):
    # A monitor logging every 2nd step (GradMonitor(every=2)): log_history is finer.
    run = run_folder
    folder = copy_without(run, tmp_path)
    log = folder / RUN_FOLDER_LOG
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(line for line in lines if json.loads(line)["step"] % 2 == 0))
    doc = gradclip("trend", folder, "--format", "json").json()
    assert [s["kind"] for s in doc["series"] if s["judged"]] == ["trainer-state"]
    assert series_of(doc)["gradclip-monitor"]["why_not"] == (
        f"fewer points than the judged series ({run.steps // 2} < {run.steps})"
    )
    [layer] = [n for n in doc["notes"] if n.startswith("layer: ")]
    assert f"{log}, coarser, has every layer's: trend it alone" in layer
    # Trended alone, the monitor log places the spike (an even step) in its layer.
    alone = gradclip("trend", log, "--format", "json").json()
    spike = next(p for p in alone["points"] if p["step"] == run.spike_step)
    assert spike["spike"] and run.spike_layer in spike["spike_groups"]


def with_max_grad_norm(run, tmp_path, value):
    """The run folder, its newest arguments saying ``max_grad_norm=value`` (set on the
    real TrainingArguments object, saved as the Trainer saves it)."""
    folder = copy_without(run, tmp_path)
    newest = folder / f"checkpoint-{run.steps}" / "training_args.bin"
    args = torch.load(newest, weights_only=False)
    args.max_grad_norm = value
    torch.save(args, newest)
    return folder, newest


def test_a_nan_max_grad_norm_is_said_to_clip_nothing_in_every_place(gradclip, tmp_path,
                                                                    run_folder):
    # The Trainer clips only when max_grad_norm > 0, which a NaN never is.
    folder, newest = with_max_grad_norm(run_folder, tmp_path, math.nan)
    r = gradclip("trend", folder, "--format", "json")
    assert r.code == 0, r.err  # the newest point (step 20) is calm
    doc = r.json()
    validate(doc, "trend-1")
    [clipping] = doc["clipping"]
    assert clipping["max_grad_norm"] == "nan" and clipping["clipped"] is False
    assert clipping["note"].startswith(
        f"clipping: the Trainer did not clip (max_grad_norm nan in {newest}: a NaN, which is "
        "never > 0): the optimizer saw every gradient as logged")
    assert "clipped gradients to" not in clipping["note"]


def test_an_infinite_max_grad_norm_changes_no_gradient_and_says_so(gradclip, tmp_path,
                                                                   run_folder):
    folder, newest = with_max_grad_norm(run_folder, tmp_path, math.inf)
    doc = gradclip("trend", folder, "--format", "json").json()
    validate(doc, "trend-1")
    [clipping] = doc["clipping"]
    assert clipping["max_grad_norm"] == "inf" and clipping["clipped"] is False
    assert "an infinite limit, which changes no gradient" in clipping["note"]


def test_a_max_grad_norm_beyond_float_range_leaves_clipping_unknown_not_a_traceback(
    gradclip, tmp_path, run_folder
):
    folder, newest = with_max_grad_norm(run_folder, tmp_path, 10**400)
    r = gradclip("trend", folder, "--format", "json")
    assert "Traceback" not in r.err and "OverflowError:" not in r.err
    doc = r.json()
    assert r.code == 0 and doc["schema"] == "gradclip.trend/1"
    validate(doc, "trend-1")
    [clipping] = doc["clipping"]
    assert clipping["max_grad_norm"] is None and clipping["clipped"] is None
    assert clipping["note"].startswith(
        f"clipping: unknown ({newest}: max_grad_norm is an integer too large for a float "
        "(1329 bits), which torch's clip_grad_norm_ refuses (OverflowError)")
    # The spike is found all the same.
    assert any(p["spike"] and p["step"] == run_folder.spike_step for p in doc["points"])


def test_the_trainers_grad_norm_and_the_monitor_log_agree_within_float32(gradclip, run_folder):
    # The norm audit (report/norm_audit.py): the Trainer's own float32 total against the
    # monitor's float64 one, at every step both logged; the folder's numbers checked here.
    run = run_folder
    r = gradclip("trend", run.output_dir, "--format", "json")
    doc = r.json()
    [audit] = doc["audit"]
    assert audit["framework"]["kind"] == "Trainer grad_norm"
    assert audit["gradclip"]["source"] == str(run.output_dir / RUN_FOLDER_LOG)
    assert audit["precision"] == "float32" and audit["steps_compared"] == run.steps
    assert audit["agrees"] and audit["disagreements"] == []
    logged = logged_grad_norms(run.output_dir / "trainer_state.json")
    for step, norm in logged.items():
        # What the audit allowed is what the numbers show: float32 rounding, far inside.
        assert rel_err(norm, run.reference[step]["total"]) < audit["tolerance"] / 100
    table = logical_lines(gradclip("trend", run.output_dir).out)
    assert any(line.startswith("norm audit: Trainer grad_norm (") and
               f"agree at all {run.steps} step(s), within 0.0039 relative (float32 totals)"
               in line for line in table)


# float32 state, the update computed in float32: a few roundings of 2^-24 an element
# (the factor, the square root, the sum with eps, the product and the quotient).
UPDATE_TOL = 8 * 2.0**-24


def _error_offers(result) -> tuple[str, list[list[str]]]:
    """A refusal's JSON error line and the flags it offers (``available: --what a, ...``)."""
    assert result.code == 3, result.out
    error = result.json()["error"]
    return error, [f.split() for f in error.split("available: ", 1)[1].split(", ")]


def test_a_linear_schedules_last_checkpoint_refuses_the_update_every_command(gradclip,
                                                                            run_folder):
    # The Trainer's default schedule decays linearly to 0: checkpoint-20's optimizer.pt
    # stores lr 0 (its scheduler stepped after the last optimizer step), while that step
    # used lr > 0. The update is not determined: exit 3 in inspect, trend and compare,
    # naming the checkpoint and the group, and every flag offered works in that command.
    out = run_folder.output_dir
    last, before = out / f"checkpoint-{run_folder.steps}", out / "checkpoint-15"
    groups = torch.load(last / "optimizer.pt", weights_only=True)["param_groups"]
    assert [g["lr"] for g in groups] == [0.0] * len(groups)  # the premise
    commands = {
        "inspect": ["inspect", last],
        "trend": ["trend", *(out / f"checkpoint-{s}" for s in (5, 10, 15, 20))],
        "compare": ["compare", before, last],
    }
    for command, args in commands.items():
        error, offered = _error_offers(gradclip(*args, "--what", "update", "--format", "json"))
        assert error.startswith(f"{last}: --what update: AdamW: param group "), command
        assert "stores lr 0 (a schedule's end or start)" in error
        assert "the lr its last step used is not in the checkpoint" in error
        assert offered == [["--what", "exp_avg"], ["--what", "grad_rms"], ["--what", "weights"]]
        for flags in offered:
            result = gradclip(*args, *flags, "--format", "json")
            assert result.code in (0, 1), (command, flags, result.err)
            doc = result.json()
            assert doc.get("what", flags[1]) == flags[1]


def test_a_trainer_checkpoints_update_is_at_its_stored_lr(gradclip, run_folder):
    # Mid-schedule the stored lr is the next step's; the update is lr * m_hat /
    # (sqrt(v_hat) + eps) at that lr, compared with float64 math on optimizer.pt.
    ckpt = run_folder.output_dir / "checkpoint-15"
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    group_of = {p: g for g in opt["param_groups"] for p in g["params"]}
    squares = 0.0
    for pid, state in opt["state"].items():
        g = group_of[pid]
        assert g["lr"] > 0
        (b1, b2), t = g["betas"], float(state["step"])
        m_hat = state["exp_avg"].double() / (1 - b1**t)
        v_hat = state["exp_avg_sq"].double() / (1 - b2**t)
        squares += float((g["lr"] * m_hat / (v_hat.sqrt() + g["eps"])).square().sum())
    doc = gradclip("inspect", ckpt, "--what", "update", "--format", "json").json()
    assert doc["what"] == "update"
    assert rel_err(doc["total_norm"], math.sqrt(squares)) <= UPDATE_TOL
