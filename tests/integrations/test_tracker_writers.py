"""gradclip's norms where the user looks: the framework's loggers and TensorBoard files.

Real runs, read back with the readers of the files' own libraries:
TensorBoard event files with tensorboard's ``EventAccumulator`` (every
point), Lightning's ``metrics.csv`` with ``csv``, ``trainer_state.json`` with
``json``. Each value read back must be the monitor log's number for that
step, exactly where the file keeps float64 (CSV, JSON) and rounded to float32
where it keeps float32 (TensorBoard's ``simple_value``); the log's own
numbers are checked against float64 references in test_monitor.py and
test_lightning.py.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradclip_cli import GradMonitor
from tests.json_schemas import assert_valid

from .support import read_log

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

TAGS = ("gradclip/total_norm", "gradclip/spike", "gradclip/clip_coef")


def float32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar point of every event file under ``folder``: tag -> step -> value."""
    [events] = {p.parent for p in folder.rglob("events.out.tfevents.*")}
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0})  # 0: keep every point
    reader.Reload()
    return {tag: {e.step: e.value for e in reader.Scalars(tag)}
            for tag in reader.Tags()["scalars"]}


def expected(record: dict, prefix: str = "") -> dict[str, float]:
    """The scalars a record's step must show, tag -> float64 value, from the log's line."""
    out = {prefix + "gradclip/total_norm": float(record["total_norm"])}
    out.update({prefix + f"gradclip/norm/{g}": float(v) for g, v in record["groups"].items()})
    out[prefix + "gradclip/spike"] = 1.0 if record["spike"] else 0.0
    # 1.0 where the log says null: nothing was scaled.
    coef = record["clip_coef"]
    out[prefix + "gradclip/clip_coef"] = 1.0 if coef is None else float(coef)
    return out


def assert_tensorboard_holds(points: dict[str, dict[int, float]], records: list[dict],
                             prefix: str = "") -> None:
    """Each record's scalars at its step, as float32; nothing at any other step."""
    steps = [r["step"] for r in records]
    want: dict[str, dict[int, float]] = {}
    for record in records:
        for tag, value in expected(record, prefix).items():
            want.setdefault(tag, {})[record["step"]] = value
    for tag, by_step in want.items():
        assert set(points[tag]) == set(by_step), tag
        for step, value in by_step.items():
            assert same(points[tag][step], float32(value)), (tag, step)
    gradclip = {t for t in points if t.startswith(prefix + "gradclip/")}
    assert gradclip == set(want)
    assert set(points[prefix + "gradclip/total_norm"]) == set(steps)


# -- GradMonitor(tensorboard=...) in a plain loop ------------------------------------------

LOOP_STEPS, LOOP_SPIKE, LOOP_NAN = 40, 30, 36


@pytest.fixture(scope="module")
def plain_loop(tmp_path_factory):
    """40 steps of a two-layer model, net.2's gradients x1000 at step 30 (clipped by
    clip_spikes), a NaN at step 36; the monitor log and TensorBoard scalars side by side."""
    folder = tmp_path_factory.mktemp("loop")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = GradMonitor(model, folder / "grads.jsonl", None, clip_spikes=True,
                          tensorboard=folder / "tb")
    for step in range(LOOP_STEPS):
        x = torch.randn(32, 6)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
        if step == LOOP_SPIKE:
            model[2].weight.grad *= 1000
        if step == LOOP_NAN:
            model[0].bias.grad[0] = math.nan
        monitor.step(step)
        if step != LOOP_NAN:
            optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return folder


def test_the_loops_scalars_are_the_logs_numbers_in_float32(plain_loop):
    records = read_log(plain_loop / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(LOOP_STEPS))
    points = scalars(plain_loop / "tb")
    assert_tensorboard_holds(points, records)
    assert points["gradclip/spike"][LOOP_SPIKE] == 1.0
    # The spike was clipped: its coefficient is the one below 1.
    coefs = points["gradclip/clip_coef"]
    assert [s for s, c in coefs.items() if c != 1.0] == [LOOP_SPIKE]
    assert 0 < coefs[LOOP_SPIKE] < 1e-2
    assert math.isnan(points["gradclip/total_norm"][LOOP_NAN])
    assert math.isnan(points["gradclip/norm/0"][LOOP_NAN])
    assert not math.isnan(points["gradclip/norm/2"][LOOP_NAN])


