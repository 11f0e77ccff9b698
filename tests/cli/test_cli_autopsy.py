"""``gradclip autopsy`` on real runs written by the libraries themselves (a plain torch loop
with ``GradMonitor`` and ``torch.save``, a Hugging Face ``Trainer`` with gradclip's callback
and its own checkpoints): the injected layer named first at its step, nothing in a clean
run, every number checked against float64 arithmetic on the files, every bad input one
line naming the file (``benchmarks/autopsy_rates.py`` makes the runs and reports the rates
over more seeds)."""

from __future__ import annotations

import json
import math
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch

from benchmarks import autopsy_rates as A
from tests.schemas import validate

from .support import logical_lines

SPIKE = A.SPIKE_STEP


@pytest.fixture(scope="session")
def torch_spiked(tmp_path_factory):
    """Seed 0: fc1's gradients x20 at step 40 (made once a session, about 3 s)."""
    return A.make_run("torch", 0, True, tmp_path_factory.mktemp("autopsy") / "torch-spiked")


@pytest.fixture(scope="session")
def torch_clean(tmp_path_factory):
    return A.make_run("torch", 0, False, tmp_path_factory.mktemp("autopsy") / "torch-clean")


@pytest.fixture(scope="session")
def trainer_spiked(tmp_path_factory):
    """Seed 2: transformer.wpe's gradients x100 at step 40, checkpoint-N/ by the Trainer."""
    pytest.importorskip("transformers")
    return A.make_run("trainer", 2, True, tmp_path_factory.mktemp("autopsy") / "hf-spiked")


@pytest.fixture(scope="session")
def lightning_spiked(tmp_path_factory):
    """Seed 1: net.2's gradients x50 at step 40, gradclip's Lightning callback, checkpoints
    by trainer.save_checkpoint."""
    pytest.importorskip("lightning.pytorch")
    return A.make_run("lightning", 1, True, tmp_path_factory.mktemp("autopsy") / "pl-spiked")


def autopsy_json(gradclip, *args):
    r = gradclip("autopsy", *args, "--format", "json")
    doc = r.json()
    validate(doc, "autopsy-1")
    return r, doc


def by_name(doc) -> dict[str, dict]:
    return {g["name"]: g for g in doc["groups"]}


# -- what it finds ---------------------------------------------------------------------


@pytest.mark.parametrize("run", ["torch_spiked", "lightning_spiked", "trainer_spiked"])
def test_the_injected_layer_is_named_first_at_its_step(gradclip, request, run):
    run = request.getfixturevalue(run)
    r, doc = autopsy_json(gradclip, run.folder)
    assert r.code == 1, r.err
    assert doc["status"] == "explained"
    first = doc["groups"][0]
    assert first["name"] == run.layer and first["rank"] == 1 and first["onset"] == SPIKE
    assert doc["step"] == SPIKE
    # Only the injected layer began at the spike; the total crossed there too.
    assert doc["total_onset"]["step"] == SPIKE and first["lead"] == 0
    assert all(g["onset"] is None for g in doc["groups"][1:])
    assert doc["verdict"].startswith(f"step {SPIKE}: spike; began in {run.layer} at step {SPIKE}")


def test_a_clean_run_has_nothing_to_explain(gradclip, torch_clean):
    r, doc = autopsy_json(gradclip, torch_clean.folder)
    assert r.code == 0, r.err
    assert doc["status"] == "nothing" and doc["step"] is None and doc["groups"] == []
    assert doc["verdict"].startswith("nothing to explain")


def test_a_clean_step_asked_for_is_nothing_exit_0(gradclip, torch_spiked):
    r, doc = autopsy_json(gradclip, torch_spiked.folder, "--step", "30")
    assert r.code == 0, r.err
    assert doc["status"] == "nothing" and doc["step"] == 30
    assert doc["verdict"].startswith("step 30: nothing to explain")


# -- every number against float64 arithmetic on the files -------------------------------


def _log(run) -> dict[int, dict]:
    return {e["step"]: e for e in map(json.loads, (run.folder / A.LOG).read_text().splitlines())}


def _checkpoint(run, optimizer_steps: int) -> dict:
    return torch.load(run.folder / "checkpoints" / f"step-{optimizer_steps}.pt",
                      weights_only=True)


def _named_state(ckpt) -> dict[str, dict]:
    """Adam's state by parameter name: the ids follow model.parameters(), the state_dict's
    order for this model (no buffers)."""
    names = list(ckpt["model"])
    return {names[i]: s for i, s in ckpt["optimizer"]["state"].items()}


def _group(names, layer):
    return [n for n in names if n.startswith(layer + ".")]


