"""``gradclip trend``: inputs of every kind, ordering, the spike verdict and exit codes,
numbers against float64, the JSON schema, --plot, and every bad input."""

from __future__ import annotations

import html
import json
import math
import sys

import pytest
import torch

from tests.core.spike_reference import group_z
from tests.schemas import validate
from tests.trainer_runs import SPIKE_STEP, STEPS, train_checkpointed_with_spike, train_with_spike

from .support import as_float, assert_no_report, logical_lines, ref_norm, rel_err, unwrapped

LAYERS = ("transformer.h.0", "transformer.h.1", "transformer.h.2")


def layer_grads(seed: int, scale: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """Three layers of two tensors each, magnitudes jittered a little per step."""
    g = torch.Generator().manual_seed(seed)
    grads = {}
    for layer in LAYERS:
        factor = (scale or {}).get(layer, 1.0)
        for name, shape in (("attn.weight", (16, 8)), ("mlp.weight", (8, 16))):
            grads[f"{layer}.{name}"] = torch.randn(*shape, generator=g) * factor
    return grads


def save_run(folder, steps, spikes: dict[int, dict[str, float]] | None = None,
             name="grads-{step}.pt", with_step=True):
    """One torch.save file per step; ``spikes[step]`` scales layers at that step."""
    folder.mkdir(parents=True, exist_ok=True)
    saved = {}
    for step in steps:
        grads = layer_grads(step, (spikes or {}).get(step))
        body = {"grads": grads, "step": step} if with_step else {"grads": grads}
        torch.save(body, folder / name.format(step=step))
        saved[step] = grads
    return saved


def monitor_line(step, total, groups, nonfinite=(0, 0, 0), norm_type=2.0) -> str:
    def word(x):
        return x if math.isfinite(x) else ("nan" if math.isnan(x) else "inf")

    return json.dumps({
        "schema": "gradclip.monitor/1", "step": step, "total_norm": word(total),
        "norm_type": norm_type, "groups": {k: word(v) for k, v in groups.items()},
        "nonfinite": dict(zip(("nan", "posinf", "neginf"), nonfinite)),
    }) + "\n"  # fmt: skip


@pytest.fixture(scope="session")
def trainer_state(tmp_path_factory):
    """A real Trainer run's trainer_state.json (spike at SPIKE_STEP), made once a session."""
    return train_with_spike(tmp_path_factory.mktemp("hf_run"))


# -- checkpoints ---------------------------------------------------------------


def test_folder_of_checkpoints_norms_match_float64_and_newest_spike_fails(gradclip, tmp_path):
    saved = save_run(tmp_path / "run", range(0, 120, 10), spikes={110: {"transformer.h.1": 50}})
    r = gradclip("trend", tmp_path / "run", "--format", "json")
    assert r.code == 1, r.err
    doc = r.json()
    validate(doc, "trend-1")
    assert doc["status"] == "spike"
    assert [p["step"] for p in doc["points"]] == list(range(0, 120, 10))
    for point in doc["points"]:
        grads = saved[point["step"]]
        assert rel_err(as_float(point["total_norm"]), ref_norm(grads.values(), 2)) <= 1e-6
        for layer in LAYERS:
            members = [t for n, t in grads.items() if n.startswith(layer + ".")]
            assert rel_err(as_float(point["groups"][layer]), ref_norm(members, 2)) <= 1e-6
        assert point["nonfinite"] == {"nan": 0, "posinf": 0, "neginf": 0}
    newest = doc["points"][-1]
    assert newest["spike"] is True and "transformer.h.1" in newest["spike_groups"]
    assert newest["z"] > 2.5


def test_table_names_the_spiking_group_and_the_verdict_matches_the_exit_code(gradclip,
                                                                            tmp_path):
    save_run(tmp_path / "run", range(12), spikes={11: {"transformer.h.2": 100}})
    r = gradclip("trend", tmp_path / "run")
    assert r.code == 1
    lines = logical_lines(r.out)
    assert lines[-1].startswith("FAIL: gradient spike at the newest point (step 11")
    assert "transformer.h.2" in lines[-1] and lines[-1].endswith("(exit 1)")
    assert any("SPIKE" in line and "transformer.h.2" in line for line in lines)
    assert any(line.startswith("│ transformer.h.2") for line in lines)  # a sparkline row


def test_earlier_spike_fails_only_with_fail_on_any(gradclip, tmp_path):
    save_run(tmp_path / "run", range(14), spikes={8: {"transformer.h.0": 100}})
    r = gradclip("trend", tmp_path / "run", "--format", "json")
    doc = r.json()
    spikes = [p["step"] for p in doc["points"] if p["spike"]]
    assert 8 in spikes and doc["points"][-1]["spike"] is False
    assert (r.code, doc["status"]) == (0, "ok")
    r = gradclip("trend", tmp_path / "run", "--format", "json", "--fail-on", "any")
    assert (r.code, r.json()["status"]) == (1, "spike")


def test_fail_on_any_verdict_counts_spikes_and_nonfinite_points_apart(gradclip, tmp_path):
    """Spikes at steps 8 and 12, a NaN at step 10: the verdict says one non-finite point
    and two spikes, as the points' own flags say, not "non-finite gradients at 3 points"."""
    save_run(tmp_path / "run", [s for s in range(14) if s != 10],
             spikes={8: {"transformer.h.0": 100}, 12: {"transformer.h.1": 100}})
    grads = layer_grads(10)
    grads["transformer.h.2.mlp.weight"][0, 0] = math.nan
    torch.save({"grads": grads, "step": 10}, tmp_path / "run" / "grads-10.pt")
    doc = gradclip("trend", tmp_path / "run", "--fail-on", "any", "--format", "json").json()
    nonfinite = [p["step"] for p in doc["points"] if p["total_norm"] == "nan"]
    spikes = [p["step"] for p in doc["points"] if p["spike"] and p["step"] not in nonfinite]
    assert (nonfinite, spikes) == ([10], [8, 12])
    for args in (["-q"], ["--format", "markdown"]):
        r = gradclip("trend", tmp_path / "run", "--fail-on", "any", *args)
        verdict = next(line for line in logical_lines(r.out) if "FAIL" in line)
        verdict = verdict.replace("\\", "")  # Markdown's escapes off
        assert r.code == 1 and not verdict.startswith("FAIL: non-finite"), verdict
        assert ("at 3 point(s): 1 non-finite (step 10), 2 spike(s) (steps 8, 12); the last "
                "at step 12") in verdict, verdict


def test_points_are_ordered_by_step_entry_then_by_the_number_in_the_name(gradclip, tmp_path):
    # Names sort 1, 10, 2 as text; the step entries order them.
    save_run(tmp_path / "a", (1, 10, 2), name="ckpt_{step}.pt")
    doc = gradclip("trend", tmp_path / "a", "--format", "json").json()
    assert [p["step"] for p in doc["points"]] == [1, 2, 10]
    # Without a step entry: the last number in the name.
    save_run(tmp_path / "b", (3, 20, 100), name="run7-step{step}.pt", with_step=False)
    doc = gradclip("trend", *sorted((tmp_path / "b").iterdir(), reverse=True),
                   "--format", "json").json()
    assert [p["step"] for p in doc["points"]] == [3, 20, 100]


def test_without_steps_points_keep_the_order_given(gradclip, tmp_path):
    save_run(tmp_path, (5, 6, 7), name="grads-{step}.pt", with_step=False)
    named = [tmp_path / "x.pt", tmp_path / "y.pt", tmp_path / "z.pt"]
    for src, dst in zip(sorted(tmp_path.glob("grads-*.pt")), named):
        src.rename(dst)
    doc = gradclip("trend", named[2], named[0], named[1], "--format", "json").json()
    assert [p["source"] for p in doc["points"]] == [str(named[2]), str(named[0]), str(named[1])]
    assert all(p["step"] is None for p in doc["points"])
    assert doc["status"] == "insufficient_history"


def test_a_point_without_a_step_among_points_out_of_step_order_is_refused(gradclip, tmp_path):
    # A folder lists ckpt-10.pt before ckpt-2.pt; final.pt has no step, so the points
    # cannot be put in step order, and the order given contradicts the steps known.
    save_run(tmp_path / "run", (2, 10, 30), name="ckpt-{step}.pt")
    save_run(tmp_path / "x", (99,), with_step=False, name="final.pt")
    (tmp_path / "x" / "final.pt").rename(tmp_path / "run" / "final.pt")
    r = gradclip("trend", tmp_path / "run", "--format", "json")
    assert r.code == 2, r.out
    assert_no_report(r)
    final, ten, two = (str(tmp_path / "run" / n) for n in ("final.pt", "ckpt-10.pt", "ckpt-2.pt"))
    assert f"{final}: no step" in r.err and f"{two} (step 2) comes after {ten} (step 10)" in r.err
    assert len(r.err.strip().splitlines()) == 1
    # Given in step order, the order given is the run's order.
    in_order = [tmp_path / "run" / n for n in ("ckpt-2.pt", "ckpt-10.pt", "ckpt-30.pt", "final.pt")]
    doc = gradclip("trend", *in_order, "--format", "json").json()
    assert [p["step"] for p in doc["points"]] == [2, 10, 30, None]


def test_a_copy_of_the_newest_checkpoint_is_one_point_and_keeps_its_spike(gradclip, tmp_path):
    # Lightning's ModelCheckpoint(save_last=True) writes last.ckpt, a copy of the newest
    # checkpoint with its global_step. Counted twice, the copy was judged against a
    # history holding the spike itself and passed.
    run = tmp_path / "run"
    run.mkdir()
    norms = {s: 1 + 0.01 * (s % 3) for s in range(1, 31)} | {31: 2.3}
    for step, norm in norms.items():
        grads = {"l.w": torch.tensor([norm], dtype=torch.float64)}
        torch.save({"grads": grads, "step": step}, run / f"ckpt-{step}.pt")
    (run / "last.pt").write_bytes((run / "ckpt-31.pt").read_bytes())
    r = gradclip("trend", run, "--format", "json")
    assert r.code == 1, r.err
    doc = r.json()
    validate(doc, "trend-1")
    assert [p["step"] for p in doc["points"]] == list(range(1, 32))
    assert {p["step"]: p["total_norm"] for p in doc["points"]} == norms
    assert doc["status"] == "spike" and doc["points"][-1]["source"] == str(run / "ckpt-31.pt")
    # z by the spike rule (docs/reference/spike-rule.md): the plain mean and variance of
    # steps 1-25, exponential averages (alpha 0.97) over steps 26-30, std floored at mean / 2.
    seed = [norms[s] for s in range(1, 26)]
    mean = math.fsum(seed) / 25
    var = math.fsum((x - mean) ** 2 for x in seed) / 25
    for step in range(26, 31):
        mean = 0.97 * mean + 0.03 * norms[step]
        var = 0.97 * var + 0.03 * (norms[step] - mean) ** 2
    z = (2.3 - mean) / max(math.sqrt(var), mean / 2)
    assert z > 2.5 and abs(doc["points"][-1]["z"] - z) <= 1e-12
    assert doc["notes"] == [f"{run / 'last.pt'}: the same step (31) and norms as "
                            f"{run / 'ckpt-31.pt'}: one point"]


def test_two_checkpoints_trainer_states_are_one_series_with_one_note(gradclip, tmp_path):
    # checkpoint-20's log_history starts with checkpoint-10's: those steps once each.
    history = [{"loss": 1.0, "grad_norm": 1.0 + 0.01 * (s % 3), "step": s} for s in range(1, 21)]
    states = []
    for step in (10, 20):
        (tmp_path / f"checkpoint-{step}").mkdir()
        states.append(tmp_path / f"checkpoint-{step}" / "trainer_state.json")
        states[-1].write_text(json.dumps({"global_step": step, "log_history": history[:step]}))
    doc = gradclip("trend", *states, "--format", "json").json()
    assert [p["step"] for p in doc["points"]] == list(range(1, 21))
    assert [p["source"] for p in doc["points"]] == [str(states[0])] * 10 + [str(states[1])] * 10
    assert doc["notes"] == [f"{states[1]}: the same 10 steps (1-10) and norms as {states[0]}: "
                            "one point each"]


def test_one_step_with_other_norms_from_two_inputs_is_refused(gradclip, tmp_path):
    save_run(tmp_path / "a", (1, 2, 3))
    save_run(tmp_path / "b", (3,), spikes={3: {"transformer.h.0": 2.0}})
    r = gradclip("trend", tmp_path / "a", tmp_path / "b", "--format", "json")
    assert r.code == 2
    assert_no_report(r)
    assert (f"{tmp_path / 'b' / 'grads-3.pt'} and {tmp_path / 'a' / 'grads-3.pt'} both give "
            "step 3, with other norms") in r.err


def test_one_step_refused_shows_the_norms_apart(gradclip, tmp_path):
    """A run's monitor log (float64 norms) beside a log of its float32 norms: the
    message shows the digits where they differ, not two equal-looking numbers."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(monitor_line(1, 0.76310912345, {"x": 0.5}))
    b.write_text(monitor_line(1, 0.76310915, {"x": 0.5}))
    r = gradclip("trend", a, b)
    assert r.code == 2
    assert "with other norms (0.7631092 and 0.7631091)" in r.err
    b.write_text(monitor_line(1, 0.76310912345, {"x": 0.6}))
    r = gradclip("trend", a, b)
    assert r.code == 2 and "the same total, other groups or non-finite counts" in r.err


def test_a_file_under_several_names_is_one_point(gradclip, tmp_path):
    # timm's CheckpointSaver hard-links last.pth.tar and model_best.pth.tar to a
    # checkpoint-N.pth.tar: one checkpoint, one point, under its first name.
    save_run(tmp_path, (1, 2, 3), name="checkpoint-{step}.pth.tar")
    (tmp_path / "last.pth.tar").hardlink_to(tmp_path / "checkpoint-3.pth.tar")
    (tmp_path / "model_best.pth.tar").hardlink_to(tmp_path / "checkpoint-2.pth.tar")
    doc = gradclip("trend", tmp_path, "--format", "json").json()
    assert [p["source"] for p in doc["points"]] == [
        str(tmp_path / f"checkpoint-{n}.pth.tar") for n in (1, 2, 3)]


def test_hf_output_dir_of_numbered_checkpoint_folders_is_a_series(gradclip, tmp_path):
    # checkpoint-N/ folders in step order; a folder that is no checkpoint layout
    # is read as a folder of files.
    for step in (5, 50, 500):
        save_run(tmp_path / f"checkpoint-{step}", (step,), name="grads.pt", with_step=False)
    doc = gradclip("trend", tmp_path, "--format", "json").json()
    assert [p["step"] for p in doc["points"]] == [5, 50, 500]


def test_nonfinite_newest_point_is_status_nonfinite(gradclip, tmp_path):
    save_run(tmp_path / "run", range(8))
    grads = layer_grads(8)
    grads["transformer.h.0.mlp.weight"][0, 0] = math.nan
    torch.save({"grads": grads, "step": 8}, tmp_path / "run" / "grads-8.pt")
    r = gradclip("trend", tmp_path / "run", "--format", "json")
    assert r.code == 1
    doc = r.json()
    validate(doc, "trend-1")
    newest = doc["points"][-1]
    assert doc["status"] == "nonfinite" and newest["total_norm"] == "nan"
    assert newest["nonfinite"] == {"nan": 1, "posinf": 0, "neginf": 0}
    assert newest["nonfinite_groups"] == ["transformer.h.0"]


def test_a_total_beyond_float64s_range_is_not_called_non_finite_gradients(gradclip, tmp_path):
    """float64 gradients of finite values whose 2-norm is beyond float64's range (inspect:
    overflow): the newest point fails (JSON status stays ``nonfinite``, the contract's
    set), but every verdict said "non-finite gradients", which none of them is."""
    save_run(tmp_path / "run", range(8))
    huge = {k: v.double() for k, v in layer_grads(8).items()}
    huge["transformer.h.0.mlp.weight"].fill_(1e308)
    torch.save({"grads": huge, "step": 8}, tmp_path / "run" / "grads-8.pt")
    values = torch.cat([v.flatten() for v in huge.values()])
    assert bool(values.isfinite().all()) and math.isinf(float(values.norm()))
    doc = gradclip("trend", tmp_path / "run", "--format", "json").json()
    newest = doc["points"][-1]
    assert doc["status"] == "nonfinite" and newest["total_norm"] == "inf"
    assert newest["nonfinite"] == {"nan": 0, "posinf": 0, "neginf": 0}
    for args in ((), ("-q",), ("--format", "markdown"), ("--format", "github"),
                 ("--format", "junit"), ("--fail-on", "any")):
        r = gradclip("trend", tmp_path / "run", *args)
        assert r.code == 1, r.err
        text = html.unescape(unwrapped(r.out)).replace("\\", "")
        assert "non-finite gradient" not in text, text
        assert "gradient norm beyond float64's range" in text, text


def test_too_little_history_is_exit_0_insufficient_history(gradclip, tmp_path):
    save_run(tmp_path / "run", range(5), spikes={4: {"transformer.h.0": 1000}})
    r = gradclip("trend", tmp_path / "run", "--format", "json")
    assert (r.code, r.json()["status"]) == (0, "insufficient_history")
    assert r.json()["points"][-1]["z"] is None


def test_output_file_gets_the_report_and_stdout_stays_empty(gradclip, tmp_path):
    save_run(tmp_path / "run", range(7))
    target = tmp_path / "trend.json"
    r = gradclip("trend", tmp_path / "run", "--format", "json", "--output-file", target)
    assert r.code == 0 and r.out == ""
    validate(json.loads(target.read_text()), "trend-1")


# -- logs ----------------------------------------------------------------------


def test_monitor_log_spike_names_the_group(gradclip, tmp_path):
    log = tmp_path / "grads.jsonl"
    lines = [monitor_line(s, 1.0 + 0.01 * (s % 3), {"a": 0.8 + 0.01 * (s % 2), "b": 0.6})
             for s in range(30)]
    lines.append(monitor_line(30, 1.5, {"a": 0.8, "b": 60.0}))
    log.write_text("".join(lines))
    r = gradclip("trend", log, "--format", "json")
    assert r.code == 1, r.err
    doc = r.json()
    validate(doc, "trend-1")
    assert doc["norm_type"] == 2.0 and len(doc["points"]) == 31
    newest = doc["points"][-1]
    assert newest["spike_groups"] == ["b"] and newest["source"] == str(log)
    assert newest["groups"] == {"a": 0.8, "b": 60.0}


@pytest.mark.parametrize("fmt", ["github", "junit"])
def test_a_group_finding_states_the_groups_threshold_not_the_totals(gradclip, tmp_path, fmt):
    """Five groups judged at once must each pass the groups' z (spike-rule.md), not --z:
    the finding that names a spiking group states the threshold it crossed."""
    log = tmp_path / "grads.jsonl"
    names = ("a", "b", "c", "d", "e")
    lines = [monitor_line(s, 1.0 + 0.01 * (s % 3), {n: 0.8 + 0.01 * (s % 2) for n in names})
             for s in range(30)]
    lines.append(monitor_line(30, 1.5, {**{n: 0.8 for n in names}, "e": 60.0}))
    log.write_text("".join(lines))
    r = gradclip("trend", log, "--format", fmt)
    assert r.code == 1, r.err
    text = html.unescape(r.out)  # junit writes ">" as "&gt;"
    found = [line for line in text.splitlines() if "group e norm 60" in line]
    assert len(found) == 1, r.out
    assert f"z > {group_z(2.5, 5):.3g}"[1:] in found[0] and "> 2.5" not in found[0]


def test_a_logs_groups_are_the_monitors_and_group_by_is_refused_on_it(gradclip, tmp_path):
    """A log holds the norms of the groups GradMonitor made; trend cannot regroup them,
    so the report does not say they follow --group-by, and an explicit one is exit 2."""
    log = tmp_path / "grads.jsonl"
    log.write_text("".join(monitor_line(s, 1.0, {"a.b": 0.8, "c": 0.6}) for s in range(6)))
    doc = gradclip("trend", log, "--format", "json").json()
    assert doc["group_by"] == "the log's writer"
    assert doc["points"][0]["groups"] == {"a.b": 0.8, "c": 0.6}
    assert "groups by the log's writer;" in gradclip("trend", log).out
    for rule in ("depth:1", "layer"):
        r = gradclip("trend", log, "--group-by", rule, "--format", "json")
        assert r.code == 2, r.err
        assert r.json()["schema"] == "gradclip.error/1"
        assert "grads.jsonl" in r.err and "leave --group-by out" in r.err
    # Beside checkpoints, each keeps its own grouping, and the report says which is which.
    save_run(tmp_path / "run", [10, 11])
    doc = gradclip("trend", log, tmp_path / "run", "--format", "json").json()
    assert doc["group_by"] == "layer (checkpoints), the log's writer (logs)"
    assert set(doc["points"][-1]["groups"]) == set(LAYERS)
    by_module = gradclip("trend", tmp_path / "run", "--group-by", "depth:1", "--format", "json")
    assert by_module.code == 0 and by_module.json()["group_by"] == "depth:1"


def test_monitor_log_nonfinite_and_its_norm_type(gradclip, tmp_path):
    log = tmp_path / "grads.jsonl"
    lines = [monitor_line(s, 2.0, {"a": 2.0}, norm_type=math.inf) for s in range(6)]
    lines.append(monitor_line(6, math.nan, {"a": math.nan}, (3, 0, 0), norm_type=math.inf))
    log.write_text("".join(lines).replace("Infinity", '"inf"'))
    r = gradclip("trend", log, "--format", "json")
    assert r.code == 1
    doc = r.json()
    assert doc["status"] == "nonfinite" and doc["norm_type"] == "inf"
    assert doc["points"][-1]["nonfinite"] == {"nan": 3, "posinf": 0, "neginf": 0}
    r = gradclip("trend", log, "--norm-type", "2")
    assert r.code == 2 and "p=inf" in r.err and str(log) in r.err


def test_monitor_log_unfinished_last_line_is_skipped_with_a_warning(gradclip, tmp_path):
    log = tmp_path / "grads.jsonl"
    log.write_text("".join(monitor_line(s, 1.0, {}) for s in range(7)) + '{"schema": "gra')
    r = gradclip("trend", log, "--format", "json")
    assert r.code == 0 and len(r.json()["points"]) == 7
    assert f"{log}:8: last line has no newline" in r.err


def test_monitor_log_of_a_resumed_run_keeps_the_resumed_steps(gradclip, tmp_path):
    """A run that crashed at step 30 (NaN) and resumed from its step-20 checkpoint
    appends steps 21.. to the same log: the replayed steps supersede the crashed
    run's, whose later lines are no longer the run's history."""
    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    log = tmp_path / "grads.jsonl"

    def train(steps, nan_at=None):
        with GradMonitor(model, log=log, dump_dir=None) as monitor:
            for step in steps:
                model.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                if step == nan_at:
                    model[0].weight.grad[0, 0] = math.nan
                monitor.step(step)

    train(range(1, 31), nan_at=30)
    crashed = log.read_text().splitlines(keepends=True)
    train(range(21, 29))
    resumed = log.read_text().splitlines(keepends=True)[30:]
    spliced = tmp_path / "spliced.jsonl"  # the run's history as it happened
    spliced.write_text("".join(crashed[:20] + resumed))

    r = gradclip("trend", log, "--format", "json")
    assert r.code == 0, r.err
    doc = r.json()
    validate(doc, "trend-1")
    assert [p["step"] for p in doc["points"]] == list(range(1, 29))
    assert doc["status"] == "ok"
    assert f"{log}:31: step 21 follows step 30" in r.err
    assert "10 earlier line(s) for steps 21-30 are superseded" in r.err
    want = gradclip("trend", spliced, "--format", "json").json()
    for point in (*doc["points"], *want["points"]):
        point.pop("source")
    assert doc["points"] == want["points"]


def test_trainer_state_of_a_real_run_finds_the_injected_spike(gradclip, trainer_state):
    r = gradclip("trend", trainer_state, "--format", "json", "--fail-on", "any")
    assert r.code == 1, r.err
    doc = r.json()
    validate(doc, "trend-1")
    history = json.loads(trainer_state.read_text())["log_history"]
    logged = {e["step"]: e["grad_norm"] for e in history if "grad_norm" in e}
    assert [p["step"] for p in doc["points"]] == list(range(1, STEPS + 1))
    assert {p["step"]: p["total_norm"] for p in doc["points"]} == logged
    assert all(p["nonfinite"] is None and p["groups"] == {} for p in doc["points"])
    assert [p["step"] for p in doc["points"] if p["spike"]] == [SPIKE_STEP]
    # The newest point is healthy: the default --fail-on newest passes.
    r = gradclip("trend", trainer_state)
    assert r.code == 0 and f"; earlier: 1 spike(s) (step {SPIKE_STEP})" in unwrapped(r.out)


@pytest.mark.parametrize("kind", ["monitor", "trainer-state"])
def test_a_negative_logged_norm_is_refused(gradclip, tmp_path, kind):
    # Judged, -1 after a history of ones was a calm step (z -4, exit 0).
    if kind == "monitor":
        log = tmp_path / "grads.jsonl"
        log.write_text("".join(monitor_line(s, -1.0 if s == 7 else 1.0, {}) for s in range(8)))
        where = f"{log}:8: a norm must be >= 0, got -1.0"
    else:
        log = tmp_path / "trainer_state.json"
        history = [{"grad_norm": -1.0 if s == 7 else 1.0, "step": s} for s in range(8)]
        log.write_text(json.dumps({"log_history": history}))
        where = f"{log}: log_history[7]: grad_norm must be >= 0, got -1"
    r = gradclip("trend", log, "--format", "json")
    assert r.code == 3
    assert_no_report(r)
    assert r.err_lines == [f"gradclip: {where}"]


def test_trainer_state_with_a_step_logged_twice_is_refused(gradclip, tmp_path):
    state = tmp_path / "trainer_state.json"
    history = [{"loss": 1.0, "grad_norm": 1.0 + s, "step": s} for s in (1, 2, 3, 2)]
    state.write_text(json.dumps({"global_step": 3, "log_history": history}))
    r = gradclip("trend", state, "--format", "json")
    assert r.code == 3
    assert_no_report(r)
    assert r.err == (f"gradclip: {state}: log_history[3]: grad_norm of step 2 after one of "
                     "step 3; a Trainer logs each step once, in order\n")


def test_trainer_state_and_checkpoints_mix_in_step_order(gradclip, tmp_path):
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 4, "log_history": [
        {"loss": 1.0, "grad_norm": 2.0, "step": 2}, {"eval_loss": 1.0, "step": 2},
        {"loss": 1.0, "grad_norm": math.nan, "step": 4}]}))  # json writes NaN
    save_run(tmp_path / "ck", (1, 3))
    doc = gradclip("trend", tmp_path / "ck", state, "--format", "json").json()
    assert [p["step"] for p in doc["points"]] == [1, 2, 3, 4]
    assert doc["points"][-1]["total_norm"] == "nan" and doc["status"] == "nonfinite"


# -- a real Trainer run's own checkpoint-N/ folders ------------------------------


@pytest.fixture(scope="session")
def checkpointed_run(tmp_path_factory):
    """A real Trainer run saving checkpoint-N/ every step, spike injected (made once)."""
    return train_checkpointed_with_spike(tmp_path_factory.mktemp("hf_ckpt_run"))


def optimizer_reference(run, step: int, what: str) -> dict[str, float]:
    """``what``'s norm in float64 straight from ``checkpoint-N/optimizer.pt``: the
    total and per layer (``transformer.h.K``), names from the live model's groups."""
    saved = torch.load(run.output_dir / f"checkpoint-{step}" / "optimizer.pt",
                       weights_only=True)
    names = [n for group in run.group_names for n in group]
    ids = [pid for group in saved["param_groups"] for pid in group["params"]]
    hyper = {pid: group for group in saved["param_groups"] for pid in group["params"]}
    assert len(ids) == len(names)
    values = {}
    for pid, name in zip(ids, names):
        state, group = saved["state"][pid], hyper[pid]
        t = float(state["step"])
        beta1, beta2 = group["betas"]
        m_hat = state["exp_avg"].double() / (1 - beta1 ** t)
        v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** t)
        values[name] = {"exp_avg": m_hat, "grad_rms": v_hat.sqrt(),
                        "update": group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])}[what]
    ref = {"total": ref_norm(values.values(), 2)}
    for layer in ("transformer.h.0", "transformer.h.1"):
        ref[layer] = ref_norm([v for n, v in values.items() if n.startswith(layer + ".")], 2)
    return ref