def test_trend_reads_a_1_norm_monitors_tensorboard_back_as_1_norms(gradclip, tmp_path):
    """A monitor of another p writes gradclip/norm_type beside its norms; trend of its
    TensorBoard files reports that p, as trend of its log does, never the 2-norm."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None, norm_type=1.0,
                          tensorboard=tmp_path / "tb")
    for step in range(8):
        x = torch.randn(32, 6)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        monitor.step(step)
        model.zero_grad()
    monitor.close()
    records = read_log(tmp_path / "grads.jsonl")
    r = gradclip("trend", tmp_path / "tb", "--format", "json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["norm_type"] == 1.0
    assert [p["total_norm"] for p in doc["points"]] == [float32(x["total_norm"])
                                                        for x in records]
    wrong = gradclip("trend", tmp_path / "tb", "--norm-type", "2")
    assert wrong.code == 2 and "p=1" in wrong.err


def test_without_tensorboard_the_monitor_is_refused_naming_the_extra(tmp_path):
    folder = str(tmp_path / "tb")
    code = ("import sys; sys.modules['tensorboard'] = None\n"
            "import torch\nfrom gradclip_cli import GradMonitor\n"
            "try:\n"
            f"    GradMonitor(torch.nn.Linear(2, 2), None, None, tensorboard={folder!r})\n"
            "except ImportError as e:\n    print(e)\nelse:\n    print('made')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "pip install 'gradclip[tensorboard]'" in run.stdout
    assert not (tmp_path / "tb").exists()


def test_a_tensorboard_path_that_is_a_file_is_refused_at_once(tmp_path):
    (tmp_path / "tb").write_text("")
    with pytest.raises(ValueError, match=r"tensorboard='.*tb' is not a folder"):
        GradMonitor(torch.nn.Linear(2, 2), None, None, tensorboard=tmp_path / "tb")


def test_nothing_is_written_before_the_first_logged_step(tmp_path):
    monitor = GradMonitor(torch.nn.Linear(2, 2), None, None, tensorboard=tmp_path / "tb")
    monitor.close()
    assert not (tmp_path / "tb").exists()


# -- Lightning: its TensorBoard and CSV loggers ---------------------------------------------

pl = pytest.importorskip("lightning.pytorch")

PL_STEPS, PL_SPIKE = 40, 30


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == PL_SPIKE:
            loss = loss + 1e4 * self.net[2].weight.square().sum()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def lightning_fit(folder: Path, steps: int, every: int = 1, loggers: bool = True,
                  module: type = Regressor, **callback_options) -> None:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from gradclip_cli.integrations.lightning import GradMonitorCallback

    torch.manual_seed(0)
    x = torch.randn(256, 6)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, gradient_clip_val=1.0,
        callbacks=[GradMonitorCallback(folder / "grads.jsonl", None, **callback_options)],
        logger=[TensorBoardLogger(folder, name="tb"), CSVLogger(folder, name="csv")]
        if loggers else False, log_every_n_steps=every, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=folder,
    )  # fmt: skip
    trainer.fit(module(), loader)


@pytest.fixture(scope="module")
def lightning_loggers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lightning_loggers")
    lightning_fit(folder, PL_STEPS, clip_spikes=True)
    return folder


def csv_rows(folder: Path) -> list[dict[str, str]]:
    [path] = folder.rglob("metrics.csv")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_lightnings_tensorboard_logger_holds_the_logs_numbers_in_float32(lightning_loggers):
    records = read_log(lightning_loggers / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(PL_STEPS))
    points = scalars(lightning_loggers / "tb")
    assert_tensorboard_holds(points, records)  # at the log's steps: trainer.global_step
    assert points["gradclip/spike"][PL_SPIKE] == 1.0
    coefs = points["gradclip/clip_coef"]
    assert [s for s, c in coefs.items() if c != 1.0] == [PL_SPIKE]
    assert {"gradclip/norm/net.0", "gradclip/norm/net.2"} <= set(points)


def test_lightnings_csv_logger_holds_the_logs_numbers_exactly(lightning_loggers):
    records = read_log(lightning_loggers / "grads.jsonl")
    rows = csv_rows(lightning_loggers / "csv")
    assert [int(r["step"]) for r in rows] == [r["step"] for r in records]
    for row, record in zip(rows, records):
        want = expected(record)
        got = {t: float(v) for t, v in row.items() if t.startswith("gradclip/")}
        assert got == want, record["step"]  # float64 kept


def test_on_lightnings_logging_steps_only_with_their_own_values(tmp_path):
    # log_every_n_steps=4: Lightning sends steps 3, 7, 11 (and no stale value between).
    lightning_fit(tmp_path, 12, every=4)
    records = read_log(tmp_path / "grads.jsonl")
    assert len(records) == 12
    assert_tensorboard_holds(scalars(tmp_path / "tb"), [records[s] for s in (3, 7, 11)])


def test_log_metrics_false_leaves_the_loggers_alone(tmp_path):
    lightning_fit(tmp_path, 3, log_metrics=False)
    assert len(read_log(tmp_path / "grads.jsonl")) == 3
    assert not [t for t in scalars(tmp_path / "tb") if t.startswith("gradclip/")]


def test_a_trainer_without_a_logger_logs_nothing_and_says_nothing(tmp_path, recwarn):
    """Trainer(logger=False): the monitor log is written; nothing goes through self.log,
    which would warn on every key that no logger is configured."""
    lightning_fit(tmp_path, 3, loggers=False)
    assert len(read_log(tmp_path / "grads.jsonl")) == 3
    assert not [w for w in recwarn if "no logger configured" in str(w.message)]


class LoggingItsGradNorm(Regressor):
    """Logs Lightning's own ``grad_norm`` from its ``on_before_optimizer_step``, as
    Lightning's docs show it: Lightning calls the module's hook after the callbacks', so
    this total is of the gradients as gradclip's spike clip left them."""

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.log_dict(grad_norm(self, norm_type=2))


