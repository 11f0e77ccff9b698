"""``trend`` on trackers' files, each written by the tracker's own library in this test run.

Every reader gets the same series (``tracker_runs.NORMS``: a 50-fold spike at
step 30) and must give back every point, the value the library stored
(float32 for TensorBoard), find the spike at its step, and say which tag it
read from which file, in every format.
"""

from __future__ import annotations

import json
import math
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tracker_runs as tr

from .support import unwrapped


def _points(result) -> dict[int, float]:
    return {p["step"]: float(p["total_norm"]) for p in result.json()["points"]}


def _assert_series(result, *, float32: bool) -> None:
    """Every step, every value as stored, the spike found at its step (exit 1 under
    --fail-on any), the tag named in the notes."""
    assert result.code == 1, result.err
    doc = result.json()
    expected = {s: tr.float32(v) if float32 else v for s, v in tr.NORMS.items()}
    assert _points(result) == expected
    spikes = [p["step"] for p in doc["points"] if p["spike"]]
    assert spikes == [tr.SPIKE_STEP]
    assert any(f"tag '{tr.TAG}'" in note for note in doc["notes"]), doc["notes"]


@pytest.fixture(scope="session")
def tb_runs(tmp_path_factory):
    tr.needs("tensorboard")
    root = tmp_path_factory.mktemp("tensorboard")
    return {
        "simple": tr.write_torch_tensorboard(root / "simple"),
        "tensor": tr.write_torch_tensorboard(root / "tensor", new_style=True),
        "tensorboard": tr.write_tensorboard_writer(root / "tb_writer"),
        "double": tr.write_torch_tensorboard(root / "double", double=True),
    }


@pytest.mark.parametrize("kind", ["simple", "tensor", "tensorboard", "double"])
def test_tensorboard_event_file_every_point(gradclip, tb_runs, kind):
    event_file = tb_runs[kind]
    result = gradclip("trend", event_file, "--format", "json", "--fail-on", "any")
    # TensorBoard's writers store a scalar as float32 (simple_value, or a DT_FLOAT
    # tensor) unless asked for a DT_DOUBLE tensor (torch's double_precision=True).
    _assert_series(result, float32=kind != "double")
    stored = any("stored as float32" in note for note in result.json()["notes"])
    assert stored == (kind != "double")
    assert {p["source"] for p in result.json()["points"]} == {str(event_file)}


def test_tensorboard_folder_is_the_run_and_table_names_tag_and_file(gradclip, tb_runs):
    folder = tb_runs["simple"].parent
    result = gradclip("trend", folder, "--fail-on", "any")
    assert result.code == 1
    text = unwrapped(result.out)
    assert f"TensorBoard tag '{tr.TAG}'" in text and str(tb_runs["simple"]) in text
    assert "stored as float32" in text
    assert f"step {tr.SPIKE_STEP}" in text.splitlines()[-1]


def test_every_format_names_the_tag_and_file(gradclip, tb_runs):
    from markdown_it import MarkdownIt

    event_file = tb_runs["simple"]
    for fmt in ("markdown", "github", "junit"):
        out = gradclip("trend", event_file, "--format", fmt).out
        if fmt == "markdown":  # as a reader sees it, its escapes rendered
            out = MarkdownIt().render(out)
        assert f"tag '{tr.TAG}'" in out.replace("&#x27;", "'").replace("&apos;", "'"), fmt
        assert event_file.name in out, fmt


def test_more_points_than_event_accumulators_reservoir(gradclip, tmp_path):
    """EventAccumulator keeps 10,000 scalars a tag by default; trend keeps every one."""
    tr.needs("tensorboard")
    norms = {step: 1.0 + (step % 7) / 10 for step in range(12_000)}
    norms[11_000] = 500.0
    event_file = tr.write_torch_tensorboard(tmp_path / "long", norms=norms)
    result = gradclip("trend", event_file, "--format", "json", "--fail-on", "any")
    assert result.code == 1
    points = _points(result)
    assert len(points) == 12_000
    assert points == {s: tr.float32(v) for s, v in norms.items()}
    assert [p["step"] for p in result.json()["points"] if p["spike"]] == [11_000]


