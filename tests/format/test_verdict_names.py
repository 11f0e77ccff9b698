"""A name in a verdict shows as it shows in the rows: escaped once.

Verdicts are built of ``visible()`` pieces; the formats that escape text for
their consumers (Markdown, JUnit, GitHub's notice) keep those pieces as they
are (``kept_visible``) instead of passing them through ``visible()`` again,
which doubled every backslash of an escaped name. Each document is read back
as its consumer reads it.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import torch
from markdown_it import MarkdownIt

from gradclip_cli import GradMonitor
from gradclip_cli.escaping import kept_visible, visible
from tests.cli.conftest import gradclip  # noqa: F401 (fixture)
from tests.format.test_ci_formats import parse_workflow_command

NAME = "a\\b\nc\x1b[31m"  # a backslash, a newline and an escape sequence
SHOWN = visible(NAME)  # 'a\\\\b\\nc\\x1b[31m': what the rows show


def _spiking_log(path):
    """A monitor log whose newest step spikes in the group named ``NAME``."""
    model = torch.nn.Module()
    model.register_parameter(NAME, torch.nn.Parameter(torch.zeros(4)))
    model.register_parameter("other", torch.nn.Parameter(torch.zeros(4)))
    monitor = GradMonitor(model, path, None, group_by="tensor")
    for step in range(12):
        for p in model.parameters():
            p.grad = torch.full((4,), 1.0 + 0.01 * step)
        if step == 11:
            model.get_parameter(NAME).grad = torch.full((4,), 1000.0)
        monitor.step()
    monitor.close()
    return path


def test_kept_visible_escapes_what_is_not_shown_and_keeps_escapes_single():
    assert kept_visible(SHOWN) == SHOWN
    assert kept_visible("x\ny\\z") == "x\\ny\\z"
    assert kept_visible("plain") == "plain"


def test_markdown_verdict_shows_the_group_as_its_row_does(gradclip, tmp_path):  # noqa: F811
    result = gradclip("trend", _spiking_log(tmp_path / "g.jsonl"), "--format", "markdown")
    assert result.code == 1
    html = MarkdownIt().enable("table").render(result.out)
    verdict = html[html.index("<strong>"):html.index("</strong>")]
    assert f"groups {SHOWN})" in verdict
    row = html[html.index("<tbody>"):]
    assert f"<td>{SHOWN}</td>" in row


def test_junit_summary_names_the_group_as_its_testcase_does(gradclip, tmp_path):  # noqa: F811
    result = gradclip("trend", _spiking_log(tmp_path / "g.jsonl"), "--format", "junit")
    assert result.code == 1
    suite = ET.fromstring(result.out).find("testsuite")
    assert SHOWN in {case.get("name") for case in suite.iter("testcase")}
    summary = suite.find("system-out").text.splitlines()[0]
    assert f"groups {SHOWN})" in summary


def test_github_clip_notice_names_the_files_escaped_once(gradclip, tmp_path):  # noqa: F811
    path = tmp_path / "we\\ird\x1b.pt"
    torch.save({"grads": {"w": torch.ones(3)}}, path)
    out = tmp_path / "out\\put.pt"
    result = gradclip("clip", path, "--max-norm", "10", "-o", out, "--format", "github")
    assert result.code == 0
    (line,) = result.out.splitlines()
    _, _, data = parse_workflow_command(line)
    assert data.startswith(f"{visible(str(path))} -> {visible(str(out))}: ")