def test_a_framework_total_logged_after_the_spike_clip_is_no_disagreement(gradclip, tmp_path):
    lightning_fit(tmp_path, PL_STEPS, module=LoggingItsGradNorm, clip_spikes=True)
    records = read_log(tmp_path / "grads.jsonl")
    spike = records[PL_SPIKE]
    assert spike["clip_coef"] is not None  # the callback scaled the spike's gradients
    logged = {int(r["step"]): float(r["grad_2.0_norm_total"]) for r in csv_rows(tmp_path / "csv")}
    assert sorted(logged) == list(range(PL_STEPS))
    # Lightning's float32 total of that step is the clipped gradients' norm, not the
    # logged one: float32 sums of 2 x 16 + 16 + 1 squares are within 1e-5 of it.
    before, after = float(spike["total_norm"]), float(spike["total_norm"]) * spike["clip_coef"]
    assert logged[PL_SPIKE] == pytest.approx(after, rel=1e-5)
    assert logged[PL_SPIKE] < before / 10
    result = gradclip("trend", tmp_path, "--format", "json")
    assert result.code == 0, result.out  # the spike is not the newest point
    audits = assert_valid(result.out)["audit"]
    assert {a["framework"]["kind"] for a in audits} == {
        "Lightning CSVLogger grad_2.0_norm_total", "TensorBoard grad_2.0_norm_total"}
    for audit in audits:
        assert audit["agrees"] and audit["steps_compared"] == PL_STEPS
        assert audit["after_gradclip_clip"] == [PL_SPIKE]
    table = gradclip("trend", tmp_path)
    assert table.code == 0, table.out
    assert "disagree" not in table.out.lower()
    assert f"step {PL_SPIKE} logged after gradclip's clip" in " ".join(table.out.split())