@pytest.mark.parametrize("cut", ["truncated", "flipped"])
def test_damaged_event_file_is_exit_3_naming_it(gradclip, tb_runs, tmp_path, cut):
    damaged = tmp_path / tb_runs["simple"].name
    data = bytearray(tb_runs["simple"].read_bytes())
    if cut == "truncated":
        data = data[:-7]  # the last record loses its tail
    else:
        data[len(data) // 2] ^= 0xFF  # a record's data no longer matches its CRC
    damaged.write_bytes(bytes(data))
    result = gradclip("trend", damaged, "--format", "json")
    assert result.code == 3
    assert str(damaged) in result.err_lines[-1]
    assert "truncated or damaged" in result.err and "not taken as the whole run" in result.err
    assert result.json()["exit_code"] == 3
    assert "Traceback" not in result.err


def test_nonfinite_values_are_nonfinite_points(gradclip, tmp_path):
    tr.needs("tensorboard")
    norms = dict(tr.NORMS)
    norms[10], norms[39] = math.nan, math.inf
    event_file = tr.write_torch_tensorboard(tmp_path / "nan", norms=norms)
    result = gradclip("trend", event_file, "--format", "json")
    assert result.code == 1
    doc = result.json()
    assert doc["status"] == "nonfinite"
    by_step = {p["step"]: p for p in doc["points"]}
    assert by_step[10]["total_norm"] == "nan" and by_step[39]["total_norm"] == "inf"


def _tensor_scalar_events(folder, tensors):
    """An event file (torch's writer) whose summaries are 0-dim tensors: ``tensors``
    maps step -> {tag: TensorProto}."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, by_tag in tensors.items():
        writer._get_file_writer().add_summary(Summary(value=[
            Summary.Value(tag=tag, tensor=tensor) for tag, tensor in by_tag.items()]), step)
    writer.close()
    return tr._event_file(folder)


def test_bfloat16_and_half_tensor_scalars_read_as_stored(gradclip, tmp_path):
    """A tensor summary of a half or bfloat16 scalar (tensorboard's make_ndarray has no
    numpy bfloat16: it raised) reads as the value stored."""
    tr.needs("tensorboard")
    import torch
    from tensorboard.compat.proto import types_pb2
    from tensorboard.compat.proto.tensor_pb2 import TensorProto

    def bits(value, dtype):  # the 16 bits the proto keeps in half_val
        return int(torch.tensor(value, dtype=dtype).view(torch.int16)) & 0xFFFF

    stored = {dtype: {s: float(torch.tensor(v, dtype=dtype)) for s, v in tr.NORMS.items()}
              for dtype in (torch.bfloat16, torch.float16)}
    event_file = _tensor_scalar_events(tmp_path / "run", {s: {
        "train/grad_norm": TensorProto(dtype=types_pb2.DT_BFLOAT16,
                                       half_val=[bits(v, torch.bfloat16)]),
        "half/grad_norm": TensorProto(dtype=types_pb2.DT_HALF,
                                      half_val=[bits(v, torch.float16)])}
        for s, v in tr.NORMS.items()})
    for tag, dtype in (("train/grad_norm", torch.bfloat16), ("half/grad_norm", torch.float16)):
        result = gradclip("trend", event_file, "--tag", tag, "--format", "json",
                          "--fail-on", "any")
        assert result.code == 1, result.err
        assert _points(result) == stored[dtype]
        assert [p["step"] for p in result.json()["points"] if p["spike"]] == [tr.SPIKE_STEP]


def test_a_scalar_tensor_holding_two_values_is_exit_3_naming_it(gradclip, tmp_path):
    tr.needs("tensorboard")
    from tensorboard.compat.proto.tensor_pb2 import TensorProto

    event_file = _tensor_scalar_events(tmp_path / "run", {
        0: {"grad_norm": TensorProto(dtype=1, float_val=[1.0])},
        1: {"grad_norm": TensorProto(dtype=1, float_val=[1.0, 2.0])}})
    result = gradclip("trend", event_file)
    assert result.code == 3
    assert "Traceback" not in result.err
    assert result.err_lines == [f"gradclip: {event_file}: tag 'grad_norm' at step 1: a "
                                "0-dim tensor that does not hold one value (a damaged event?)"]


def test_huge_steps_are_kept_and_negative_steps_refused(gradclip, tmp_path):
    tr.needs("tensorboard")
    big = 2**62
    huge = tr.write_torch_tensorboard(tmp_path / "huge",
                                      norms={big + s: v for s, v in tr.NORMS.items()})
    result = gradclip("trend", huge, "--format", "json", "--fail-on", "any")
    assert result.code == 1
    assert sorted(_points(result)) == [big + s for s in tr.NORMS]
    negative = tr.write_torch_tensorboard(tmp_path / "negative", norms={-1: 1.0, 0: 1.0})
    result = gradclip("trend", negative)
    assert result.code == 3
    assert result.err_lines == [f"gradclip: {negative}: tag '{tr.TAG}': step -1 is negative; "
                                "a training step counts from 0"]


def test_colliding_tags_are_refused_or_chosen(gradclip, tmp_path):
    tr.needs("tensorboard")
    folder = tmp_path / "both"
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, value in tr.NORMS.items():
        writer.add_scalar("grad_norm", value, step)
        writer.add_scalar("train/grad_norm", 2 * value, step)
    writer.close()
    result = gradclip("trend", folder)
    assert result.code == 2
    assert "'grad_norm'" in result.err and "'train/grad_norm'" in result.err
    assert "--tag" in result.err
    result = gradclip("trend", folder, "--tag", "grad_norm", "--format", "json")
    assert _points(result) == {s: tr.float32(v) for s, v in tr.NORMS.items()}
    result = gradclip("trend", folder, "--tag", "nope")
    assert result.code == 2 and "no tag 'nope'" in result.err


def test_several_runs_refused_with_names_or_chosen(gradclip, tmp_path):
    tr.needs("tensorboard")
    tr.write_torch_tensorboard(tmp_path / "logs" / "run_a")
    tr.write_torch_tensorboard(tmp_path / "logs" / "run_b",
                               norms={s: 3.0 for s in tr.NORMS})
    result = gradclip("trend", tmp_path / "logs")
    assert result.code == 2
    assert "run_a" in result.err and "run_b" in result.err and "--run" in result.err
    result = gradclip("trend", tmp_path / "logs", "--run", "run_b", "--format", "json")
    assert result.code == 0
    assert set(_points(result).values()) == {3.0}


def test_runs_of_one_name_are_refused_with_names_that_pick_one(gradclip, tmp_path):
    """TensorBoard runs have no id: the refusal of a --run that names two offers what
    tells them apart, their names as listed, and following it reads the one named."""
    tr.needs("tensorboard")
    tr.write_torch_tensorboard(tmp_path / "logs" / "a" / "run")
    tr.write_torch_tensorboard(tmp_path / "logs" / "b" / "run",
                               norms={s: 3.0 for s in tr.NORMS})
    result = gradclip("trend", tmp_path / "logs", "--run", "run")
    assert result.code == 2
    listed = str(tmp_path / "logs" / "b" / "run")
    assert listed in result.err and "an id" not in result.err
    assert "--run" in result.err_lines[-1].split("):")[-1]  # the suggestion names the flag
    result = gradclip("trend", tmp_path / "logs", "--run", listed, "--format", "json")
    assert result.code == 0, result.err
    assert set(_points(result).values()) == {3.0}


def test_a_run_named_whole_is_read_though_another_ends_with_its_name(gradclip, tmp_path,
                                                                   monkeypatch):
    tr.needs("tensorboard")
    tr.write_torch_tensorboard(tmp_path / "logs" / "b", norms={s: 1.0 for s in tr.NORMS})
    tr.write_torch_tensorboard(tmp_path / "logs" / "x" / "logs" / "b",
                               norms={s: 3.0 for s in tr.NORMS})
    monkeypatch.chdir(tmp_path)
    result = gradclip("trend", "logs")
    assert result.code == 2 and "(logs/b, logs/x/logs/b)" in result.err
    result = gradclip("trend", "logs", "--run", "logs/b", "--format", "json")
    assert result.code == 0, result.err
    assert set(_points(result).values()) == {1.0}


def test_a_resumed_run_supersedes_the_steps_it_logs_again(gradclip, tmp_path):
    tr.needs("tensorboard")
    folder = tmp_path / "resumed"
    tr.write_torch_tensorboard(folder, norms={s: 1.0 for s in range(20)})
    first = next(folder.glob("events.*"))
    # The resumed writer starts a second file (a later start time in its name) at step 10.
    later = folder / first.name.replace("tfevents.", "tfevents.9", 1)
    tr.write_torch_tensorboard(tmp_path / "second", norms={s: 2.0 for s in range(10, 30)})
    shutil.move(next((tmp_path / "second").glob("events.*")), later)
    result = gradclip("trend", folder, "--format", "json")
    points = _points(result)
    assert points == {**{s: 1.0 for s in range(10)}, **{s: 2.0 for s in range(10, 30)}}
    assert result.err.count("superseded") == 1, result.err  # one warning, not one a read


def test_without_tensorboard_the_refusal_names_the_extra(tb_runs):
    block = ("import sys; sys.modules['tensorboard'] = None; "
             "from gradclip_cli.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", block, "trend", str(tb_runs["simple"])],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 3
    assert "gradclip[tensorboard]" in done.stderr and "Traceback" not in done.stderr


# MLflow: the file store and the SQLite store, written by mlflow itself.

@pytest.fixture(scope="session")
def mlflow_stores(tmp_path_factory):
    tr.needs("mlflow")
    root = tmp_path_factory.mktemp("mlflow")
    tr.write_mlflow({"file:./mlruns": {"calm-run": tr.NORMS},
                     "sqlite:///mlflow.db": {"calm-run": tr.NORMS, "other-run": tr.NORMS,
                                             "nonfinite-run": NONFINITE}}, cwd=root)
    return root


def test_mlflow_file_store(gradclip, mlflow_stores):
    (run,) = [m.parent for m in (mlflow_stores / "mlruns").glob("*/*/meta.yaml")]
    for given in (mlflow_stores / "mlruns", run.parent, run):
        result = gradclip("trend", given, "--format", "json", "--fail-on", "any")
        _assert_series(result, float32=False)
        assert "MLflow" in " ".join(result.json()["notes"])


def test_mlflow_file_store_runs_are_picked_by_their_names_as_logged(gradclip, tmp_path):
    """meta.yaml keeps a run's name as YAML writes it (quoted, escaped, folded across
    lines); --run takes the name the run was given."""
    tr.needs("mlflow")
    names = ("tab\there", "it's: a run", " ".join(["word"] * 20))
    tr.write_mlflow({"file:./mlruns": {name: {s: float(i + 1) for s in range(8)}
                                       for i, name in enumerate(names)}}, cwd=tmp_path)
    refused = gradclip("trend", tmp_path / "mlruns")
    assert refused.code == 2 and "it's: a run" in refused.err
    for i, name in enumerate(names):
        result = gradclip("trend", tmp_path / "mlruns", "--run", name, "--format", "json")
        assert result.code == 0, (name, result.err)
        assert set(_points(result).values()) == {float(i + 1)}, name


# NaN at step 5, +inf at 20, -inf at the newest: MLflow's SQLite store keeps inf as
# +-1.8e308 and NaN as a flag.
NONFINITE = {**tr.NORMS, 5: math.nan, 20: math.inf, 39: -math.inf}


def test_mlflow_nonfinite_values_read_back_as_logged(gradclip, mlflow_stores):
    result = gradclip("trend", mlflow_stores / "mlflow.db", "--run", "nonfinite-run",
                      "--format", "json")
    assert result.code == 1
    doc = result.json()
    assert doc["status"] == "nonfinite"
    by_step = {p["step"]: p["total_norm"] for p in doc["points"]}
    assert (by_step[5], by_step[20], by_step[39]) == ("nan", "inf", "-inf")
    assert by_step[6] == tr.NORMS[6]


def test_mlflow_sqlite_store_several_runs(gradclip, mlflow_stores):
    db = mlflow_stores / "mlflow.db"
    result = gradclip("trend", db)
    assert result.code == 2
    assert "calm-run" in result.err and "other-run" in result.err and "--run" in result.err
    result = gradclip("trend", db, "--run", "calm-run", "--format", "json", "--fail-on", "any")
    _assert_series(result, float32=False)
    with sqlite3.connect(db) as connection:
        (run_id,) = connection.execute(
            "SELECT run_uuid FROM runs WHERE name = 'other-run'").fetchone()
    result = gradclip("trend", db, "--run", run_id, "--format", "json", "--fail-on", "any")
    _assert_series(result, float32=False)


def test_mlflow_sqlite_is_opened_read_only(gradclip, mlflow_stores, tmp_path):
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_stores / "mlflow.db", db)
    db.chmod(0o444)
    tmp_path.chmod(0o555)  # not even a journal could be written beside it
    try:
        result = gradclip("trend", db, "--run", "calm-run", "--format", "json")
    finally:
        tmp_path.chmod(0o755)
    assert result.code == 0, result.err
    assert len(_points(result)) == tr.STEPS


def test_locked_database_is_exit_3(gradclip, mlflow_stores, tmp_path):
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_stores / "mlflow.db", db)
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("PRAGMA journal_mode=DELETE")
    writer.execute("BEGIN EXCLUSIVE")
    try:
        result = gradclip("trend", db, "--run", "calm-run")
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert result.code == 3
    assert result.err_lines[-1].startswith(f"gradclip: {db}: the database is locked")


def test_sqlite_of_another_schema_is_exit_3(gradclip, tmp_path):
    other = tmp_path / "mlflow.db"
    with sqlite3.connect(other) as connection:
        connection.execute("CREATE TABLE metrics (name TEXT, value REAL)")
    result = gradclip("trend", other)
    assert result.code == 3
    assert "neither MLflow's store" in result.err and str(other) in result.err


@pytest.fixture(scope="session")
def trackio_db(tmp_path_factory):
    tr.needs("trackio")
    return tr.write_trackio(tmp_path_factory.mktemp("trackio"), runs=("calm-run", "run-two"))


def test_trackio_project_database(gradclip, trackio_db):
    db = trackio_db
    result = gradclip("trend", db)
    assert result.code == 2 and "calm-run" in result.err and "run-two" in result.err
    result = gradclip("trend", db, "--run", "calm-run", "--format", "json", "--fail-on", "any")
    _assert_series(result, float32=False)
    assert "trackio" in " ".join(result.json()["notes"])


@pytest.fixture(scope="session")
def wandb_run(tmp_path_factory):
    tr.needs("wandb")
    return tr.write_wandb_offline(tmp_path_factory.mktemp("wandb"))


def test_wandb_offline_run(gradclip, wandb_run):
    for given in (wandb_run.parent.parent, wandb_run, next(wandb_run.glob("*.wandb"))):
        result = gradclip("trend", given, "--format", "json", "--fail-on", "any")
        _assert_series(result, float32=False)


def test_wandb_runs_are_picked_by_the_names_wandb_init_gave_them(gradclip, wandb_run,
                                                                  tmp_path):
    """Two offline runs under one wandb/: listed by their W&B names, and --run with one's
    name (as wandb.init(name=...) gave it, as W&B shows it) reads that run."""
    tr.needs("wandb")
    other = tr.write_wandb_offline(tmp_path / "other", name="other-run",
                                   norms={s: 3.0 for s in tr.NORMS})
    shutil.copytree(wandb_run.parent, tmp_path / "both" / "wandb")
    shutil.copytree(other, tmp_path / "both" / "wandb" / other.name)
    result = gradclip("trend", tmp_path / "both")
    assert result.code == 2
    assert "calm-run (id " in result.err and "other-run (id " in result.err
    result = gradclip("trend", tmp_path / "both", "--run", "other-run", "--format", "json")
    assert result.code == 0, result.err
    assert set(_points(result).values()) == {3.0}
    run_id = other.name.rsplit("-", 1)[-1]
    result = gradclip("trend", tmp_path / "both", "--run", run_id, "--format", "json")
    assert set(_points(result).values()) == {3.0}


def test_wandb_steps_of_the_trainers_step_metric(gradclip, tmp_path):
    """The Trainer's W&B callback steps every key by train/global_step (define_metric),
    not by W&B's count of log calls."""
    tr.needs("wandb")
    run = tr.write_wandb_offline(tmp_path, global_step=True)
    result = gradclip("trend", run, "--format", "json", "--fail-on", "any")
    assert result.code == 1, result.err
    assert _points(result) == {5 * s: v for s, v in tr.NORMS.items()}
    assert [p["step"] for p in result.json()["points"] if p["spike"]] == [5 * tr.SPIKE_STEP]


