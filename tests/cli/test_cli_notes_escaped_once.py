"""A name in a note of trend or autopsy is shown escaped exactly once, in every format.

The rule is inspect's: a note is escaped where it is made (each name or path passed
through ``visible`` there) and never again; every format shows it as it is, adding
only its own markup quoting (Markdown's backslashes, XML's entities, a workflow
command's ``%``). ``--format json`` carries the note as made. A note whose path
was escaped twice showed ``w\\\\\\\\x`` for ``w\\x``; one never escaped showed a
backslash undoubled, as no other line shows it.
"""

from __future__ import annotations

import json
import shutil

import pytest

from gradclip_cli.escaping import visible
from gradclip_cli.format.markdown import escape as md
from tests.cli.test_cli_errors_escaped_once import HOSTILE

FORMATS = ("table", "json", "markdown", "github", "junit")


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # one line per note, whatever the tmp path


def _shown(gradclip, command: str, *args, fmt: str) -> str:
    r = gradclip(command, *args, "--format", fmt, "--no-progress")
    assert r.code in (0, 1), r.err
    return r.out


def _assert_in_every_format(gradclip, command: str, args, note: str,
                            key: str = "notes") -> None:
    """``note`` (escaped once, as made) shows in each format as that format shows text."""
    for fmt in FORMATS:
        out = _shown(gradclip, command, *args, fmt=fmt)
        near = (fmt, note, [line for line in out.splitlines() if note[:12] in line][:4])
        if fmt == "json":
            assert note in json.loads(out)[key], near
        elif fmt == "markdown":
            # Markdown's quoting of the visible text: each piece as ``escape`` shows a name.
            assert f" {note_md(note)}\n" in out, near  # "- note", "note\\: note"
        elif fmt == "github":
            assert any(line.startswith("::notice ") and line.endswith("::" + note)
                       for line in out.splitlines()), near
        elif fmt == "junit":  # XML text: no & < > " in these notes
            assert note in out, near
        else:
            assert note in [line.strip() for line in out.splitlines()], near


def note_md(note: str) -> str:
    """Markdown's quoting of a note made visible already: no escape is added again."""
    return "".join(md(ch) if ch != "\\" else "\\\\" for ch in note)


def _monitor_log(path, steps: int = 40, spike: int = 35):
    import torch

    from gradclip import GradMonitor

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    monitor = GradMonitor(model, path, None)
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1.0 + 0.01 * (step % 3) + (50.0 if step == spike else 0))
        monitor.step()
    monitor.close()


def test_trend_notes_on_a_tracker_folder(gradclip, tmp_path):
    """A TensorBoard run in a folder whose name needs escapes: the judged series' note
    names its event file and its run (the folder) once escaped."""
    from tests import tracker_runs as tr

    tr.needs("tensorboard")
    folder = tmp_path / HOSTILE
    events = tr.write_torch_tensorboard(folder)
    note = (f"judged: {visible(events)} (TensorBoard tag '{tr.TAG}' of run {visible(folder)}, "
            "stored as float32, 40 points, steps 0-39, total only)")
    _assert_in_every_format(gradclip, "trend", [folder], note)
    chosen = f"{visible(events)}: tag '{tr.TAG}' found by name (a framework's total)"
    _assert_in_every_format(gradclip, "trend", [folder], chosen)


def test_trend_note_on_a_copied_log(gradclip, tmp_path):
    """Two copies of one norm log: the note on the copy names both once escaped."""
    log = tmp_path / HOSTILE / "grads.jsonl"
    log.parent.mkdir()
    _monitor_log(log)
    copy = log.with_name(f"{HOSTILE}.jsonl")
    shutil.copy(log, copy)
    note = (f"{visible(log)}: the same 40 steps (0-39) and norms as {visible(copy)}: "
            "one point each")
    _assert_in_every_format(gradclip, "trend", [copy, log], note)


def test_autopsy_notes(gradclip, tmp_path):
    """The autopsy of a norm log and its copy: its notes, and the header naming the
    finest series, escaped once."""
    log = tmp_path / HOSTILE / "grads.jsonl"
    log.parent.mkdir()
    _monitor_log(log)
    copy = log.with_name("copy.jsonl")
    shutil.copy(log, copy)
    note = (f"{visible(copy)}: the same 40 steps (0-39) and norms as {visible(log)}: "
            "one point each")
    _assert_in_every_format(gradclip, "autopsy", [log, copy], note)
    table = _shown(gradclip, "autopsy", log, copy, fmt="table")
    assert f"step 35 of {visible(copy)} and 1 more (window" in table, table
    doc = json.loads(_shown(gradclip, "autopsy", log, copy, fmt="json"))
    assert doc["finest"] == f"{copy} and 1 more", doc["finest"]


def test_inspect_notes(gradclip, tmp_path):
    """inspect follows the same rule: its --verify note names the file once escaped in
    markdown, github and junit too (they escaped it a second time)."""
    import torch

    from tests.safetensors_files import save_safetensors

    path = tmp_path / f"{HOSTILE}.safetensors"
    save_safetensors(path, {"w": torch.ones(3)})
    note = (f"--verify: {visible(path.name)}: safetensors stores no checksums: only the "
            "header's layout was checked")
    # JSON: among the description's lines (its "notes" is an extra of other reports).
    _assert_in_every_format(gradclip, "inspect", [path, "--verify"], note, "description")


def test_autopsy_verdict_names_the_outliers_inputs_once(gradclip, tmp_path):
    """The outlier counts' inputs in the verdict (a raw line the formats escape) and in
    the JSON (raw paths, as every source there)."""
    from benchmarks import autopsy_rates as A

    run = A.make_run("torch", 0, True, tmp_path / HOSTILE / "run")
    doc = json.loads(_shown(gradclip, "autopsy", run.folder, fmt="json"))
    counted = next(g["outlier_counts"] for g in doc["groups"] if g["outlier_counts"])
    grads = counted["grads_source"]
    assert grads.startswith(str(tmp_path / HOSTILE)), grads  # raw in JSON
    table = _shown(gradclip, "autopsy", run.folder, fmt="table")
    assert f"({visible(grads)}; v_hat from {visible(counted['moment_source'])})" in table, \
        [line for line in table.splitlines() if "v_hat from" in line]


def test_inspect_measured_line(gradclip, tmp_path):
    """The measured line's evidence (a buffer's name) is a description line, escaped where
    made: markdown and junit show it once, as the table and the JSON do."""
    import torch

    buffer = f"{HOSTILE}.running_mean"
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(3), buffer: torch.ones(2)}, path)
    line = (f"measured: model weights, 1 buffers apart (a model's buffers: {visible(buffer)}); "
            "--what auto: no gradients saved")
    doc = json.loads(_shown(gradclip, "inspect", path, fmt="json"))
    assert line in doc["description"], doc["description"]
    assert line in _shown(gradclip, "inspect", path, fmt="table").splitlines()
    assert f"{note_md(line)}\n" in _shown(gradclip, "inspect", path, fmt="markdown")
    assert line in _shown(gradclip, "inspect", path, fmt="junit")