def _norm64(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def test_changes_are_the_files_numbers(gradclip, torch_spiked):
    run = torch_spiked
    _, doc = autopsy_json(gradclip, run.folder)
    layer = by_name(doc)[run.layer]
    changes = layer["changes"]
    log = _log(run)
    # grads: the log's own numbers at steps 39 and 40.
    assert changes["grads"]["before"] == log[SPIKE - 1]["groups"][run.layer]
    assert changes["grads"]["after"] == log[SPIKE]["groups"][run.layer]
    # The log counts from 0: the checkpoint after 40 optimizer steps holds step 39's
    # gradient last (placed at 39), the one after 41 holds step 40's (placed at 40).
    before, after = _checkpoint(run, SPIKE), _checkpoint(run, SPIKE + 1)
    assert changes["exp_avg"]["before_step"] == SPIKE - 1
    assert changes["exp_avg"]["after_step"] == SPIKE
    assert changes["exp_avg"]["after_source"].endswith(f"step-{SPIKE + 1}.pt")
    betas = before["optimizer"]["param_groups"][0]["betas"]
    lr = before["optimizer"]["param_groups"][0]["lr"]
    eps = before["optimizer"]["param_groups"][0]["eps"]

    def quantities(ckpt):
        state = _named_state(ckpt)
        names = _group(state, run.layer)
        out = {"exp_avg": [], "grad_rms": [], "update": [], "weights": []}
        for n in names:
            s = state[n]
            t = float(s["step"])
            m = s["exp_avg"].double() / (1 - betas[0] ** t)
            v = s["exp_avg_sq"].double() / (1 - betas[1] ** t)
            out["exp_avg"].append(m)
            out["grad_rms"].append(v.sqrt())
            out["update"].append(lr * m / (v.sqrt() + eps))
            out["weights"].append(ckpt["model"][n])
        norms = {q: _norm64(ts) for q, ts in out.items()}
        norms["update_to_weights"] = norms["update"] / norms["weights"]
        return norms

    b, a = quantities(before), quantities(after)
    for q in ("exp_avg", "grad_rms", "update", "weights", "update_to_weights"):
        c = changes[q]
        assert c["before"] == pytest.approx(b[q], rel=1e-6), q
        assert c["after"] == pytest.approx(a[q], rel=1e-6), q
        assert c["ratio"] == pytest.approx(a[q] / b[q], rel=1e-6), q
    # The spike reached Adam (no clipping in this loop): exp_avg moved far more than 1x.
    assert changes["exp_avg"]["ratio"] > 3


def test_outliers_are_the_dumps_elements_beyond_k_sqrt_vhat(gradclip, torch_spiked):
    run = torch_spiked
    for k in ("6", "2.5"):
        _, doc = autopsy_json(gradclip, run.folder, "--outlier-k", k)
        dump = torch.load(run.folder / A.DUMPS / f"step-{SPIKE}.pt", weights_only=True)
        assert dump["step"] == SPIKE
        ckpt = _checkpoint(run, SPIKE)  # the state before step 40's gradient
        state = _named_state(ckpt)
        beta2 = ckpt["optimizer"]["param_groups"][0]["betas"][1]
        for layer, g in by_name(doc).items():
            count = elements = 0
            for n in _group(dump["grads"], layer):
                s = state[n]
                v_hat = s["exp_avg_sq"].double() / (1 - beta2 ** float(s["step"]))
                count += int((dump["grads"][n].double().abs() > float(k) * v_hat.sqrt()).sum())
                elements += dump["grads"][n].numel()
            assert g["outlier_counts"]["count"] == count and g["outlier_counts"]["elements"] \
                == elements
            assert g["outliers"] == pytest.approx(count / elements, rel=1e-12)
            assert g["outlier_counts"]["grads_source"].endswith(f"step-{SPIKE}.pt")
            assert g["outlier_counts"]["moment_source"].endswith(f"step-{SPIKE}.pt")
        injected = by_name(doc)[run.layer]["outliers"]
        assert injected > max(g["outliers"] for g in doc["groups"] if g["name"] != run.layer)


def test_without_a_dump_the_gradient_comes_from_two_consecutive_adam_states(
        gradclip, torch_spiked, tmp_path):
    """The loop saves the states after steps 39 and 40's gradients: they determine step 40's
    gradient (inspect --previous's reconstruction), so the outliers need no dump, and match
    the dump's counts (the reconstruction is float32 state: an element within its rounding
    of the threshold may fall either side)."""
    run = torch_spiked
    _, with_dump = autopsy_json(gradclip, run.folder)
    folder = tmp_path / "run"
    shutil.copytree(run.folder, folder, ignore=shutil.ignore_patterns(A.DUMPS))
    r, doc = autopsy_json(gradclip, folder)
    assert r.code == 1, r.err
    assert doc["groups"][0]["name"] == run.layer
    for layer, g in by_name(doc).items():
        counts, reference = g["outlier_counts"], by_name(with_dump)[layer]["outlier_counts"]
        assert counts["elements"] == reference["elements"]
        assert abs(counts["count"] - reference["count"]) <= 1, layer
        assert counts["grads_source"].startswith("the gradients reconstructed from ")
        assert counts["grads_source"].endswith("(their Adam states, steps apart by one)")
    # Without the state of the step before, nothing determines it: said, not guessed.
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    for f in (bare / "checkpoints").glob("step-40.pt"):
        f.unlink()
    _, doc = autopsy_json(gradclip, bare)
    assert all(g["outliers"] is None for g in doc["groups"])
    assert any(n.startswith("outliers: no gradient of step 40") for n in doc["notes"])


def test_inputs_list_every_file_with_its_placed_step(gradclip, torch_spiked):
    _, doc = autopsy_json(gradclip, torch_spiked.folder)
    inputs = {(i["source"].rsplit("/", 1)[-1], i["what"]): i["steps"] for i in doc["inputs"]}
    assert inputs[(A.LOG, "grads")] == list(range(A.STEPS))
    assert inputs[(f"step-{SPIKE}.pt", "grads")] == [SPIKE]  # the dump: the log's numbers
    assert inputs[(f"step-{SPIKE + 1}.pt", "exp_avg")] == [SPIKE]
    assert inputs[("step-5.pt", "update_to_weights")] == [4]
    assert any("counts from 0" in note for note in doc["notes"])


def test_exclude_leaves_an_input_out_and_says_so(gradclip, torch_spiked):
    """As trend does: the input is gone from ``inputs`` and a note names it and the glob."""
    _, doc = autopsy_json(gradclip, torch_spiked.folder, "--exclude", "step-5.pt")
    sources = [i["source"].rsplit("/", 1)[-1] for i in doc["inputs"]]
    assert "step-5.pt" not in sources and f"step-{SPIKE}.pt" in sources
    assert any(note.startswith("left out: ") and note.endswith("/step-5.pt (--exclude step-5.pt)")
               for note in doc["notes"])
    assert doc["step"] == SPIKE


def test_without_the_log_the_checkpoints_are_judged_not_the_dumps(gradclip, torch_spiked,
                                                                  tmp_path):
    """The monitor dumps at its spikes alone: beside the run's checkpoints (no log given)
    they are not the finest series, and the checkpoints' spike is explained."""
    folder = tmp_path / "run"
    for sub in ("checkpoints", A.DUMPS):
        shutil.copytree(torch_spiked.folder / sub, folder / sub)
    r, doc = autopsy_json(gradclip, folder)
    assert r.code == 1, r.err
    assert doc["status"] == "explained" and "(14 checkpoints)" in doc["finest"]
    # trend's own judgement of the same checkpoints (the quantity auto picks: exp_avg).
    t = gradclip("trend", folder / "checkpoints", "--fail-on", "any", "--format", "json").json()
    assert t["what"] == "exp_avg"
    flagged = [p for p in t["points"] if p["spike"]]
    newest = int(flagged[-1]["source"].rsplit("step-", 1)[1].removesuffix(".pt"))
    assert doc["step"] == newest  # no log: checkpoints at their own numbers
    assert doc["groups"][0]["name"] == torch_spiked.layer


def test_the_trainer_checkpoints_are_placed_at_their_own_numbers(gradclip, trainer_spiked):
    _, doc = autopsy_json(gradclip, trainer_spiked.folder)
    layer = by_name(doc)[trainer_spiked.layer]
    assert layer["changes"]["exp_avg"]["after_source"].endswith(f"checkpoint-{SPIKE}")
    assert layer["changes"]["exp_avg"]["before_source"].endswith(f"checkpoint-{SPIKE - 1}")
    assert layer["outlier_counts"]["moment_source"].endswith(f"checkpoint-{SPIKE - 1}")
    assert any("counts from 1" in note for note in doc["notes"])


# -- formats -----------------------------------------------------------------------------


def test_table_ranks_the_groups_and_ends_with_the_verdict(gradclip, torch_spiked):
    r = gradclip("autopsy", torch_spiked.folder)
    assert r.code == 1 and r.err == ""
    lines = logical_lines(r.out)
    rows = [line for line in lines if line.startswith("│")]
    assert rows[0].split("│")[2].strip() == torch_spiked.layer
    assert f"began in {torch_spiked.layer} at step {SPIKE}" in " ".join(r.out.split())
    q = gradclip("autopsy", torch_spiked.folder, "-q")
    assert q.code == 1 and " ".join(q.out.split()).startswith(f"step {SPIKE}: spike; began in")


def test_markdown_github_junit_and_output_file(gradclip, torch_spiked, tmp_path):
    md = gradclip("autopsy", torch_spiked.folder, "--format", "markdown")
    assert md.code == 1
    # ":" is escaped (a bare autolink could start at it), the rest reads as written.
    assert md.out.startswith("### gradclip autopsy\n\n**❌ step 40\\: spike; began in ")
    assert f"| 1 | {torch_spiked.layer} | 40 grads | 0 |" in md.out
    gh = gradclip("autopsy", torch_spiked.folder, "--format", "github")
    errors = [line for line in gh.out.splitlines() if line.startswith("::error")]
    assert len(errors) == 1 and "began in fc1" in errors[0]
    junit = gradclip("autopsy", torch_spiked.folder, "--format", "junit")
    root = ET.fromstring(junit.out.split("\n", 1)[1])
    failed = [c.get("name") for c in root.iter("testcase") if c.find("failure") is not None]
    assert failed == [torch_spiked.layer]
    out = tmp_path / "autopsy.json"
    r = gradclip("autopsy", torch_spiked.folder, "--format", "json", "--output-file", out)
    assert r.code == 1 and r.out == ""
    validate(json.loads(out.read_text()), "autopsy-1")


def test_a_non_finite_step_is_not_called_a_spike_in_github_and_junit(gradclip, tmp_path):
    """A NaN gradient at the newest of 8 saved steps: the verdict says non-finite, but
    github's ``::error`` title and junit's ``<failure>`` message said "spike at step 8"."""
    g = torch.Generator().manual_seed(3)
    for step in range(1, 9):
        grads = {"a.w": torch.randn(6, generator=g), "b.w": torch.randn(4, generator=g)}
        if step == 8:
            grads["a.w"][2] = math.nan
        torch.save({"step": step, "grads": grads}, tmp_path / f"g{step}.pt")
    doc = gradclip("autopsy", tmp_path, "--format", "json").json()
    assert doc["step"] == 8 and doc["status"] == "explained"
    gh = gradclip("autopsy", tmp_path, "--format", "github")
    (error,) = [line for line in gh.out.splitlines() if line.startswith("::error")]
    assert "non-finite at step 8" in error and "spike" not in error, error
    junit = gradclip("autopsy", tmp_path, "--format", "junit")
    root = ET.fromstring(junit.out.split("\n", 1)[1])
    (failure,) = root.iter("failure")
    assert failure.get("message") == "non-finite at step 8", failure.get("message")


def test_plot_draws_a_png(gradclip, torch_spiked, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "autopsy.png"
    r = gradclip("autopsy", torch_spiked.folder, "--plot", plot, "-q")
    assert r.code == 1, r.err
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bad input: one line naming the file, exit 2 or 3, never a ranking --------------------


def one_line(r) -> str:
    assert r.out == "" and len(r.err.splitlines()) == 1 and "Traceback" not in r.err, r.err
    return r.err


def test_a_step_outside_the_inputs(gradclip, torch_spiked):
    r = gradclip("autopsy", torch_spiked.folder, "--step", "500")
    assert r.code == 2
    line = one_line(r)
    assert "--step 500: outside the inputs" in line and A.LOG in line
    j = gradclip("autopsy", torch_spiked.folder, "--step", "500", "--format", "json")
    doc = json.loads(j.out)
    validate(doc, "error-1")
    assert doc["exit_code"] == 2 and "outside the inputs" in doc["error"]


def test_logs_of_two_runs(gradclip, torch_spiked, torch_clean):
    r = gradclip("autopsy", torch_spiked.folder / A.LOG, torch_clean.folder / A.LOG)
    assert r.code == 2
    line = one_line(r)
    assert str(torch_spiked.folder / A.LOG) in line and str(torch_clean.folder / A.LOG) in line


def test_a_log_grouped_otherwise_says_so_and_the_way_out_works(gradclip, tmp_path):
    """One run's log written with GradMonitor(group_by="tensor") beside its checkpoints
    (grouped by layer): no group in common is refused, but not as two runs' inputs, and
    what the message suggests works."""
    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(4, 8), "fc2": torch.nn.Linear(8, 1)})
    optimizer = torch.optim.Adam(model.parameters())
    (tmp_path / "checkpoints").mkdir()
    with GradMonitor(model, tmp_path / A.LOG, None, group_by="tensor") as monitor:
        for step in range(12):
            model["fc2"](model["fc1"](torch.randn(8, 4)).tanh()).pow(2).mean().backward()
            monitor.step(step)
            optimizer.step()
            optimizer.zero_grad()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1}, tmp_path / "checkpoints" / f"step-{step + 1}.pt")
    r = gradclip("autopsy", tmp_path)
    assert r.code == 2
    line = one_line(r)
    assert "grouped otherwise than by layer" in line and "--exclude" in line
    assert "fc1.weight" in line  # the log's groups, named
    for args in ([tmp_path / A.LOG], [tmp_path, "--exclude", A.LOG]):
        r = gradclip("autopsy", *args)
        assert r.code in (0, 1), r.err