def test_wandb_truncated_run_file_is_exit_3(gradclip, wandb_run, tmp_path):
    run_file = next(wandb_run.glob("*.wandb"))
    damaged = tmp_path / "offline-run-x" / run_file.name
    damaged.parent.mkdir()
    damaged.write_bytes(run_file.read_bytes()[: run_file.stat().st_size * 2 // 3])
    result = gradclip("trend", damaged)
    assert result.code == 3
    assert str(damaged) in result.err and "truncated or damaged" in result.err


def test_wandb_outside_the_tested_range_is_refused(gradclip, wandb_run, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.31.0" if name == "wandb" else real(name))
    result = gradclip("trend", wandb_run)
    assert result.code == 3
    assert "gradclip[wandb]" in result.err and "0.31.0" in result.err


def test_json_validates_against_the_schema(gradclip, tb_runs):
    from tests.json_schemas import assert_valid

    result = gradclip("trend", tb_runs["simple"].parent, "--format", "json")
    assert_valid(json.loads(result.out))


# Frameworks' own loggers: Lightning's TensorBoard and CSV loggers, the Trainer's
# report_to=["tensorboard"].

@pytest.fixture(scope="session")
def lightning_run(tmp_path_factory):
    tr.needs("lightning")
    tr.needs("tensorboard")
    folder = tmp_path_factory.mktemp("lightning")
    return folder, tr.train_lightning(folder)


def _assert_lightning(doc, reference) -> None:
    """Every step, the total and each parameter's norm as Lightning's float32 utility
    computed them (relative 1e-5 of float64: float32 sums of a few elements), the
    spike at its step."""
    assert doc["norm_type"] == 2.0
    points = {p["step"]: p for p in doc["points"]}
    assert sorted(points) == sorted(reference)
    for step, norms in reference.items():
        assert math.isclose(float(points[step]["total_norm"]), norms["total"], rel_tol=1e-5)
        groups = points[step]["groups"]
        assert set(groups) == set(tr.LIGHTNING_LAYERS)
        for layer in tr.LIGHTNING_LAYERS:
            assert math.isclose(float(groups[layer]), norms[layer], rel_tol=1e-5)
    assert [p["step"] for p in doc["points"] if p["spike"]] == [tr.LIGHTNING_SPIKE_STEP]


def test_lightning_tensorboard_and_csv_loggers(gradclip, lightning_run):
    folder, reference = lightning_run
    version = folder / "lightning_logs" / "version_0"
    for given in (version, version / "metrics.csv", folder / "lightning_logs", folder):
        result = gradclip("trend", given, "--format", "json", "--fail-on", "any")
        assert result.code == 1, (given, result.err)
        _assert_lightning(result.json(), reference)
    doc = gradclip("trend", version, "--format", "json").json()
    kinds = {s["source"]: s["judged"] for s in doc["series"]}
    assert sum(kinds.values()) == 1 and str(version / "metrics.csv") in kinds
    assert any("grad_2.0_norm_total" in note for note in doc["notes"])


def test_a_csv_column_name_with_line_breaks_reads_back_whole(gradclip, tmp_path):
    """CSVLogger quotes a key holding a line break; the group is read under its whole
    name (a newline, U+0085 included), never the name less its line breaks."""
    tr.needs("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from gradclip_cli import tracker_tags

    group = "d.<b>\n|\x85x"
    logger = CSVLogger(str(tmp_path), name="lg", version=0)
    for step, value in tr.NORMS.items():
        logger.log_metrics({tracker_tags.TOTAL_NORM: value,
                            tracker_tags.group_norm(group): value / 2}, step=step)
    logger.save()
    version = tmp_path / "lg" / "version_0"
    for given in (version, version / "metrics.csv"):
        result = gradclip("trend", given, "--format", "json", "--fail-on", "any")
        assert result.code == 1, result.err
        for point in result.json()["points"]:
            assert point["groups"] == {group: tr.NORMS[point["step"]] / 2}
        assert result.json()["points"][tr.SPIKE_STEP]["spike_groups"] == [group]


@pytest.fixture(scope="session")
def trainer_tensorboard_run(tmp_path_factory):
    tr.needs("transformers")
    tr.needs("tensorboard")
    from tests.trainer_runs import train_with_spike

    output_dir = tmp_path_factory.mktemp("hf_tensorboard")
    train_with_spike(output_dir, report_to=("tensorboard",))
    return output_dir


def test_trainer_report_to_tensorboard(gradclip, trainer_tensorboard_run):
    from tests.trainer_runs import SPIKE_STEP, STEPS

    output_dir = trainer_tensorboard_run
    state = json.loads((output_dir / "trainer_state.json").read_text())
    logged = {e["step"]: e["grad_norm"] for e in state["log_history"] if "grad_norm" in e}
    assert len(logged) == STEPS
    event_files = list(output_dir.rglob("events.out.tfevents.*"))
    assert event_files
    for given in (event_files[0].parent, event_files[0]):
        result = gradclip("trend", given, "--format", "json", "--fail-on", "any")
        assert result.code == 1, result.err
        # The Trainer's TensorBoard callback writes the logged float as float32.
        assert _points(result) == {s: tr.float32(v) for s, v in logged.items()}
        assert [p["step"] for p in result.json()["points"] if p["spike"]] == [SPIKE_STEP]
        assert any("tag 'train/grad_norm'" in n for n in result.json()["notes"])
    # The output_dir holds both series of one run: one is judged, the other named.
    doc = gradclip("trend", output_dir, "--format", "json").json()
    assert {s["kind"] for s in doc["series"]} == {"trainer-state", "tracker"}
    assert [s["judged"] for s in doc["series"]].count(True) == 1


@pytest.mark.parametrize("tag", ["grad_norm", "grad_norm/total", "grad-norm",
                                 "train/grad_norm", "grad_2.0_norm_total"])
def test_each_frameworks_total_is_found_by_name(gradclip, tmp_path, tag):
    tr.needs("tensorboard")
    tr.write_torch_tensorboard(tmp_path / "run", tag=tag)
    result = gradclip("trend", tmp_path / "run", "--format", "json", "--fail-on", "any")
    assert result.code == 1
    assert _points(result) == {s: tr.float32(v) for s, v in tr.NORMS.items()}
    assert any(f"tag '{tag}' found by name" in n for n in result.json()["notes"])


@pytest.mark.parametrize("lookalike", ["grad_1.2.3_norm_total", "grad_._norm_total",
                                       "grad_0_norm_total", "grad_0.0_norm_total"])
def test_a_tag_shaped_as_lightnings_without_a_p_above_0_is_no_norm(gradclip, tmp_path,
                                                                   lookalike):
    """Lightning's grad_norm refuses p <= 0 and writes p as a float: a tag of that shape
    with no such p is another tag, and the framework's total beside it is read."""
    tr.needs("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run"))
    for step, value in tr.NORMS.items():
        writer.add_scalar(lookalike, 1.0, step)
        writer.add_scalar("train/grad_norm", value, step)
    writer.close()
    result = gradclip("trend", tmp_path / "run", "--format", "json", "--fail-on", "any")
    assert result.code == 1, result.err
    assert result.json()["norm_type"] == 2.0
    assert _points(result) == {s: tr.float32(v) for s, v in tr.NORMS.items()}


def test_gradclip_tags_read_back_with_groups_and_preferred(gradclip, tmp_path):
    """gradclip's own scheme (tracker_tags), under the Trainer's train/ prefix, beside the
    framework's own total: gradclip's is read (it has the groups) and the other named."""
    tr.needs("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    from gradclip_cli import tracker_tags

    writer = SummaryWriter(str(tmp_path / "run"))
    groups = {"transformer.h.0": 0.25, "lm_head": 0.5}
    for step, value in tr.NORMS.items():
        writer.add_scalar("train/" + tracker_tags.TOTAL_NORM, value, step)
        writer.add_scalar("train/grad_norm", value, step)
        for group, share in groups.items():
            writer.add_scalar("train/" + tracker_tags.group_norm(group), value * share, step)
        writer.add_scalar("train/" + tracker_tags.CLIP_COEF, 1.0, step)
    writer.close()
    result = gradclip("trend", tmp_path / "run", "--format", "json", "--fail-on", "any")
    assert result.code == 1
    doc = result.json()
    for point in doc["points"]:
        value = tr.NORMS[point["step"]]
        assert point["total_norm"] == tr.float32(value)
        assert point["groups"] == {g: tr.float32(value * share) for g, share in groups.items()}
    note = next(n for n in doc["notes"] if "found by name" in n)
    assert "gradclip's own tag" in note and "not read: 'train/grad_norm'" in note


def test_tag_and_run_need_a_tracker_input(gradclip, tmp_path):
    log = tmp_path / "grads.jsonl"
    log.write_text(json.dumps({"schema": "gradclip.monitor/1", "step": 1,
                               "total_norm": 1.0, "norm_type": 2.0}) + "\n")
    for flag in ("--tag", "--run"):
        result = gradclip("trend", log, flag, "x")
        assert result.code == 2 and f"{flag} picks from a tracker's files" in result.err


def test_without_wandb_the_refusal_names_the_extra(wandb_run):
    block = ("import sys; sys.modules['wandb'] = None; "
             "from gradclip_cli.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", block, "trend", str(wandb_run)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 3
    assert "gradclip[wandb]" in done.stderr and "Traceback" not in done.stderr


def test_a_trackers_store_that_cannot_be_chosen_from_leaves_the_run_folder_readable(
        gradclip, trainer_tensorboard_run, tmp_path):
    """Two launches' TensorBoard runs under the Trainer's runs/: the run folder's other
    series is judged, and the note says why the tracker's was not read, and how."""
    output_dir = tmp_path / "out"
    shutil.copytree(trainer_tensorboard_run, output_dir)
    (run_dir,) = {p.parent for p in output_dir.rglob("events.out.tfevents.*")}
    shutil.copytree(run_dir, run_dir.with_name(run_dir.name + "-second"))
    result = gradclip("trend", output_dir, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert [s["kind"] for s in doc["series"] if s["judged"]] == ["trainer-state"]
    assert any(n.startswith("not read: ") and "2 TensorBoard runs" in n and "--run" in n
               for n in doc["notes"])
    chosen = gradclip("trend", output_dir, "--run", run_dir.name, "--format", "json")
    assert chosen.code == 0 and "tracker" in {s["kind"] for s in chosen.json()["series"]}


def test_a_run_folders_tracker_without_its_extra_is_exit_3_whose_exclude_works(
        gradclip, trainer_tensorboard_run, tmp_path):
    """The run folder's TensorBoard run may be the finest series or disagree with the
    others: without the extra that reads it, the verdict would change silently. It is
    exit 3 naming the file and the extra, and the --exclude it offers leaves it out."""
    output_dir = tmp_path / "out"
    shutil.copytree(trainer_tensorboard_run, output_dir)
    (event,) = output_dir.rglob("events.out.tfevents.*")
    top = event.relative_to(output_dir).parts[0]
    block = ("import sys; sys.modules['tensorboard'] = None; "
             "from gradclip_cli.cli import main; main()")

    def without_tensorboard(*args):
        return subprocess.run([sys.executable, "-c", block, "trend", str(output_dir), *args],
                              capture_output=True, text=True, timeout=600)

    refused = without_tensorboard()
    assert refused.returncode == 3 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert line.startswith(f"gradclip: {event}: ")
    assert "pip install 'gradclip[tensorboard]'" in line and line.endswith(f"--exclude {top}")
    followed = without_tensorboard("--exclude", top, "--format", "json")
    assert followed.returncode in (0, 1), followed.stderr
    doc = json.loads(followed.stdout)
    assert {p["source"] for p in doc["points"]} == {str(output_dir / "trainer_state.json")}


def test_mlflow_metric_line_cut_short_is_exit_3(gradclip, mlflow_stores, tmp_path):
    shutil.copytree(mlflow_stores / "mlruns", tmp_path / "mlruns")
    (metric,) = (tmp_path / "mlruns").glob("*/*/metrics/train/grad_norm")
    lines = metric.read_text().splitlines()
    metric.write_text("\n".join(lines) + "\n" + lines[-1].rsplit(" ", 1)[0])
    result = gradclip("trend", tmp_path / "mlruns")
    assert result.code == 3
    assert result.err_lines[-1].startswith(f"gradclip: {metric}:{len(lines) + 1}: not an "
                                           "MLflow metric line")


def test_an_event_file_without_a_norm_tag_lists_its_tags(gradclip, tmp_path):
    tr.needs("tensorboard")
    event_file = tr.write_torch_tensorboard(tmp_path / "run", tag="train/lr")
    result = gradclip("trend", event_file)
    assert result.code == 3
    assert "logs no gradient norm" in result.err and "'train/lr'" in result.err
    assert "'train/loss'" in result.err and "--tag" in result.err
    result = gradclip("trend", event_file, "--tag", "train/lr", "--format", "json")
    assert result.code == 0 and len(_points(result)) == tr.STEPS


def test_a_hostile_framework_tag_in_the_norm_audit_is_escaped(gradclip, tmp_path):
    """The audit names the framework's tag: escaped in the table and the -q verdict, as
    every other name is, so it can neither colour the terminal nor start a line of its
    own (a GitHub workflow command)."""
    tr.needs("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    run.mkdir()
    norms = {step: 1.0 + step / 16 for step in range(12)}  # exact in float32
    (run / "grads.jsonl").write_text("".join(
        json.dumps({"schema": "gradclip.monitor/1", "step": s, "total_norm": v,
                    "norm_type": 2.0}) + "\n" for s, v in norms.items()))
    tag = "<b>\x1b[31m\n::error::pwned/grad_norm"
    writer = SummaryWriter(str(run / "tb"))
    for step, value in norms.items():
        writer.add_scalar(tag, 1.5 * value if step == 4 else value, step)
    writer.close()
    table = gradclip("trend", run)
    assert table.code == 1, table.err  # the audit disagrees at step 4
    assert "DISAGREE at 1 of 12" in unwrapped(table.out)
    quiet = gradclip("trend", run, "-q")
    assert quiet.code == 1
    for out in (table.out, quiet.out, quiet.err):
        assert "\x1b" not in out
        assert not any(line.lstrip().startswith("::error::") for line in out.splitlines())
    assert len(quiet.out.splitlines()) == 1
    assert "\\x1b[31m\\n::error::pwned/grad_norm" in quiet.out


def _folder_state(folder) -> dict:
    """Every entry of ``folder`` and the folder itself: size, mtime (ns), bytes."""
    state = {".": folder.stat().st_mtime_ns}
    for entry in sorted(folder.iterdir()):
        st = entry.stat()
        state[entry.name] = (st.st_size, st.st_mtime_ns, entry.read_bytes())
    return state


@pytest.mark.parametrize("store", ["trackio", "mlflow"])
def test_a_trackers_database_and_its_folder_are_left_as_they_were(
        gradclip, trackio_db, mlflow_stores, tmp_path, store):
    """trackio keeps its database in WAL mode: a read-only open still made the
    -wal and -shm files beside a database that had none (its writer gone)."""
    db = tmp_path / "store" / "runs.db"
    db.parent.mkdir()
    shutil.copy(trackio_db if store == "trackio" else mlflow_stores / "mlflow.db", db)
    before = _folder_state(db.parent)
    result = gradclip("trend", db, "--run", "calm-run", "--format", "json",
                      "--fail-on", "any")
    _assert_series(result, float32=False)
    assert _folder_state(db.parent) == before


@pytest.fixture(scope="session")
def trainer_overflow_run(tmp_path_factory):
    tr.needs("transformers")
    tr.needs("tensorboard")
    from tests.trainer_runs import train_overflowing

    output_dir = tmp_path_factory.mktemp("hf_overflow")
    return output_dir, train_overflowing(output_dir, report_to=("tensorboard",))


def test_a_logged_infinite_norm_of_finite_gradients_is_not_called_non_finite_gradients(
        gradclip, trainer_overflow_run):
    """The Trainer logs torch's float32 norm: at the last step every gradient is finite
    (float64 norm ~1e26) but its squares overflow float32, so it logs grad_norm inf. A
    logged total holds no element counts: the verdict names the norm that is inf, as
    compare's does, never "non-finite gradients", in the table, -q, github and junit."""
    from tests.trainer_runs import OVERFLOW_STEPS

    output_dir, reference = trainer_overflow_run
    last = reference[OVERFLOW_STEPS]
    assert math.isfinite(last) and last > 1e20  # the gradients themselves were finite
    state = json.loads((output_dir / "trainer_state.json").read_text())
    logged = {e["step"]: e["grad_norm"] for e in state["log_history"] if "grad_norm" in e}
    assert logged[OVERFLOW_STEPS] == math.inf
    event_file = next(output_dir.rglob("events.out.tfevents.*"))
    for given in (output_dir / "trainer_state.json", event_file):
        doc = gradclip("trend", given, "--format", "json").json()
        assert doc["status"] == "nonfinite" and doc["points"][-1]["total_norm"] == "inf"
        table = gradclip("trend", given)
        assert table.code == 1
        verdict = table.out.strip().splitlines()[-1]
        assert verdict.startswith("FAIL: non-finite gradient norm at the newest point"), verdict
        quiet = gradclip("trend", given, "-q")
        assert quiet.code == 1 and "non-finite gradient norm" in quiet.out + quiet.err
        for fmt in ("github", "junit", "markdown"):
            out = gradclip("trend", given, "--format", fmt).out
            assert "non-finite gradient norm" in out, (fmt, out)
            assert "non-finite gradients" not in out, (fmt, out)


def test_lightning_csv_runs_of_two_experiments_are_picked_by_the_names_listed(gradclip,
                                                                            tmp_path):
    """Lightning's ``CSVLogger(save_dir, name=EXPERIMENT)`` numbers each experiment's
    versions from 0: two experiments under one folder hold two ``version_0/``. The
    refusal lists the runs by names that tell them apart, and ``--run`` with one of them
    (or its tail, ``exp_b/version_0``) reads that run: exp_b's spike, not exp_a's calm."""
    tr.needs("lightning")
    from lightning.pytorch.loggers import CSVLogger

    norms = {"exp_a": {s: 1.0 for s in tr.NORMS}, "exp_b": tr.NORMS}
    for name, series in norms.items():
        logger = CSVLogger(str(tmp_path / "logs"), name=name, version=0)
        for step, value in series.items():
            logger.log_metrics({"grad_norm": value}, step=step)
        logger.save()
    refused = gradclip("trend", tmp_path / "logs")
    assert refused.code == 2, refused.err
    listed = refused.err.split("(", 1)[1].split(")", 1)[0].split(", ")
    assert len(listed) == 2 and len(set(listed)) == 2, refused.err
    picked = next(name for name in listed if "exp_b" in name)
    for run in (picked, "exp_b/version_0"):
        result = gradclip("trend", tmp_path / "logs", "--run", run, "--format", "json",
                          "--fail-on", "any")
        assert result.code == 1, result.err
        assert _points(result) == tr.NORMS


def test_a_wandb_run_resumed_offline_is_one_run(gradclip, tmp_path):
    """``wandb.init(id=ID, resume="allow")`` offline writes each session to a folder of its
    own with the same id (``wandb sync`` makes them one run). They are one run, read in
    the order the sessions ran: the resumed session's steps supersede the first's from
    where it resumed, as a resumed TensorBoard run's do; never a refusal whose
    ``--run`` (name or id) names both again."""
    tr.needs("wandb")
    first = {s: 2.0 for s in range(25)}  # the session that stopped at step 24
    resumed_from = 10
    again = {s: v for s, v in tr.NORMS.items() if s >= resumed_from}
    tr._write_in_process(f"""
        import time
        import wandb
        for norms in ({first!r}, {again!r}):
            run = wandb.init(project="p", id="resumed1", name="long-run", resume="allow")
            for step, value in norms.items():
                run.log({{"train/grad_norm": value}}, step=step)
            run.finish()
            time.sleep(1.5)  # a later session: a later folder name
        """, tmp_path, {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                        "WANDB_DIR": str(tmp_path)})
    folders = sorted((tmp_path / "wandb").glob("offline-run-*-resumed1"))
    assert len(folders) == 2, folders
    expected = {**{s: 2.0 for s in range(resumed_from)}, **again}
    for run in ((), ("--run", "resumed1"), ("--run", "long-run")):
        result = gradclip("trend", tmp_path / "wandb", *run, "--format", "json",
                          "--fail-on", "any")
        assert result.code == 1, result.err
        assert _points(result) == expected
        assert [p["step"] for p in result.json()["points"] if p["spike"]] == [tr.SPIKE_STEP]
        assert "superseded" in result.err


def test_trainer_report_to_trackio_points_sit_at_the_trainers_steps(gradclip, tmp_path):
    """The Trainer's trackio callback logs without ``step=`` (trackio then numbers its
    log calls from 0, evaluations included) and puts the Trainer's step in every row
    as ``train/global_step``: each point sits at the Trainer's step, as
    ``trainer_state.json`` numbers it, and the spike at its own step."""
    tr.needs("transformers")
    tr.needs("trackio")
    from tests.trainer_runs import EVALUATED_SPIKE_STEP

    root = Path(__file__).resolve().parents[2]
    output_dir = tmp_path / "out"
    tr._write_in_process(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(root)!r})
        from tests.trainer_runs import train_evaluated
        train_evaluated(Path({str(output_dir)!r}), report_to=("trackio",))
        """, tmp_path, {"TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HOME": str(tmp_path / "hf")})
    state = json.loads((output_dir / "trainer_state.json").read_text())
    logged = {e["step"]: e["grad_norm"] for e in state["log_history"] if "grad_norm" in e}
    database = next((tmp_path / "trackio").glob("*.db"))
    result = gradclip("trend", database, "--format", "json", "--fail-on", "any")
    assert result.code == 1, result.err
    assert _points(result) == logged
    assert [p["step"] for p in result.json()["points"] if p["spike"]] == [EVALUATED_SPIKE_STEP]


def test_of_two_copies_of_a_run_the_float64_one_is_judged(gradclip, tmp_path):
    """Lightning Fabric's loggers side by side (``fabric.log_dict`` hands each the same
    float64 numbers): its TensorBoardLogger stores them as float32, its CSVLogger as
    written. The two series have every step; the one that kept the logged numbers is
    judged, the float32 copy named as not judged."""
    tr.needs("lightning")
    tr.needs("tensorboard")
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

    loggers = [TensorBoardLogger(str(tmp_path), name="lightning_logs", version=0),
               CSVLogger(str(tmp_path), name="lightning_logs", version=0)]
    for step, value in tr.NORMS.items():
        for logger in loggers:
            logger.log_metrics({"grad_norm": value}, step=step)
    for logger in loggers:
        logger.finalize("success")
    version = tmp_path / "lightning_logs" / "version_0"
    assert any(tr.float32(v) != v for v in tr.NORMS.values())
    result = gradclip("trend", version, "--format", "json", "--fail-on", "any")
    assert result.code == 1, result.err
    assert _points(result) == tr.NORMS
    judged = [s["source"] for s in result.json()["series"] if s["judged"]]
    assert judged == [str(version / "metrics.csv")]


def test_exclude_leaves_out_a_run_folders_trainer_state(gradclip, trainer_tensorboard_run):
    """``--exclude trainer_state.json`` leaves the Trainer's state out of the run folder as
    it leaves out any other input there: the TensorBoard series is judged, and a note
    says what was left out."""
    output_dir = trainer_tensorboard_run
    result = gradclip("trend", output_dir, "--exclude", "trainer_state.json",
                      "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert [s["kind"] for s in doc["series"]] == ["tracker"]
    assert any(n.startswith("left out: ") and "trainer_state.json" in n for n in doc["notes"])


def test_a_run_folder_holding_another_runs_tracker_copy_is_refused(gradclip,
                                                                   trainer_tensorboard_run,
                                                                   tmp_path):
    """An ``output_dir`` trained into twice: the first run reported to TensorBoard (40
    steps, spike at 30), the second did not (10 steps, spike at 7) and wrote
    ``trainer_state.json`` anew. The TensorBoard ``train/grad_norm`` and the state's
    ``grad_norm`` are copies of one logged number, yet differ (from step 1: the second
    run's data is other): two runs, so
    neither is judged as the folder's run (the old one has more points); exit 2 naming
    both, and the ``--exclude`` it suggests leaves the old run out."""
    from tests.trainer_runs import _train

    output_dir = tmp_path / "out"
    shutil.copytree(trainer_tensorboard_run, output_dir)
    _train(output_dir, steps=10, spike_step=7, save=False, max_grad_norm=1.0)
    state = json.loads((output_dir / "trainer_state.json").read_text())
    logged = {e["step"]: e["grad_norm"] for e in state["log_history"] if "grad_norm" in e}
    refused = gradclip("trend", output_dir)
    assert refused.code == 2, refused.err
    assert "trainer_state.json" in refused.err and "events.out.tfevents" in refused.err
    assert "differ at step 1 " in refused.err and "--exclude runs" in refused.err
    result = gradclip("trend", output_dir, "--exclude", "runs", "--format", "json",
                      "--fail-on", "any")
    assert result.code == 1, result.err
    assert _points(result) == logged
    assert [p["step"] for p in result.json()["points"] if p["spike"]] == [7]


def test_an_mlflow_logged_models_metrics_are_not_a_run(gradclip, tmp_path):
    """MLflow 3 keeps a LoggedModel in ``mlruns/<experiment>/models/<model_id>/``, its own
    ``meta.yaml`` and ``metrics/`` (each line also naming the run that logged it): the
    run's metrics linked to the model, not a run. One run, read as such; never a refusal
    listing the model as a run that ``--run`` cannot read."""
    tr.needs("mlflow")
    tr._write_in_process(f"""
        import json
        import mlflow
        {tr._NORMS_FROM_JSON.format(json.dumps(tr.NORMS))}
        mlflow.set_tracking_uri("file:./mlruns")
        with mlflow.start_run(run_name="the-run"):
            model = mlflow.initialize_logged_model(name="the-model")
            for step, value in NORMS.items():
                mlflow.log_metric({tr.TAG!r}, value, step=step, model_id=model.model_id)
        """, tmp_path, {"MLFLOW_ALLOW_FILE_STORE": "true"})
    assert list((tmp_path / "mlruns").glob("*/models/*/metrics"))
    result = gradclip("trend", tmp_path / "mlruns", "--format", "json", "--fail-on", "any")
    _assert_series(result, float32=False)


def test_tag_reads_the_runs_of_a_folder_that_log_it(gradclip, trainer_tensorboard_run,
                                                    tmp_path):
    """An ``output_dir`` whose Trainer reported to TensorBoard (``train/grad_norm``) and
    MLflow (``grad_norm``): ``--tag`` names one tracker's tag, and reads the runs that
    log it; a run without it is noted, not a refusal that no ``--tag`` could pass."""
    tr.needs("mlflow")
    output_dir = tmp_path / "out"
    shutil.copytree(trainer_tensorboard_run, output_dir)
    state = json.loads((output_dir / "trainer_state.json").read_text())
    logged = {e["step"]: e["grad_norm"] for e in state["log_history"] if "grad_norm" in e}
    tr.write_mlflow({"sqlite:///mlflow.db": {"the-run": logged}}, cwd=output_dir,
                    tag="grad_norm")
    for tag, store, values in (("train/grad_norm", "runs", {s: tr.float32(v) for s, v
                                                             in logged.items()}),
                               ("grad_norm", "mlflow.db", logged)):
        result = gradclip("trend", output_dir, "--tag", tag, "--format", "json")
        assert result.code == 0, (tag, result.err)
        doc = result.json()
        trackers = [s for s in doc["series"] if s["kind"] == "tracker"]
        assert len(trackers) == 1 and f"/{store}" in trackers[0]["source"], trackers
        series = [s for s in doc["series"] if s["judged"]]
        assert series == trackers or series[0]["kind"] == "trainer-state"
        assert any(f"no tag {tag!r}" in n for n in doc["notes"]), doc["notes"]
        got = gradclip("trend", output_dir, "--tag", tag, "--exclude", "trainer_state.json",
                       "--format", "json")
        assert got.code == 0, got.err
        assert _points(got) == values


@pytest.mark.parametrize("what", ["exp_avg", "weights"])
def test_what_other_than_grads_on_a_folder_of_tracker_files_is_a_usage_error(gradclip,
                                                                            tb_runs, what):
    """A folder holding a tracker's run alone logs gradient norms only: ``--what exp_avg``
    is exit 2 naming the run's file, as for the file given alone; never a crash."""
    folder = tb_runs["simple"].parent
    for given in (folder, tb_runs["simple"]):
        result = gradclip("trend", given, "--what", what)
        assert result.code == 2, result.err
        assert f"--what {what}: " in result.err and "gradient norms" in result.err
        assert "Error" not in result.err and str(tb_runs["simple"]) in result.err
