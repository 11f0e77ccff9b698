"""``--tag`` reads any scalar of a tracker: the verdict names the tag read, never "gradient".

``trend --tag train/loss`` judged the loss and said "gradient spike at step 30"
in every format (a verdict about the wrong quantity). Each run here is written
by the tracker's own library (torch's ``SummaryWriter``, ``mlflow``): a loss
with a 50-fold jump at its newest step beside a calm gradient norm. The
verdict, the findings and the JSON must name the tag (escaped: a tag is a
file's data), and where the tag's name is no gradient norm's, say that it was
read as one only because ``--tag`` named it.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests import tracker_runs as tr
from tests.json_schemas import assert_valid

from .support import unwrapped, verdict

LOSS = "train/loss"
NOTE = "read as the gradient norm only because --tag named it"
# The loss's values: tracker_runs' series up to its 50-fold jump, the newest point.
LOSS_VALUES = {step: value for step, value in tr.NORMS.items() if step <= tr.SPIKE_STEP}
GRAD_NORMS = {step: 0.5 + 0.01 * (step % 3) for step in LOSS_VALUES}  # calm throughout


def _tensorboard_run(folder, tag: str = LOSS):
    """torch's SummaryWriter: ``tag`` (the jump) and a calm ``train/grad_norm``."""
    tr.needs("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, value in LOSS_VALUES.items():
        writer.add_scalar(tag, value, step)
        writer.add_scalar(tr.TAG, GRAD_NORMS[step], step)
    writer.close()
    return tr._event_file(folder)


def _mlflow_run(folder):
    """mlflow's file store: ``train/loss`` holding the jump (and mlflow_runs' ``loss``)."""
    tr.needs("mlflow")
    tr.write_mlflow({"file:./mlruns": {"run": LOSS_VALUES}}, cwd=folder, tag=LOSS)
    return folder / "mlruns"


@pytest.fixture(params=["tensorboard", "mlflow"])
def loss_run(request, tmp_path):
    return (_tensorboard_run if request.param == "tensorboard" else _mlflow_run)(
        tmp_path / "run")


def test_the_loss_given_with_tag_is_named_in_every_format(gradclip, loss_run):
    table = gradclip("trend", loss_run, "--tag", LOSS)
    assert table.code == 1, table.err
    line = verdict(table.out)
    assert line.startswith(f"FAIL: '{LOSS}' (given with --tag) spike at the newest point "
                           f"(step {tr.SPIKE_STEP}: value "), line
    assert "gradient" not in line and "norm" not in line
    text = unwrapped(table.out)
    assert NOTE in text
    assert f"{len(LOSS_VALUES)} points, '{LOSS}' (given with --tag), groups by" in text

    quiet = gradclip("trend", loss_run, "--tag", LOSS, "-q")
    assert quiet.code == 1 and quiet.out.strip() == line

    doc = assert_valid(gradclip("trend", loss_run, "--tag", LOSS, "--format", "json").out)
    assert doc["status"] == "spike"
    assert doc["tag"] == {"name": LOSS, "given_with": "--tag",
                          "named_as_gradient_norm": False}
    assert any(NOTE in note for note in doc["notes"]), doc["notes"]
    assert [p["step"] for p in doc["points"] if p["spike"]] == [tr.SPIKE_STEP]

    github = gradclip("trend", loss_run, "--tag", LOSS, "--format", "github")
    assert github.code == 1
    errors = [x for x in github.out.splitlines() if x.startswith("::error")]
    assert len(errors) == 1, github.out
    # A property value escapes ':' and ','; the title names the tag, not gradients.
    assert f"title=gradclip%3A '{LOSS}' (given with --tag) spike at step 30::" in errors[0]
    assert f"value {tr.norm_at(tr.SPIKE_STEP):.6g}, z " in errors[0]
    assert "gradient" not in errors[0]
    assert any(x.startswith("::notice") and NOTE in x for x in github.out.splitlines())

    junit = gradclip("trend", loss_run, "--tag", LOSS, "--format", "junit")
    assert junit.code == 1
    root = ET.fromstring(junit.out)
    (failure,) = root.iter("failure")
    assert failure.get("message") == f"'{LOSS}' (given with --tag) spike at step 30"
    out = root.find("testsuite/system-out").text
    assert out.splitlines()[0] == line and NOTE in out

    markdown = gradclip("trend", loss_run, "--tag", LOSS, "--format", "markdown")
    assert markdown.code == 1
    assert f"'{LOSS}' (given with --tag) spike at the newest point" in markdown.out
    assert "gradient spike" not in markdown.out and NOTE in markdown.out


def test_a_gradient_norm_given_with_tag_is_named_without_the_note(gradclip, tmp_path):
    """A tag whose name is a gradient norm's is named as given, with no note: --tag
    picked it, and its name says what it is."""
    event_file = _tensorboard_run(tmp_path / "run", tag="grad_norm")  # beside train/grad_norm
    assert gradclip("trend", event_file).code == 2  # two totals: give --tag
    result = gradclip("trend", event_file, "--tag", "grad_norm", "--format", "json")
    assert result.code == 1
    doc = assert_valid(result.out)
    assert doc["tag"] == {"name": "grad_norm", "given_with": "--tag",
                          "named_as_gradient_norm": True}
    assert not any(NOTE in note for note in doc["notes"])
    table = gradclip("trend", event_file, "--tag", "grad_norm")
    assert verdict(table.out).startswith("FAIL: 'grad_norm' (given with --tag) spike")
    assert NOTE not in unwrapped(table.out)
    # Found by name, the calm one: the words of a gradient norm, as before.
    calm = gradclip("trend", event_file, "--tag", tr.TAG, "--format", "json")
    assert calm.code == 0 and calm.json()["tag"]["named_as_gradient_norm"] is True


def test_a_hostile_tag_is_escaped_once_in_every_format(gradclip, tmp_path):
    """The tag is a file's data: it can neither colour the terminal nor start a line of its
    own (a GitHub workflow command), and shows as every other name shows."""
    tag = "<b>\x1b[31m\n::error::pwned"
    event_file = _tensorboard_run(tmp_path / "run", tag=tag)
    shown = "'<b>\\x1b[31m\\n::error::pwned' (given with --tag)"
    for fmt in ("table", "markdown", "github", "junit"):
        result = gradclip("trend", event_file, "--tag", tag, "--format", fmt)
        assert result.code == 1, result.err
        assert "\x1b" not in result.out
        assert not any(x.lstrip().startswith("::error::pwned") for x in result.out.splitlines())
        if fmt != "markdown":  # Markdown writes a backslash as two (its own quoting)
            assert "\\\\x1b" not in result.out, result.out  # escaped once, not twice
    quiet = gradclip("trend", event_file, "--tag", tag, "-q")
    assert quiet.out.startswith(f"FAIL: {shown} spike at the newest point")
    assert len(quiet.out.splitlines()) == 1
    github = gradclip("trend", event_file, "--tag", tag, "--format", "github").out
    assert "%3A%3Aerror%3A%3Apwned' (given with --tag) spike at step 30" in github


def test_the_loss_beside_a_monitor_log_is_refused_not_judged_as_one_series(gradclip, tmp_path):
    """A loss and a log of gradient norms are two quantities: exit 2 naming both, and the
    way out it gives (the tag's file alone) judges the loss."""
    event_file = _tensorboard_run(tmp_path / "run")
    log = tmp_path / "grads.jsonl"
    log.write_text("".join(json.dumps({"schema": "gradclip.monitor/1", "step": s,
                                       "total_norm": v, "norm_type": 2.0}) + "\n"
                           for s, v in GRAD_NORMS.items()))
    refused = gradclip("trend", event_file, log, "--tag", LOSS)
    assert refused.code == 2
    assert refused.err_lines == [
        f"gradclip: {event_file}: tag '{LOSS}' (given with --tag) is no gradient norm by "
        f"its name, but {log} is read with it as one run's norms; one quantity at a time: "
        "give the tag's file alone"]
    assert gradclip("autopsy", event_file, log, "--tag", LOSS).code == 2
    assert gradclip("trend", event_file, "--tag", LOSS).code == 1


def test_autopsy_of_the_loss_names_the_tag(gradclip, loss_run):
    result = gradclip("autopsy", loss_run, "--tag", LOSS, "--format", "json")
    assert result.code == 1, result.err
    doc = assert_valid(result.out)
    assert doc["step"] == tr.SPIKE_STEP and doc["status"] == "explained"
    assert doc["tag"] == {"name": LOSS, "given_with": "--tag",
                          "named_as_gradient_norm": False}
    assert doc["verdict"].startswith(f"step {tr.SPIKE_STEP}: spike in '{LOSS}' (given with "
                                     "--tag) of ")
    assert "the total of" not in doc["verdict"]
    assert any(NOTE in note for note in doc["notes"])
    table = gradclip("autopsy", loss_run, "--tag", LOSS)
    text = unwrapped(table.out)
    assert f"step {tr.SPIKE_STEP} of '{LOSS}' (given with --tag) of " in text
    assert f"'{LOSS}' (given with --tag): onset at step {tr.SPIKE_STEP}" in text
    assert NOTE in text
    github = gradclip("autopsy", loss_run, "--tag", LOSS, "--format", "github").out
    (error,) = [x for x in github.splitlines() if x.startswith("::error")]
    assert f"spike in '{LOSS}' (given with --tag) of " in error