def test_a_dump_of_another_run(gradclip, torch_spiked, torch_clean, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(torch_clean.folder, folder)
    (folder / A.DUMPS).mkdir(exist_ok=True)
    shutil.copy(torch_spiked.folder / A.DUMPS / f"step-{SPIKE}.pt", folder / A.DUMPS)
    r = gradclip("autopsy", folder)
    assert r.code == 2
    assert f"step-{SPIKE}.pt" in one_line(r) and "not one run's" in r.err


def test_a_checkpoint_whose_parameters_differ(gradclip, torch_spiked, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(torch_spiked.folder, folder)
    bad = folder / "checkpoints" / "step-45.pt"
    other = torch.nn.ModuleDict({"fc1": torch.nn.Linear(16, 8), "fc2": torch.nn.Linear(8, 64),
                                 "fc3": torch.nn.Linear(64, 1)})
    opt = torch.optim.Adam(other.parameters())
    other["fc3"](other["fc2"](other["fc1"](torch.randn(2, 16)))).sum().backward()
    opt.step()
    torch.save({"model": other.state_dict(), "optimizer": opt.state_dict(), "step": 45}, bad)
    r = gradclip("autopsy", folder)
    assert r.code == 3
    line = one_line(r)
    assert "step-45.pt: parameter fc1.bias has shape [8], but [64] in" in line
    assert line.rstrip().endswith("step-10.pt: not one run's checkpoints")


@pytest.mark.parametrize("args, word", [(["--window", "0"], "--window"),
                                        (["--outlier-k", "-1"], "--outlier-k"),
                                        (["--step", "-3"], "--step")])
def test_bad_values_are_usage_errors(gradclip, torch_spiked, args, word):
    r = gradclip("autopsy", torch_spiked.folder, *args)
    assert r.code == 2 and word in one_line(r)


def test_an_unreadable_input_is_exit_3(gradclip, tmp_path):
    broken = tmp_path / "step-3.pt"
    broken.write_bytes(b"PK\x03\x04 not a zip")
    r = gradclip("autopsy", broken)
    assert r.code == 3 and str(broken) in one_line(r)


def test_names_from_the_files_are_data_in_every_format(gradclip, tmp_path):
    """Module names reach the log as the monitor writes them: each format escapes them."""
    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    hostile, escape = "a|b*`c`", "esc\x1b[31m"
    model = torch.nn.ModuleDict({hostile: torch.nn.Linear(4, 4), escape: torch.nn.Linear(4, 1)})
    with GradMonitor(model, tmp_path / A.LOG, None) as monitor:
        for step in range(30):
            model[escape](model[hostile](torch.randn(8, 4))).pow(2).mean().backward()
            if step == 25:
                for p in model[hostile].parameters():
                    p.grad.mul_(50)
            monitor.step(step)
            model.zero_grad()
    md = gradclip("autopsy", tmp_path / A.LOG, "--format", "markdown")
    assert md.code == 1
    assert "| 1 | a\\|b\\*\\`c\\` |" in md.out and "\x1b" not in md.out
    table = gradclip("autopsy", tmp_path / A.LOG)
    assert table.code == 1 and "\x1b" not in table.out and "began in a|b*`c`" in table.out
    _, doc = autopsy_json(gradclip, tmp_path / A.LOG)
    assert doc["groups"][0]["name"] == hostile


def test_a_log_too_short_to_judge_is_insufficient_exit_0(gradclip, tmp_path):
    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with GradMonitor(model, tmp_path / A.LOG, None) as monitor:
        for step in range(4):  # the rule judges a point after 5 earlier ones
            model(torch.randn(8, 4)).pow(2).mean().backward()
            monitor.step(step)
            model.zero_grad()
    r, doc = autopsy_json(gradclip, tmp_path / A.LOG)
    assert r.code == 0 and doc["status"] == "insufficient" and doc["groups"] == []
    assert "too few points to judge (4" in doc["verdict"]
    gh = gradclip("autopsy", tmp_path / A.LOG, "--format", "github")
    assert gh.code == 0 and gh.out.startswith("::notice") and "::error" not in gh.out


@pytest.fixture(scope="session")
def hf_run_folder(tmp_path_factory):
    """tests/trainer_runs.py's run folder: checkpoint-5/ .. checkpoint-20/, the Trainer's
    trainer_state.json, a GradMonitor log; transformer.h.1 x1000 at step 12."""
    pytest.importorskip("transformers")
    from tests.trainer_runs import train_run_folder

    return train_run_folder(tmp_path_factory.mktemp("autopsy_hf") / "output")


def test_a_trainer_folder_at_every_grain(gradclip, hf_run_folder, tmp_path):
    run = hf_run_folder
    r, doc = autopsy_json(gradclip, run.output_dir)
    assert r.code == 1 and doc["step"] == run.spike_step
    first = doc["groups"][0]
    assert first["name"] == run.spike_layer and first["onset"] == run.spike_step
    # Checkpoints every 5 steps: the nearest ones either side of step 12.
    moments = first["changes"]["exp_avg"]
    assert moments["before_source"].endswith("checkpoint-10")
    assert moments["after_source"].endswith("checkpoint-15")
    assert first["outliers"] is None
    assert any(n.startswith("outliers: no gradient of step 12") for n in doc["notes"])
    # Without the monitor log, the Trainer's total is the finest series: the step is
    # still found, but no layer can be named, and the verdict says what would.
    folder = tmp_path / "output"
    shutil.copytree(run.output_dir, folder)
    (folder / "grads.jsonl").unlink()
    r, doc = autopsy_json(gradclip, folder)
    assert r.code == 1 and doc["status"] == "explained" and doc["step"] == run.spike_step
    assert doc["finest"].endswith("trainer_state.json")
    assert all(g["onset"] is None for g in doc["groups"])
    assert "holds the total only" in doc["verdict"]


def test_a_checkpoint_at_its_schedules_end_states_no_update_change(gradclip, hf_run_folder):
    # The Trainer's linear schedule ends at lr 0: checkpoint-20 stores it, though its last
    # step used lr > 0, so its update (and update_to_weights) is not determined. Across
    # step 20 no change of either is stated (checkpoint-15 before, nothing after), never
    # "update 0x", and a note names the checkpoint, the group and why.
    run = hf_run_folder
    last = run.output_dir / f"checkpoint-{run.steps}"
    r, doc = autopsy_json(gradclip, run.output_dir, "--step", run.steps)
    assert r.code == 0 and doc["step"] == run.steps, r.err
    assert doc["groups"]
    for group in doc["groups"]:
        for what in ("update", "update_to_weights"):
            change = group["changes"][what]
            assert change["before_source"].endswith("checkpoint-15")
            assert change["after"] is None and change["ratio"] is None, (group["name"], what)
        assert group["changes"]["exp_avg"]["after_source"] == str(last)  # measured there
    [note] = [n for n in doc["notes"] if "not measured" in n]
    assert note.startswith(f"{last}: update and update_to_weights not measured: AdamW update: "
                           "param group ")
    assert "stores lr 0 (a schedule's end or start)" in note
    table = gradclip("autopsy", run.output_dir, "--step", run.steps)
    assert table.code == 0 and " 0x " not in table.out
    assert any(line.startswith(f"{last}: update and update_to_weights not measured: ")
               for line in logical_lines(table.out))
    # Across a step whose changes read no checkpoint at lr 0, nothing is said of it.
    earlier = gradclip("autopsy", run.output_dir, "--step", run.steps // 2, "--format", "json")
    assert earlier.code in (0, 1), earlier.err
    assert not [n for n in earlier.json()["notes"] if "not measured" in n]


@pytest.fixture(scope="session")
def tensorboard_run(tmp_path_factory):
    """The README's plain loop (step 50 a bad batch that blows up fc2), its GradMonitor
    writing the log, the dumps and TensorBoard event files (``tensorboard=``)."""
    pytest.importorskip("tensorboard")
    from gradclip_cli import GradMonitor

    folder = tmp_path_factory.mktemp("autopsy_tb")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(32, 64), "fc2": torch.nn.Linear(64, 1)})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(4096, 32), torch.randn(4096, 1)
    monitor = GradMonitor(model, log=folder / "grads.jsonl", dump_dir=folder / "spikes",
                          tensorboard=folder / "runs")
    for step in range(60):
        batch = torch.randint(0, 4096, (256,))
        loss = torch.nn.functional.mse_loss(model.fc2(model.fc1(x[batch]).tanh()), y[batch])
        if step == 50:
            loss = loss + 1e3 * model.fc2.weight.square().sum()
        loss.backward()
        monitor.clip_grad_norm_(max_norm=1.0, step=step)
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return folder


def test_a_folder_of_tensorboard_files_is_read_as_trend_reads_it(gradclip, tensorboard_run):
    # trend reads a folder of event files as one run; so does the autopsy, which explains
    # the spike of step 50 in fc2 from the monitor's TensorBoard scalars alone.
    r, doc = autopsy_json(gradclip, tensorboard_run / "runs")
    assert r.code == 1 and doc["step"] == 50, r.err
    assert doc["groups"][0]["name"] == "fc2" and doc["groups"][0]["onset"] == 50


def test_the_monitors_tensorboard_scalars_sit_at_its_logs_steps(gradclip, tensorboard_run):
    # The monitor writes its log (counting from 0), the dump of step 50 and its TensorBoard
    # scalars, all numbered as the loop called it: read together they are one run, each
    # series at the log's steps (a checkpoint alone counts optimizer steps taken).
    logged = [json.loads(line)["step"] for line in
              (tensorboard_run / "grads.jsonl").read_text().splitlines()]
    r, doc = autopsy_json(gradclip, tensorboard_run)
    assert r.code == 1 and doc["step"] == 50, r.err
    assert doc["groups"][0]["name"] == "fc2" and doc["groups"][0]["onset"] == 50
    series = [i["steps"] for i in doc["inputs"] if not i["source"].endswith(".pt")]
    assert series == [logged, logged]


def test_a_lightning_run_logging_to_tensorboard_and_csv_is_one_run(gradclip, tmp_path):
    # Lightning's loggers side by side (TensorBoard and CSV, a common pair), each given
    # gradclip's tags by the callback: the same values, TensorBoard's rounded to float32.
    # One run: the autopsy explains the spike (fc's gradients x100 at step 30).
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from gradclip_cli.integrations.lightning import GradMonitorCallback

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.fc(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    class Inject(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 30:
                pl_module.fc.weight.grad.mul_(100)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2560, 8), torch.randn(2560, 1))
    trainer = pl.Trainer(
        max_steps=40, log_every_n_steps=1, accelerator="cpu", devices=1,
        logger=[TensorBoardLogger(tmp_path / "tb"), CSVLogger(tmp_path / "csv")],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Inject(), GradMonitorCallback(tmp_path / "grads.jsonl", tmp_path / "dumps")],
    )  # fmt: skip
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=64))
    r, doc = autopsy_json(gradclip, tmp_path)
    assert r.code == 1 and doc["step"] == 30, r.err
    assert doc["groups"][0]["name"] == "fc" and doc["groups"][0]["onset"] == 30
    trackers = [i for i in doc["inputs"]
                if i["source"].endswith("metrics.csv") or "tfevents" in i["source"]]
    assert len(trackers) == 2 and all(i["steps"] == list(range(40)) for i in trackers)