class LoggingTheFirstLayersNorm(Regressor):
    """Logs a wrong framework total: Lightning's ``grad_norm`` of the first layer alone,
    under the total's own tag (what a norm computed over part of the model looks like)."""

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.log_dict(grad_norm(self.net[0], norm_type=2))


def test_a_resumed_fits_two_logger_versions_are_both_audited(gradclip, tmp_path):
    """A fit resumed from its checkpoint logs to a new version of each logger (version_0:
    steps 0-5, version_1: steps 6-11) and appends to the one monitor log: each version's
    framework total is held against the log, though trend judges neither version."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from gradclip_cli.integrations.lightning import GradMonitorCallback

    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    checkpoint = tmp_path / "first.ckpt"
    for steps, resume in ((6, None), (12, checkpoint)):
        torch.manual_seed(0)
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, log_every_n_steps=1,
            callbacks=[GradMonitorCallback(tmp_path / "grads.jsonl", None)],
            logger=[TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv")],
            enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(LoggingTheFirstLayersNorm(),
                    torch.utils.data.DataLoader(data, batch_size=32), ckpt_path=resume)
        if resume is None:
            trainer.save_checkpoint(checkpoint)
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(12))
    logged = {}
    for version, steps in (("version_0", range(6)), ("version_1", range(6, 12))):
        rows = csv_rows(tmp_path / "csv" / version)
        got = {int(r["step"]): float(r["grad_2.0_norm_total"]) for r in rows}
        assert sorted(got) == list(steps)
        logged.update(got)
    # The first layer's norm is well below the whole's at every step: 12 disagreements.
    for record in records:
        assert logged[record["step"]] < 0.99 * record["total_norm"]
    result = gradclip("trend", tmp_path, "--format", "json")
    doc = assert_valid(result.out)
    assert result.code == 1, result.out
    found = {}
    for audit in doc["audit"]:
        found.setdefault(audit["framework"]["kind"], set()).update(
            d["step"] for d in audit["disagreements"])
    assert found == {"Lightning CSVLogger grad_2.0_norm_total": set(range(12)),
                     "TensorBoard grad_2.0_norm_total": set(range(12))}
    # Two logs of one run disagree at the same 12 steps: the verdict counts steps, not the
    # disagreements of each log.
    table = gradclip("trend", tmp_path)
    assert table.code == 1
    said = " ".join(table.out.split())  # wherever the terminal wraps it
    assert "FAIL: the logged total norm disagrees with gradclip's at 12 step(s) " in said


# -- The Trainer: report_to=["tensorboard"] and trainer_state.json ---------------------------

transformers = pytest.importorskip("transformers")

from tests.trainer_runs import (  # noqa: E402
    CALLBACK_LOG,
    CALLBACK_LOGGING_STEPS,
    CALLBACK_SPIKE_STEP,
    CALLBACK_STEPS,
    train_with_callback,
)


@pytest.fixture(scope="session")
def callback_run(tmp_path_factory):
    """24 steps with gradclip's Trainer callback, logging every 2nd, a spike at step 20."""
    return train_with_callback(tmp_path_factory.mktemp("hf_callback") / "output")


LOGGING_STEPS = list(range(CALLBACK_LOGGING_STEPS, CALLBACK_STEPS + 1, CALLBACK_LOGGING_STEPS))


def logged_records(state_file: Path) -> dict[int, dict]:
    records = read_log(state_file.parent / CALLBACK_LOG)
    assert [r["step"] for r in records] == list(range(1, CALLBACK_STEPS + 1))
    return {r["step"]: r for r in records if r["step"] in LOGGING_STEPS}


