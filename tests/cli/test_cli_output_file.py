"""``--output-file`` is never a file the command reads or writes (docs/reference/contract.md).

Each case names, as the report file, something the command reads or writes:
the input itself, a symbolic or hard link to it, a file inside an input
folder, clip's ``-o`` output, the index of a set being clipped, a shard a clip
of a set would write. Every command refuses with exit 2 and one line, before
any work, and nothing on disk changes: every file keeps its bytes, no file is
created. With ``--format json`` the error document goes to stdout, never into
the file named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from .support import gpt_like_grads, sha256


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links as links) and its bytes' hash."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            found[str(path.relative_to(root))] = (
                f"-> {os.readlink(path)}" if path.is_symlink() else sha256(path)
            )
    return found


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """g.pt and h.pt (gradients), a sharded set set/ (a real save_torch_state_dict),
    a run folder run/ of two checkpoints; cwd is the folder."""
    from huggingface_hub import save_torch_state_dict

    monkeypatch.chdir(tmp_path)
    torch.save({"grads": gpt_like_grads(0)}, tmp_path / "g.pt")
    torch.save({"grads": gpt_like_grads(1)}, tmp_path / "h.pt")
    g = torch.Generator().manual_seed(2)
    state = {f"layer.{i}.weight": torch.randn(20, 20, generator=g) for i in range(4)}
    (tmp_path / "set").mkdir()
    save_torch_state_dict(state, tmp_path / "set", max_shard_size=4000)
    (tmp_path / "run").mkdir()
    for step in (1, 2):
        torch.save({"grads": gpt_like_grads(step), "step": step},
                   tmp_path / "run" / f"ckpt-{step}.pt")
    os.symlink("g.pt", tmp_path / "g-link.json")
    os.link(tmp_path / "g.pt", tmp_path / "g-hard.json")
    os.link(tmp_path / "run" / "ckpt-2.pt", tmp_path / "ckpt-2-hard.json")
    return tmp_path


INDEX = "set/model.safetensors.index.json"
SHARD = "model-00001-of-00002.safetensors"

CASES = [
    (["inspect", "g.pt"], "g.pt", "is the input g.pt"),
    (["inspect", "g.pt"], "g-link.json", "is the input g.pt"),
    (["inspect", "g.pt"], "g-hard.json", "is the input g.pt"),
    (["inspect", "set"], INDEX, "is inside the input set"),
    (["inspect", "set"], "set/new-report.json", "is inside the input set"),
    (["inspect", INDEX], f"set/{SHARD}", f"is the input set/{SHARD}"),
    (["compare", "g.pt", "h.pt"], "h.pt", "is the input h.pt"),
    (["compare", "g.pt", "h.pt"], "g-hard.json", "is the input g.pt"),
    (["trend", "run"], "run/ckpt-2.pt", "is inside the input run"),
    (["trend", "run"], "ckpt-2-hard.json", "is a link to a file inside the input run"),
    (["trend", "run/ckpt-1.pt", "run/ckpt-2.pt"], "ckpt-2-hard.json",
     "is the input run/ckpt-2.pt"),
    (["clip", "g.pt", "--max-norm", "1", "-o", "out.pt"], "g.pt", "is the input g.pt"),
    (["clip", "g.pt", "--max-norm", "1", "-o", "out.pt"], "out.pt", "is the output out.pt"),
    (["clip", "g.pt", "--max-norm", "1"], "g.clipped.pt", "is the output g.clipped.pt"),
    (["clip", "set", "--max-norm", "1"], INDEX, "is inside the input set"),
    (["clip", "set", "--max-norm", "1", "-o", "clipped"], f"clipped/{SHARD}",
     "is inside the output clipped"),
    (["clip", "set", "--max-norm", "1"], f"set.clipped/{SHARD}",
     "is inside the output set.clipped"),
]  # fmt: skip


@pytest.mark.parametrize("format", ["table", "json"])
@pytest.mark.parametrize("args, report, words", CASES)
def test_the_report_never_replaces_what_the_command_reads_or_writes(
        gradclip, work, args, report, words, format):
    before = _snapshot(work)
    r = gradclip(*args, "--output-file", report, "--format", format)
    assert r.code == 2, (r.code, r.err)
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1, r.err
    assert lines[0].startswith(f"gradclip: --output-file {report}: "), lines[0]
    assert words in lines[0] and "nothing was written" in lines[0], lines[0]
    assert _snapshot(work) == before  # no file changed, none created, none removed
    if format == "json":
        doc = json.loads(r.out)
        assert doc["schema"] == "gradclip.error/1" and doc["exit_code"] == 2
        assert doc["error"] == lines[0].removeprefix("gradclip: ")
    else:
        assert r.out == ""


def test_an_error_before_the_check_is_not_written_over_the_input(gradclip, work):
    """A bad option given with --output-file naming the input: option values are checked
    while parsing, before --output-file is, and the JSON error document then goes to
    stdout: it never lands in the input."""
    digest = sha256(work / "g.pt")
    r = gradclip("inspect", "g.pt", "--norm-type", "x", "--output-file", "g.pt",
                 "--format", "json")
    assert r.code == 2 and "--norm-type" in r.err
    assert json.loads(r.out)["schema"] == "gradclip.error/1"
    assert sha256(work / "g.pt") == digest


@pytest.mark.parametrize("args", [
    ["inspect", "g.pt"], ["compare", "g.pt", "h.pt"], ["trend", "run"],
    ["clip", "g.pt", "--max-norm", "1", "-o", "out.pt"],
])  # fmt: skip
def test_a_report_file_elsewhere_is_written(gradclip, work, args):
    (work / "reports").mkdir()
    r = gradclip(*args, "--output-file", "reports/r.json", "--format", "json")
    assert r.code in (0, 1), r.err
    assert r.out == ""
    assert json.loads((work / "reports" / "r.json").read_text())["schema"].startswith(
        "gradclip.")


@pytest.mark.parametrize("args", [
    ["clip", "g.pt", "--max-norm", "1", "-o", "out.pt"],
    ["clip", "g.pt", "--max-norm", "1", "--in-place"],
    ["clip", "set", "--max-norm", "1"],
    ["inspect", "g.pt"], ["compare", "g.pt", "h.pt"], ["trend", "run"],
])  # fmt: skip
def test_a_report_file_in_a_missing_folder_is_refused_before_any_work(gradclip, work, args):
    """The report cannot be written: exit 3 before anything else is, so clip neither
    writes its copy nor replaces its input (--in-place) and then fails."""
    before = _snapshot(work)
    r = gradclip(*args, "--output-file", "no-such-folder/r.json", "--format", "json")
    assert r.code == 3, (r.code, r.err)
    (line,) = [line for line in r.err.splitlines() if line.strip()]
    assert line.startswith("gradclip: no-such-folder/r.json: cannot write: ") \
        and "does not exist" in line, line
    assert json.loads(r.out)["exit_code"] == 3  # the error document, on stdout
    assert _snapshot(work) == before