def _lightning_exp_avg_norms(ckpts, optimizer_steps: int) -> dict[str, float]:
    """Adam's bias-corrected exp_avg per layer of ``step=N.ckpt`` (float64)."""
    ckpt = torch.load(ckpts / f"step={optimizer_steps}.ckpt", weights_only=False)
    names = list(ckpt["state_dict"])
    opt = ckpt["optimizer_states"][0]
    beta1 = opt["param_groups"][0]["betas"][0]
    m = {names[i]: s["exp_avg"].double() / (1 - beta1 ** float(s["step"]))
         for i, s in opt["state"].items()}
    return {layer: _norm64([m[n] for n in _group(names, layer)]) for layer in ("l1", "l2")}


def _assert_exp_avg_read_across(doc, ckpts, spike: int) -> None:
    """Each group's exp_avg change is read from ``step=<spike>.ckpt`` to
    ``step=<spike + 1>.ckpt``, the first to hold the spike's gradient, as the files hold it."""
    before = _lightning_exp_avg_norms(ckpts, spike)
    after = _lightning_exp_avg_norms(ckpts, spike + 1)
    for layer, group in by_name(doc).items():
        change = group["changes"]["exp_avg"]
        assert change["after_source"].endswith(f"step={spike + 1}.ckpt"), change
        assert change["before"] == pytest.approx(before[layer], rel=1e-6)
        assert change["after"] == pytest.approx(after[layer], rel=1e-6)