def test_trainer_state_keeps_the_logs_numbers_on_logging_steps(callback_run):
    records = logged_records(callback_run)
    history = json.loads(callback_run.read_text())["log_history"]
    entries = [e for e in history if "gradclip/total_norm" in e]
    assert [e["step"] for e in entries] == LOGGING_STEPS
    for entry in entries:
        want = expected(records[entry["step"]])
        assert {k: v for k, v in entry.items() if k.startswith("gradclip/")} == want
        assert "loss" in entry  # the Trainer's own training entry, not one of its own
    spike = next(e for e in entries if e["step"] == CALLBACK_SPIKE_STEP)
    assert spike["gradclip/spike"] == 1.0
    # The final summary and any evaluation entry are left alone.
    assert all("gradclip/total_norm" not in e for e in history if "train_runtime" in e)


def test_report_to_tensorboard_receives_them_under_the_trainers_train_prefix(callback_run):
    # The Trainer's TensorBoard integration writes every training key as train/<key>.
    records = logged_records(callback_run)
    points = scalars(callback_run.parent / "runs")
    assert_tensorboard_holds(points, [records[s] for s in LOGGING_STEPS], prefix="train/")
    assert points["train/gradclip/spike"][CALLBACK_SPIKE_STEP] == 1.0


def test_trend_reads_the_per_layer_series_back_from_trainer_state(gradclip, callback_run):
    records = logged_records(callback_run)
    r = gradclip("trend", callback_run, "--format", "json", "--fail-on", "any")
    assert r.code == 1, r.err
    doc = r.json()
    assert [p["step"] for p in doc["points"]] == LOGGING_STEPS
    for point in doc["points"]:
        record = records[point["step"]]
        assert point["total_norm"] == record["total_norm"]  # float64, exactly
        assert point["groups"] == record["groups"]
    spike = next(p for p in doc["points"] if p["step"] == CALLBACK_SPIKE_STEP)
    assert spike["spike"]
    history = json.loads(callback_run.read_text())["log_history"]
    if any("grad_norm" in e for e in history):  # transformers >= 5 logs it without clipping
        [audit] = doc["audit"]
        assert audit["framework"]["kind"] == "Trainer grad_norm" and audit["agrees"]
        assert audit["gradclip"]["kind"] == "gradclip/total_norm in log_history"
        assert audit["steps_compared"] == len(LOGGING_STEPS)
    else:
        assert doc["audit"] == []


def test_trend_of_the_output_dir_takes_the_log_and_its_copies_in_trainer_state(
    gradclip, callback_run
):
    # trainer_state.json's entries are the log's own numbers at the logging steps: the
    # run folder's finer series, the log at every step, is the one judged; the others
    # (trainer_state.json, the TensorBoard events) are named as read and not judged.
    r = gradclip("trend", callback_run.parent, "--format", "json", "--fail-on", "any")
    assert r.code == 1, r.err
    doc = r.json()
    assert [p["step"] for p in doc["points"]] == list(range(1, CALLBACK_STEPS + 1))
    assert any(note.startswith(f"judged: {callback_run.parent / CALLBACK_LOG} ")
               for note in doc["notes"])
    [state] = [n for n in doc["notes"] if n.startswith(f"not judged: {callback_run}")]
    # Its points are the callback's norms (gradclip/total_norm), not the Trainer's grad_norm.
    assert "gradclip/total_norm" in state and "log_history grad_norm" not in state, state
    # Given alone, the two are one series: the log's points at the logging steps are
    # copies of trainer_state.json's, one point each.
    r = gradclip("trend", callback_run, callback_run.parent / CALLBACK_LOG, "--format", "json")
    assert any(" the same 12 steps (2-24) and norms as " in n for n in r.json()["notes"])


def test_the_audit_holds_the_trackers_own_grad_norm_against_the_monitor_log(
    gradclip, callback_run
):
    # report_to=["tensorboard"]: the Trainer's own train/grad_norm in the event file is a
    # framework total too, audited against the monitor's log at the logging steps.
    history = json.loads(callback_run.read_text())["log_history"]
    if not any("grad_norm" in e for e in history):
        pytest.skip("this transformers logs no grad_norm without clipping")
    doc = gradclip("trend", callback_run.parent, "--format", "json", "--fail-on", "any").json()
    [audit] = [a for a in doc["audit"] if a["framework"]["kind"] == "TensorBoard train/grad_norm"]
    assert audit["gradclip"]["source"] == str(callback_run.parent / CALLBACK_LOG)
    assert audit["agrees"] and audit["precision"] == "float32"
    assert audit["steps_compared"] == len(LOGGING_STEPS)


