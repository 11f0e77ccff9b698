"""The CI formats with hostile names, each read back with its consumer's own rules.

Names come from files: a tensor named to forge an annotation, close a table
cell, open a link or raw HTML, or break XML must come out as inert text that
reads back as ``visible(name)``. Every command goes through every CI format.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import pytest
import torch
from markdown_it import MarkdownIt

from gradclip_cli.format.github import escape_data, escape_property
from gradclip_cli.format.text import visible
from tests.cli.conftest import gradclip  # noqa: F401 (fixture)

HOSTILE = [
    "h.0\n::error file=x::forged",
    "a|b|c",
    "<script>alert(1)</script>",
    "[x](https://evil.example) ![i](x.png)",
    "*bold* _it_ `code` ~~s~~",
    "&amp; &#x41; &lt;",
    "100%0A%25 k:v,w=1",
    "nul\x00esc\x1b[31m",
    "bidi\u202eevil\ufffe",
    "cr\r\nlf\\back",
    "# heading",
]


def checkpoint(path, names, spike=None, scale=1.0, nan=None):
    g = torch.Generator().manual_seed(len(str(path)))
    grads = {n: torch.randn(8, generator=g) * (scale if n == spike else 1.0) for n in names}
    if nan is not None:
        grads[nan][0] = math.nan
    torch.save({"grads": grads}, path)
    return path


@pytest.fixture
def run_of_hostile(tmp_path):
    """Eight steps; the newest scales one hostile tensor 1000x."""
    folder = tmp_path / "run"
    folder.mkdir()
    for step in range(8):
        spike = HOSTILE[2] if step == 7 else None
        checkpoint(folder / f"s{step}.pt", HOSTILE, spike=spike, scale=1000.0)
    return folder


def commands(tmp_path, run_of_hostile):
    """Every command, each producing findings that name hostile groups."""
    ckpt = checkpoint(tmp_path / "nan.pt", HOSTILE, nan=HOSTILE[0])
    return {
        "inspect": ["inspect", ckpt, "--group-by", "tensor"],
        "clip": ["clip", checkpoint(tmp_path / "c.pt", HOSTILE), "--max-norm", "1",
                 "-o", tmp_path / "out.pt"],
        "trend": ["trend", run_of_hostile, "--group-by", "tensor"],
        "compare": ["compare", run_of_hostile / "s6.pt", run_of_hostile / "s7.pt",
                    "--group-by", "tensor", "--fail-above", "10"],
    }


# -- GitHub workflow commands ---------------------------------------------------


def unescape_data(s: str) -> str:
    return s.replace("%0D", "\r").replace("%0A", "\n").replace("%25", "%")


def unescape_property(s: str) -> str:
    return (s.replace("%0D", "\r").replace("%0A", "\n").replace("%3A", ":")
            .replace("%2C", ",").replace("%25", "%"))


def parse_workflow_command(line: str):
    """The runner's parser (ActionCommand.TryParseV2): ``::name props::data``."""
    assert line.startswith("::"), line
    end = line.index("::", 2)
    head, data = line[2:end], line[end + 2:]
    name, _, props = head.partition(" ")
    properties = {}
    for pair in filter(None, props.split(",")):
        key, _, value = pair.partition("=")
        properties[key] = unescape_property(value)
    return name, properties, unescape_data(data)


def test_github_escaping_round_trips_every_character():
    text = "".join(map(chr, range(0, 0x250))) + "%0A%25::,:"
    assert unescape_data(escape_data(text)) == text
    assert unescape_property(escape_property(text)) == text
    assert not set("\r\n") & set(escape_data(text))
    assert not set(":,\r\n") & set(escape_property(text))