@pytest.mark.parametrize("every", [1, 5])
def test_a_lightning_loggers_steps_from_0_place_its_checkpoints_at_the_step_they_took_in(
        gradclip, tmp_path, every):
    """Lightning's loggers (CSVLogger here) number a step's gradient norm from 0
    (``trainer.global_step`` before its update), while ``step=N.ckpt`` holds the state after
    N updates: as with a monitor log counting from 0, the checkpoint of N is placed at
    N-1, so the spike's change is read from ``step=10.ckpt`` to ``step=11.ckpt`` (the
    first to hold its gradient), with the file's numbers, never from the two before it."""
    from tests import tracker_runs as tr

    tr.needs("lightning")
    # Every 5th step, as Lightning's log_every_n_steps (default 50) picks them: 4, 9, ...
    # numbered from 0 though the first is 4; the spike at 44, the 9th logged step.
    spike = tr.LIGHTNING_CHECKPOINTED_SPIKE_STEP if every == 1 else 44
    ckpts = tr.train_lightning_checkpointed(tmp_path, steps=spike + 4 * every,
                                            spike_step=spike, log_every_n_steps=every)
    log = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    result, doc = autopsy_json(gradclip, log, ckpts)
    assert result.code == 1, result.err
    assert doc["step"] == spike and doc["status"] == "explained"

    _assert_exp_avg_read_across(doc, ckpts, spike)
    # The spike reached Adam (no clipping): exp_avg moved far more than 1x.
    assert all(g["changes"]["exp_avg"]["ratio"] > 3 for g in doc["groups"])