def test_trainer_checkpoints_exp_avg_finds_the_injected_spike(gradclip, checkpointed_run):
    run = checkpointed_run
    # The run's output_dir: one point per checkpoint-N/, in step order.
    r = gradclip("trend", run.output_dir, "--what", "exp_avg", "--format", "json",
                 "--fail-on", "any")
    assert r.code == 1, r.err
    doc = r.json()
    validate(doc, "trend-1")
    assert doc["what"] == "exp_avg" and doc["status"] == "spike"
    assert [p["step"] for p in doc["points"]] == list(range(1, run.steps + 1))
    assert {p["what"] for p in doc["points"]} == {"exp_avg"}
    # Adam's first moment jumps by (1 - beta1) * g at the spike and decays after it:
    # the first spike is the injected step, none before it.
    spikes = [p["step"] for p in doc["points"] if p["spike"]]
    assert spikes[0] == run.spike_step and spikes == list(range(run.spike_step, run.steps + 1))
    for point in doc["points"]:
        ref = optimizer_reference(run, point["step"], "exp_avg")
        assert rel_err(point["total_norm"], ref["total"]) <= 1e-6, point["step"]
        for layer in ("transformer.h.0", "transformer.h.1"):
            assert rel_err(point["groups"][layer], ref[layer]) <= 1e-6, (point["step"], layer)
    # Up to the spike: the newest point is the spike, exit 1 under the default --fail-on.
    upto = [run.output_dir / f"checkpoint-{s}" for s in range(1, run.spike_step + 1)]
    r = gradclip("trend", *reversed(upto), "--what", "exp_avg", "--format", "json")
    assert r.code == 1, r.err
    doc = r.json()
    assert doc["status"] == "spike" and doc["points"][-1]["step"] == run.spike_step
    assert doc["points"][-1]["z"] > 2.5 and not any(p["spike"] for p in doc["points"][:-1])
    assert "transformer.h.0" in doc["points"][-1]["spike_groups"]
    table = gradclip("trend", *upto, "--what", "exp_avg")  # the verdict names what spiked
    assert logical_lines(table.out)[-1].startswith(
        f"FAIL: AdamW exp_avg spike at the newest point (step {run.spike_step}")
    r = gradclip("trend", *upto[:-1], "--what", "exp_avg", "--format", "json")
    assert (r.code, r.json()["status"]) == (0, "ok")