@pytest.mark.parametrize("command", ["inspect", "clip", "trend", "compare"])
def test_github_lines_parse_back_to_the_visible_names(gradclip, tmp_path,  # noqa: F811
                                                      run_of_hostile, command):
    args = commands(tmp_path, run_of_hostile)[command]
    r = gradclip(*args, "--format", "github")
    assert r.code == (0 if command == "clip" else 1), r.err
    lines = r.out.splitlines()
    assert lines and all(line.startswith("::") for line in lines), r.out
    parsed = [parse_workflow_command(line) for line in lines]
    assert {name for name, _, _ in parsed} <= {"error", "warning", "notice"}
    for _, props, data in parsed:
        assert set(props) == {"file", "title"} and props["file"] != "x"  # nothing forged
        assert "\n" not in data and "\r" not in data
    errors = [data for name, _, data in parsed if name == "error"]
    if command == "inspect":
        assert any(visible(HOSTILE[0]) in d for d in errors)
    if command in ("trend", "compare"):
        assert any(visible(HOSTILE[2]) in d for d in errors), errors
    if command == "clip":
        assert [name for name, _, _ in parsed] == ["notice"]


# -- JUnit XML ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "clip", "trend", "compare"])
def test_junit_parses_with_one_testcase_per_group(gradclip, tmp_path, run_of_hostile,  # noqa: F811
                                                  command):
    args = commands(tmp_path, run_of_hostile)[command]
    r = gradclip(*args, "--format", "junit")
    assert r.code == (0 if command == "clip" else 1), r.err
    root = ET.fromstring(r.out.encode("utf-8"))
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    names = [c.get("name") for c in cases]
    assert int(suite.get("tests")) == len(cases) == int(root.get("tests"))
    failed = [c for c in cases if c.find("failure") is not None]
    assert int(suite.get("failures")) == len(failed)
    if command == "clip":
        assert names == ["(total)"] and not failed
        return
    assert set(names) == {"(total)", *map(visible, HOSTILE)}
    failing = {c.get("name") for c in failed}
    expected = visible(HOSTILE[0]) if command == "inspect" else visible(HOSTILE[2])
    assert expected in failing
    for c in failed:
        for f in c.findall("failure"):
            assert f.get("message") and f.text


def test_junit_strips_what_xml_cannot_hold():
    from gradclip_cli.format.junit import xml_text

    raw = "".join(map(chr, range(0, 0x30))) + "\ud800\ufffe\uffff\U0001f600"
    text = xml_text(raw)
    assert not re.search("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]", text)
    element = ET.Element("testcase", name=text)
    element.text = text
    back = ET.fromstring(ET.tostring(element, encoding="unicode").encode("utf-8"))
    assert back.get("name") == back.text == text


# -- Markdown -------------------------------------------------------------------

MARKUP_TOKENS = {"link_open", "image", "html_inline", "html_block", "code_inline", "em_open",
                 "s_open", "heading_open", "fence", "code_block", "autolink_open"}


def cells(markdown: str) -> list[list[str]]:
    """Every table row's cells as plain text, read by a CommonMark + GFM-tables parser."""
    md = MarkdownIt("commonmark").enable("table").enable("strikethrough")
    tokens = md.parse(markdown)
    rows, row = [], None
    for tok in tokens:
        if tok.type == "tr_open":
            row = []
        elif tok.type == "tr_close":
            rows.append(row)
            row = None
        elif tok.type == "inline" and row is not None:
            row.append("".join(c.content for c in tok.children if c.type == "text"))
    return rows


def markup_in(markdown: str) -> set[str]:
    md = MarkdownIt("commonmark").enable("table").enable("strikethrough")
    found = set()
    for tok in md.parse(markdown):
        found.add(tok.type)
        for child in tok.children or []:
            found.add(child.type)
    return found & MARKUP_TOKENS


@pytest.mark.parametrize("command", ["inspect", "clip", "trend", "compare"])
def test_markdown_cells_read_back_as_the_visible_names(gradclip, tmp_path, run_of_hostile,  # noqa: F811
                                                       command):
    args = commands(tmp_path, run_of_hostile)[command]
    r = gradclip(*args, "--format", "markdown")
    assert r.code == (0 if command == "clip" else 1), r.err
    assert markup_in(r.out) == {"heading_open"}  # the report's own ### title, nothing else
    rows = cells(r.out)
    if command == "clip":
        return
    texts = {c for row in rows for c in row}
    if command == "trend":
        spiking = [row for row in rows if row and row[0] == "7"]
        assert spiking and spiking[0][-1] == visible(HOSTILE[2]), spiking
    else:
        assert set(map(visible, HOSTILE)) <= texts, set(map(visible, HOSTILE)) - texts
