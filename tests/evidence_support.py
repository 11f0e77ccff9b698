"""What every format says was measured, and the evidence, for one checkpoint (shared by the
layout and framework evidence tests)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from tests.cli.support import logical_lines


def markdown_text(text: str) -> str:
    """Markdown's escapes undone: the words a reader of the rendered page sees."""
    for ch in "\\`*_{}[]()#+-.!|:<>~&":
        text = text.replace(f"\\{ch}", ch)
    return text


def assert_evidence_everywhere(gradclip, path, what: str, measured: str, evidence: str):
    """``inspect PATH --what WHAT`` says ``measured`` with ``evidence`` in JSON, the table,
    Markdown and JUnit (the same words in each)."""
    doc = gradclip("inspect", path, "--what", what, "--format", "json").json()
    assert doc["what"] == measured
    assert doc["measured"]["evidence"] == evidence
    line = f"measured: {doc['measured']['explain']} ({evidence})"
    if what == "auto" and measured != "grads":  # auto says why it chose other than gradients
        assert doc["measured"]["chosen"] == "--what auto: no gradients saved"
        line += "; --what auto: no gradients saved"
    table = gradclip("inspect", path, "--what", what)
    assert table.code == 0
    assert line in logical_lines(table.out), table.out
    markdown = gradclip("inspect", path, "--what", what, "--format", "markdown").out
    assert line in [markdown_text(p) for p in markdown.split("\n")]
    junit = ET.fromstring(gradclip("inspect", path, "--what", what, "--format", "junit").out)
    assert line in junit.find("testsuite").find("system-out").text.split("\n")