@pytest.mark.parametrize("what", ["grad_rms", "update"])
def test_trainer_checkpoints_other_moments_match_float64(gradclip, checkpointed_run, what):
    run = checkpointed_run
    r = gradclip("trend", run.output_dir, "--what", what, "--format", "json")
    doc = r.json()
    validate(doc, "trend-1")
    assert doc["what"] == what
    # update is formed elementwise in float32 before its norm: a few ulps more.
    tolerance = 1e-6 if what == "grad_rms" else 4e-6
    for point in doc["points"]:
        ref = optimizer_reference(run, point["step"], what)
        assert rel_err(point["total_norm"], ref["total"]) <= tolerance, point["step"]
        for layer in ("transformer.h.0", "transformer.h.1"):
            assert rel_err(point["groups"][layer], ref[layer]) <= tolerance
    if what == "grad_rms":
        # exp_avg_sq jumps by (1 - beta2) * g**2: the RMS moves at the spike.
        assert [p["step"] for p in doc["points"] if p["spike"]][0] == run.spike_step
        assert r.code == 1 and doc["points"][-1]["spike"]


def test_trainer_checkpoints_auto_measures_exp_avg_and_the_output_dir_its_log(
        gradclip, checkpointed_run):
    run = checkpointed_run
    last = run.output_dir / f"checkpoint-{run.steps}"
    doc = gradclip("trend", last, "--format", "json").json()
    assert doc["what"] == "exp_avg" and doc["points"][0]["what"] == "exp_avg"
    r = gradclip("trend", *sorted(run.output_dir.glob("checkpoint-*")))
    assert r.out.splitlines()[0].startswith(f"{run.steps} points, exp_avg, p=2")
    # The output_dir holds as many steps of log_history as checkpoints: the log, which
    # holds the gradients' own norms, is judged, and the checkpoints are named.
    lines = logical_lines(gradclip("trend", run.output_dir).out)
    assert lines[0].startswith(f"{run.steps} points, grads, p=2")
    assert lines[1].startswith(f"judged: {run.output_dir / 'trainer_state.json'} (Trainer "
                               "log_history grad_norm")
    assert any(line.startswith("not judged: ") and "--what exp_avg trends the checkpoints"
               in line for line in lines)
    # This run trained with max_grad_norm=0: its moments saw every gradient.
    assert any(line.startswith("clipping: the Trainer did not clip (max_grad_norm 0 ")
               for line in lines)