def damaged(state_file: Path, tmp_path: Path, change) -> Path:
    """A copy of the run's trainer_state.json with ``change(log_history)`` applied."""
    state = json.loads(state_file.read_text())
    change([e for e in state["log_history"] if "gradclip/total_norm" in e])
    copy = tmp_path / "trainer_state.json"
    copy.write_text(json.dumps(state, indent=2))
    return copy


@pytest.mark.parametrize("change, says", [
    (lambda h: h[3].update({"gradclip/norm/transformer.h.0": "0.5"}),
     "log_history[3]: gradclip/norm/transformer.h.0 must be a number"),
    (lambda h: h[2].update({"gradclip/total_norm": -1.0}),
     "log_history[2]: gradclip/total_norm must be >= 0, got -1"),
    (lambda h: h[4].update({"step": 2}),
     "log_history[4]: gradclip/total_norm of step 2 after one of step 8; a Trainer "
     "logs each step once, in order"),
    (lambda h: h[0].update({"gradclip/norm_type": 0}),
     "log_history[0]: gradclip/norm_type must be > 0"),
])
def test_a_damaged_entry_is_exit_3_naming_the_file_and_entry(gradclip, callback_run, tmp_path,
                                                             change, says):
    path = damaged(callback_run, tmp_path, change)
    r = gradclip("trend", path)
    assert r.code == 3
    assert r.err_lines == [f"gradclip: {path}: {says}"]


def test_a_nan_total_is_a_non_finite_point(gradclip, callback_run, tmp_path):
    path = damaged(callback_run, tmp_path,
                   lambda h: h[-1].update({"gradclip/total_norm": math.nan}))
    r = gradclip("trend", path, "--format", "json")
    assert r.code == 1
    doc = r.json()
    assert doc["status"] == "nonfinite" and doc["points"][-1]["total_norm"] == "nan"


def test_a_hostile_group_name_is_shown_escaped(gradclip, callback_run, tmp_path):
    name = "evil\x1b[2J\nname"
    path = damaged(callback_run, tmp_path,
                   lambda h: [e.update({f"gradclip/norm/{name}": 1.0}) for e in h])
    r = gradclip("trend", path)
    assert r.code == 0, r.err
    assert "\x1b" not in r.out and "evil" in r.out
    doc = gradclip("trend", path, "--format", "json").json()
    assert doc["points"][0]["groups"][name] == 1.0  # JSON keeps it, escaped by json itself


@pytest.mark.parametrize("subclass", [False, True])
def test_the_companion_goes_first_and_the_others_keep_their_order(tmp_path, subclass):
    from transformers import TrainerControl, TrainerState
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

    from gradclip_cli.integrations.transformers import GradMonitorCallback, _TrainerLogs

    class Mine(GradMonitorCallback):  # a user's subclass, calling super()
        def on_train_begin(self, *args, **kwargs):
            return super().on_train_begin(*args, **kwargs)

    kind = Mine if subclass else GradMonitorCallback
    callback = kind(tmp_path / "grads.jsonl", None)
    model = torch.nn.Linear(2, 2)
    others = [DefaultFlowCallback(), TensorBoardCallback()]
    handler = CallbackHandler([*others, callback], model, None, None, None)
    args = transformers.TrainingArguments(str(tmp_path), max_grad_norm=0.0, report_to="none",
                                          use_cpu=True)
    handler.on_train_begin(args, TrainerState(), TrainerControl())
    assert isinstance(handler.callbacks[0], _TrainerLogs)
    assert handler.callbacks[0].owner is callback
    assert handler.callbacks[1:] == [*others, callback]
    handler.on_train_begin(args, TrainerState(), TrainerControl())  # a second train()
    assert len(handler.callbacks) == 4
