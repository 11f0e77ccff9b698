"""Paths as a user gives them: long names, hard links, and the spelling in reports.

- a valid name near the 255-byte limit is written under exactly that name
  (only the temporary name is shortened);
- ``--in-place`` on a file with several hard links replaces one name, and the
  report says the other names keep the old bytes;
- ``"source"`` and ``"output"`` are the paths as given (``./h.pt`` stays).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from tests.cli.support import unwrapped

from .support import run_cli


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "h.pt"
    torch.save({"grads": {"w": torch.full((4, 4), 0.5), "b": torch.ones(3)}, "step": 1}, path)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _grads(path: Path) -> dict:
    return torch.load(path, weights_only=True)["grads"]


@pytest.mark.parametrize(
    "name",
    ["a" * 245 + ".pt", "é" * 122 + ".pt", "a" * 252 + ".pt", "b" * 255],
    ids=["248-ascii", "247-utf8", "255-ascii", "255-no-suffix"],
)
def test_long_output_name_is_written_under_exactly_that_name(tmp_path, ckpt, name):
    assert len(os.fsencode(name)) <= 255
    result = run_cli("clip", ckpt, "--max-norm", "1", "-o", tmp_path / name, "--no-progress",
                     "--format", "json")
    assert result.code == 0, result.err
    assert sorted(os.listdir(tmp_path)) == sorted(["h.pt", name])  # no temporary file left
    assert json.loads(result.out)["output"] == str(tmp_path / name)
    total = torch.linalg.vector_norm(
        torch.cat([g.double().flatten() for g in _grads(tmp_path / name).values()])
    )
    assert abs(float(total) - 1.0) < 1e-5


def test_long_report_file_name(tmp_path, ckpt):
    name = "r" * 250 + ".json"
    result = run_cli("inspect", ckpt, "--no-progress", "--format", "json",
                     "--output-file", tmp_path / name)
    assert result.code == 0, result.err
    assert json.loads((tmp_path / name).read_text())["schema"] == "gradclip.inspect/1"


def test_a_name_past_the_limit_is_one_line_exit_3(tmp_path, ckpt):
    name = "a" * 256 + ".pt"
    result = run_cli("clip", ckpt, "--max-norm", "1", "-o", tmp_path / name, "--no-progress")
    assert result.code == 3
    assert len(result.err_lines) == 1 and "too long" in result.err_lines[0].lower()
    assert os.listdir(tmp_path) == ["h.pt"]


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_in_place_on_a_hard_linked_file_says_the_other_names_keep_the_old_bytes(
    tmp_path, ckpt, fmt
):
    others = [tmp_path / "link1.pt", tmp_path / "link2.pt"]
    for other in others:
        os.link(ckpt, other)
    old = _sha(ckpt)
    result = run_cli("clip", ckpt, "--max-norm", "0.5", "--in-place", "--no-progress",
                     "--format", fmt)
    assert result.code == 0, result.err
    # The atomic replace: the given name holds the clipped file, the others the old one.
    assert _sha(ckpt) != old and os.stat(ckpt).st_nlink == 1
    for other in others:
        assert _sha(other) == old and os.stat(other).st_nlink == 2
    if fmt == "json":
        assert json.loads(result.out)["other_links_unchanged"] == 2
    else:
        # the note as written, wherever the path's length makes it wrap
        note = unwrapped(result.out)
        assert f"note: {ckpt} had 2 other hard links, which still hold the old bytes" in note


def test_a_single_link_says_nothing(tmp_path, ckpt):
    result = run_cli("clip", ckpt, "--max-norm", "0.5", "--in-place", "--no-progress",
                     "--format", "json")
    assert json.loads(result.out)["other_links_unchanged"] == 0
    table = run_cli("clip", ckpt, "--max-norm", "0.5", "--in-place", "--no-progress")
    assert "hard link" not in table.out


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_paths_are_reported_as_given(tmp_path, ckpt, monkeypatch, fmt):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()

    def report(*args):
        result = run_cli(*args, "--no-progress", "--format", fmt)
        assert result.code == 0, result.err
        return json.loads(result.out) if fmt == "json" else result.out

    inspected = report("inspect", "./h.pt")
    clipped = report("clip", "./h.pt", "--max-norm", "1", "-o", "./sub/../o.pt")
    default = report("clip", "./h.pt", "--max-norm", "1")
    in_place = report("clip", ".//h.pt", "--max-norm", "1", "--in-place")
    if fmt == "json":
        assert inspected["source"] == "./h.pt"
        assert (clipped["source"], clipped["output"]) == ("./h.pt", "./sub/../o.pt")
        assert default["output"] == "./h.clipped.pt"
        assert (in_place["source"], in_place["output"]) == (".//h.pt", ".//h.pt")
    else:
        assert "./h.pt" in inspected
        assert "./h.pt -> ./sub/../o.pt" in clipped
        assert "./h.pt -> ./h.clipped.pt" in default
    assert (tmp_path / "o.pt").exists() and (tmp_path / "h.clipped.pt").exists()


def test_error_document_source_is_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli("inspect", "./missing.pt", "--no-progress", "--format", "json")
    assert result.code == 3
    assert json.loads(result.out)["source"] == "./missing.pt"
