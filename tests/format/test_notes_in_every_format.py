"""What a report corrects or explains reaches every format (issue 41: Trust IV, item 9).

Two notes of ``inspect`` must not stay in the table and the JSON alone:

* a checkpoint that records one step inside a folder whose name says another
  (a Megatron rank file of iteration 1 copied into ``iter_0000003/``): the
  recorded step wins (``source/vocabulary.py``) and the note names both;
* optimizer state measured under its ids (``state.N``): why the names are
  missing.

Each format's document is read back as its consumer reads it: JSON parsed,
Markdown rendered to text by a CommonMark parser, GitHub workflow commands
parsed as the runner parses them, JUnit XML parsed.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch
from markdown_it import MarkdownIt

from tests.cli.conftest import gradclip  # noqa: F401 (fixture)
from tests.cli.support import logical_lines
from tests.format.test_ci_formats import parse_workflow_command


@pytest.fixture
def misplaced(tmp_path):
    """Iteration 1's file in ``iter_0000003/``: the step it records and its folder disagree."""
    folder = tmp_path / "iter_0000003"
    folder.mkdir()
    path = folder / "model_optim_rng.pt"
    torch.save({"iteration": 1, "grads": {"layer.0.w": torch.ones(4), "layer.1.w": torch.ones(2)}},
               path)
    return path


@pytest.fixture
def bare_optimizer(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    path = tmp_path / "optimizer.bin"
    torch.save(opt.state_dict(), path)
    return path


def markdown_text(document: str) -> str:
    """The text a reader of the rendered Markdown sees (inline content, unescaped)."""
    tokens = MarkdownIt().parse(document)
    return "\n".join(child.content for t in tokens if t.type == "inline"
                     for child in (t.children or []) if child.type == "text")


def seen_by_each_format(gradclip, path) -> dict[str, str]:  # noqa: F811
    seen = {}
    for fmt in ("table", "json", "markdown", "github", "junit"):
        r = gradclip("inspect", path, "--format", fmt)
        assert r.code == 0, r.err
        if fmt == "table":
            seen[fmt] = "\n".join(logical_lines(r.out))
        elif fmt == "json":
            seen[fmt] = "\n".join(r.json()["description"])
        elif fmt == "markdown":
            seen[fmt] = markdown_text(r.out)
        elif fmt == "github":
            seen[fmt] = "\n".join(parse_workflow_command(line)[2] for line in r.out.splitlines())
        else:
            seen[fmt] = "\n".join(e.text or "" for e in ET.fromstring(r.out).iter("system-out"))
    return seen


def test_the_recorded_step_and_the_folder_both_named_in_every_format(
        gradclip, misplaced):  # noqa: F811
    note = "step 1, as the checkpoint records it; its name iter_0000003 says 3"
    for fmt, text in seen_by_each_format(gradclip, misplaced).items():
        assert note in text, (fmt, text)
    assert gradclip("inspect", misplaced, "--format", "json").json()["step"] == 1


def test_state_under_ids_says_why_in_every_format(gradclip, bare_optimizer):  # noqa: F811
    why = ("optimizer state named by parameter id (state.N): no model weights beside the "
           "optimizer state to take the names from")
    for fmt, text in seen_by_each_format(gradclip, bare_optimizer).items():
        assert why in " ".join(text.split()), (fmt, text)


def test_a_checkpoint_whose_name_agrees_carries_no_note(gradclip, tmp_path):  # noqa: F811
    folder = tmp_path / "iter_0000003"
    folder.mkdir()
    torch.save({"iteration": 3, "grads": {"w": torch.ones(2)}}, folder / "model_optim_rng.pt")
    for fmt, text in seen_by_each_format(gradclip, folder / "model_optim_rng.pt").items():
        assert "as the checkpoint records it" not in text, fmt