def test_trainer_run_state_finds_the_same_spike(gradclip, checkpointed_run):
    run = checkpointed_run
    state = run.output_dir / f"checkpoint-{run.spike_step}" / "trainer_state.json"
    r = gradclip("trend", state, "--format", "json")
    assert r.code == 1, r.err
    doc = r.json()
    assert doc["what"] == "grads" and doc["status"] == "spike"
    logged = {e["step"]: e["grad_norm"] for e in json.loads(state.read_text())["log_history"]
              if "grad_norm" in e}
    assert {p["step"]: p["total_norm"] for p in doc["points"]} == logged
    assert [p["step"] for p in doc["points"] if p["spike"]] == [run.spike_step]


def test_checkpoints_and_logs_of_different_kinds_are_refused(gradclip, checkpointed_run,
                                                             tmp_path):
    run = checkpointed_run
    state = run.output_dir / "trainer_state.json"
    checkpoints = sorted(run.output_dir.glob("checkpoint-*"))
    r = gradclip("trend", *checkpoints, state, "--format", "json")
    assert r.code == 2 and len(r.err_lines) == 1
    assert "measures exp_avg" in r.err and "measures grads" in r.err and str(state) in r.err
    assert_no_report(r)
    r = gradclip("trend", state, "--what", "update")
    assert r.code == 2 and len(r.err_lines) == 1 and "--what update" in r.err
    assert str(state) in r.err and r.out == ""
    # auto picks per checkpoint: one holding gradients, one holding Adam state only.
    save_run(tmp_path, (1,), name="grads-{step}.pt")
    r = gradclip("trend", tmp_path / "grads-1.pt", run.output_dir / "checkpoint-2")
    assert r.code == 2 and len(r.err_lines) == 1
    # Neither holds what the other measures: no --what would work, so none is offered.
    assert "trend them apart" in r.err and "--what" not in r.err and "grads-1.pt" in r.err
    assert_no_report(r)