def test_a_resumed_lightning_runs_log_places_its_checkpoints_as_lightning_counts(
        gradclip, tmp_path):
    """A Lightning run resumed from ``step=5.ckpt`` logs (``version_1/metrics.csv``, every
    step) from step 5 on: its first step says nothing of how it counts, and the
    checkpoints were placed at their own numbers, so the spike at step 12 was read from
    ``step=11.ckpt`` to ``step=12.ckpt``, before its gradient reached Adam (exp_avg
    1.2x, exit 1). The checkpoints are Lightning's, whose loggers count from 0: each is
    placed at N-1, and the change is read from ``step=12.ckpt`` to ``step=13.ckpt``."""
    from tests import tracker_runs as tr

    tr.needs("lightning")
    spike = 12
    ckpts = tr.train_lightning_checkpointed(tmp_path, steps=spike + 4, spike_step=spike,
                                            resumed_at=5)
    log = tmp_path / "lightning_logs" / "version_1" / "metrics.csv"
    result, doc = autopsy_json(gradclip, log, ckpts)
    assert result.code == 1, result.err
    assert doc["step"] == spike and doc["status"] == "explained"
    assert doc["inputs"][0]["steps"] == list(range(5, spike + 4))  # as Lightning logged them
    assert any(f"{log} starts at step 5" in n and "Lightning's" in n
               and "placed at step N-1" in n for n in doc["notes"]), doc["notes"]

    _assert_exp_avg_read_across(doc, ckpts, spike)
    assert all(g["changes"]["exp_avg"]["ratio"] > 3 for g in doc["groups"])