# -- plot ----------------------------------------------------------------------


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".svg", b"<?xml")])
def test_plot_writes_the_picture(gradclip, tmp_path, suffix, magic):
    save_run(tmp_path / "run", range(8), spikes={7: {"transformer.h.0": 100}})
    picture = tmp_path / f"norms{suffix}"
    r = gradclip("trend", tmp_path / "run", "--plot", picture, "--format", "json")
    assert r.code == 1 and r.json()["status"] == "spike"
    assert picture.read_bytes().startswith(magic)


def test_plot_without_matplotlib_is_a_usage_error(gradclip, tmp_path, monkeypatch):
    save_run(tmp_path / "run", range(3))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    r = gradclip("trend", tmp_path / "run", "--plot", tmp_path / "p.png")
    assert r.code == 2 and r.out == ""
    assert "pip install 'gradclip[plot]'" in r.err and not (tmp_path / "p.png").exists()


# -- bad input -----------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["--fail-on", "oldest"], "--fail-on"),
    (["--z", "0"], "--z"),
    (["--alpha", "1"], "--alpha"),
    (["--warmup", "0"], "--warmup"),
    (["--plot", "p.jpg"], ".png or .svg"),
    (["--what", "moments"], "--what"),
    (["--norm-type", "-1"], "--norm-type"),
    (["--format", "xml"], "--format"),
])  # fmt: skip
def test_bad_flags_are_exit_2_with_one_line(gradclip, tmp_path, args, words):
    save_run(tmp_path / "run", range(3))
    r = gradclip("trend", tmp_path / "run", *args, "--format", "json") if "--format" not in \
        args else gradclip("trend", tmp_path / "run", *args)
    assert r.code == 2, r.err
    assert words in r.err and len(r.err_lines) == 1
    assert_no_report(r)


def _bad_log(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("make, words", [
    (lambda d: _bad_log(d / "m.jsonl", monitor_line(1, 1.0, {}) + "{oops\n"),
     "m.jsonl:2: not a JSON"),
    (lambda d: _bad_log(d / "m.jsonl", monitor_line(1, 1.0, {}) + '{"schema": "x"}\n'),
     "m.jsonl:2: not a gradclip.monitor/1"),
    (lambda d: _bad_log(d / "m.jsonl", monitor_line(1, 1.0, {}).replace("1.0", '"big"')),
     "a norm must be a number"),
    (lambda d: _bad_log(d / "m.jsonl",
                        monitor_line(1, 1.0, {}).replace('"step": 1', '"step": 1.5')),
     '"step" must be a whole number'),
    (lambda d: _bad_log(d / "t.json", '{"log_history": [{"loss": 1.0, "step": 1}]}'),
     "no log_history entry has a grad_norm"),
    (lambda d: _bad_log(d / "t.json", '{"log_history": {"grad_norm": 1}}'),
     '"log_history" must be a list'),
    (lambda d: _bad_log(d / "t.json", '{"log_history": [{"grad_norm": "x", "step": 1}]}'),
     "grad_norm must be a number"),
    (lambda d: _bad_log(d / "t.json", '{"log_history": [{"grad_norm": 1.0, "step": 1}'),
     "not valid JSON"),
    (lambda d: d / "missing.pt", "no such file"),
    (lambda d: _bad_log(d / "notes.txt", "hello"), "not a checkpoint"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "neither a checkpoint"),
])  # fmt: skip
def test_bad_inputs_are_exit_3_naming_the_file(gradclip, tmp_path, make, words):
    path = make(tmp_path)
    r = gradclip("trend", path, "--format", "json")
    assert r.code == 3, (r.code, r.err)
    assert words in r.err and str(path) in r.err and len(r.err_lines) == 1
    assert_no_report(r)


def test_mixed_kinds_suggest_only_what_every_checkpoint_holds(gradclip, tmp_path):
    """Adam's state beside a weights-only save (torchtitan's last save is one): the
    refusal offers --what weights alone, and following it measures both."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1},
               tmp_path / "ckpt-1.pt")
    torch.save(model.state_dict(), tmp_path / "ckpt-2.pt")
    paths = [tmp_path / "ckpt-1.pt", tmp_path / "ckpt-2.pt"]
    r = gradclip("trend", *paths)
    assert r.code == 2 and "--what weights" in r.err and "--what exp_avg" not in r.err, r.err
    doc = gradclip("trend", *paths, "--what", "weights", "--format", "json").json()
    want = float(torch.cat([p.detach().double().flatten() for p in model.parameters()]).norm())
    assert [p["total_norm"] for p in doc["points"]] == pytest.approx([want, want], rel=1e-6)


def test_monitor_log_in_two_norm_types_names_the_file_and_where_p_changes(gradclip, tmp_path):
    """A monitor recreated with another norm_type appending to the same log: trend said
    "another input" uses the other p (exit 2), though there is one file. It is the file's
    content that is inconsistent (exit 3): the refusal names the file, the steps of each
    p, and the --norm-type that reads one p's lines alone; each suggestion succeeds."""
    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    log = tmp_path / "grads.jsonl"
    logged = {}
    for p, steps in ((2.0, range(0, 8)), (1.0, range(8, 14))):
        with GradMonitor(model, log=log, dump_dir=None, norm_type=p) as monitor:
            for step in steps:
                model.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                grads = [q.grad.double().flatten() for q in model.parameters()]
                logged[step] = (p, float(torch.cat(grads).norm(p)))
                monitor.step(step)

    r = gradclip("trend", log)
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert "another input" not in line, line
    assert line.startswith(f"gradclip: {log}: "), line
    assert "p=2 at steps 0-7" in line and "p=1 at steps 8-13" in line, line
    suggested = [("2", range(0, 8)), ("1", range(8, 14))]
    for p, _ in suggested:
        assert f"--norm-type {p}" in line, line
    for p, steps in suggested:
        ok = gradclip("trend", log, "--norm-type", p, "--format", "json")
        assert ok.code == 0, ok.err
        doc = ok.json()
        validate(doc, "trend-1")
        assert doc["norm_type"] == float(p)
        assert [q["step"] for q in doc["points"]] == list(steps)
        for point in doc["points"]:
            want_p, want = logged[point["step"]]
            assert want_p == float(p)
            assert rel_err(point["total_norm"], want) < 1e-5
        other = "1" if p == "2" else "2"
        assert any(f"p={other}" in n and "left out" in n for n in doc["notes"]), doc["notes"]


def test_a_single_monitor_logs_notes_are_not_called_a_run_folder(gradclip, tmp_path):
    """trend given one monitor log file (no folder): its notes (here, the steps the
    monitor clipped) reached GitHub as notices titled "run folder"."""
    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log=log, dump_dir=None) as monitor:
        for step in range(8):
            model.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().mul(100).backward()
            monitor.clip_grad_norm_(max_norm=1e-3, step=step)
    r = gradclip("trend", log, "--format", "github")
    assert r.code == 0, r.err
    notices = [line for line in r.out.splitlines() if line.startswith("::notice title=")]
    assert notices, r.out  # the note on what the monitor clipped
    assert not any("run folder" in line for line in notices), notices