def test_a_log_in_two_norm_types_is_refused_not_explained_as_a_spike(gradclip, tmp_path):
    """A monitor recreated with norm_type=1 appending to a log of p=2: the step where
    p changed was explained as a spike (exit 1), a jump made by the change of norm. It
    is exit 3 naming the file and the steps of each p."""
    from gradclip_cli import GradMonitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    log = tmp_path / "grads.jsonl"
    for p, steps in ((2.0, range(0, 10)), (1.0, range(10, 14))):
        with GradMonitor(model, log=log, dump_dir=None, norm_type=p) as monitor:
            for step in steps:
                model.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                monitor.step(step)
    r = gradclip("autopsy", log)
    assert r.code == 3, (r.out, r.err)
    line = r.err_lines[-1]
    assert line.startswith(f"gradclip: {log}: "), line
    assert "p=2 at steps 0-9" in line and "p=1 at steps 10-13" in line, line


def test_a_resumed_trainer_runs_log_places_its_checkpoints_as_the_trainer_counts(
        gradclip, tmp_path):
    """The Trainer resumed from ``checkpoint-4`` (``resume_from_checkpoint``) writes a
    TensorBoard file of its own from step 5 on: a first step that says nothing of how it
    counts. The checkpoints are the Trainer's, whose loggers count from 1: ``checkpoint-N``
    stays at N, the spike logged at step 10 is read from ``checkpoint-9`` to
    ``checkpoint-10``, and the note says why."""
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    from tests.trainer_runs import train_resumed_with_spike

    run = train_resumed_with_spike(tmp_path / "out", resumed_at=4)
    # The resumed Trainer's event file: the newer of the two runs/ wrote.
    event_file = max(run.output_dir.glob("runs/*/events.out.tfevents.*"),
                     key=lambda f: f.stat().st_mtime_ns)
    checkpoints = sorted(run.output_dir.glob("checkpoint-*"))
    result, doc = autopsy_json(gradclip, event_file, *checkpoints)
    assert result.code == 1, result.err
    assert doc["step"] == run.spike_step and doc["status"] == "explained"
    logged = next(i for i in doc["inputs"] if i["source"] == str(event_file))
    assert logged["steps"] == list(range(5, run.steps + 1))  # as the Trainer logged them
    assert any(f"{event_file} starts at step 5" in n and "the Trainer's" in n
               and "placed at step N" in n for n in doc["notes"]), doc["notes"]
    for group in doc["groups"]:
        change = group["changes"]["exp_avg"]
        assert change["before_source"].endswith(f"checkpoint-{run.spike_step - 1}"), change
        assert change["after_source"].endswith(f"checkpoint-{run.spike_step}"), change
        assert change["ratio"] > 3  # no clipping: the spike reached Adam
