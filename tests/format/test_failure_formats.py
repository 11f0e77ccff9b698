"""A run that cannot report (exit 2 or 3) still carries its failure in every CI format.

Each document is read back with its consumer's rules (ElementTree, the
Actions runner's command parser, a CommonMark parser) and must say what the
one line on stderr says, with a hostile path kept as inert data.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch
from markdown_it import MarkdownIt

from gradclip_cli.format.text import visible
from tests.cli.conftest import gradclip  # noqa: F401 (fixture)
from tests.cli.support import SAMPLES
from tests.schemas import validate

from .test_ci_formats import markup_in, parse_workflow_command

HOSTILE_NAME = "a|b <x> *y* [l](https://e.example) %0A::error::forged.pt"


def stderr_message(result) -> str:
    (line,) = result.err_lines
    assert line.startswith("gradclip: ")
    return line.removeprefix("gradclip: ")


def failures(tmp_path):
    """Each command failing: unreadable input (3) and a bad flag value (2)."""
    good = tmp_path / "good.pt"
    torch.save({"grads": {"w": torch.ones(3)}}, good)
    missing = tmp_path / HOSTILE_NAME
    return {
        "inspect-3": (3, ["inspect", missing]),
        "clip-3": (3, ["clip", missing, "--max-norm", "1", "-o", tmp_path / "o.pt"]),
        "trend-3": (3, ["trend", missing]),
        "compare-3": (3, ["compare", good, missing]),
        "inspect-2": (2, ["inspect", good, "--norm-type", "abc"]),
        "trend-2": (2, ["trend", good, "--z", "nan"]),
        "compare-2": (2, ["compare", good, good, "--fail-above", "0.5"]),
    }


CASES = ["inspect-3", "clip-3", "trend-3", "compare-3", "inspect-2", "trend-2", "compare-2"]


def check_junit(text: str, message: str, code: int) -> None:
    root = ET.fromstring(text.encode("utf-8"))
    assert root.tag == "testsuites" and root.get("errors") == "1"
    assert root.get("failures") == "0"
    (suite,) = root.findall("testsuite")
    (case,) = suite.findall("testcase")
    assert suite.get("errors") == "1" and suite.get("tests") == "1"
    (error,) = case.findall("error")
    assert error.text == message
    assert f"(exit {code})" in error.get("message")


def check_github(text: str, message: str, code: int, source: str | None) -> None:
    """``source``: the one input the annotation names; None where there are two (compare)."""
    (line,) = text.splitlines()
    name, props, data = parse_workflow_command(line)
    assert name == "error" and data == message
    assert props["title"].startswith("gradclip: ") and f"(exit {code})" in props["title"]
    assert set(props) <= {"file", "title"}
    assert props.get("file") == (None if source is None else visible(source))


def check_markdown(text: str, message: str, code: int) -> None:
    assert markup_in(text) == {"heading_open"}  # the heading, then plain (bold) text
    md = MarkdownIt("commonmark")
    tokens = md.parse(text)
    inline = [t for t in tokens if t.type == "inline"]
    shown = "".join(c.content for c in inline[-1].children if c.type == "text")
    assert shown.startswith("❌ FAIL: ") and shown.endswith(f"{message} (exit {code})")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", ["json", "junit", "github", "markdown"])
def test_every_format_carries_the_failure(gradclip, tmp_path, fmt, case):  # noqa: F811
    code, args = failures(tmp_path)[case]
    r = gradclip(*args, "--format", fmt)
    assert r.code == code, (r.out, r.err)
    message = stderr_message(r)
    source = str(args[1]) if case.startswith(("inspect", "clip", "trend")) else None
    if fmt == "json":
        doc = r.json()
        validate(doc, "error-1")
        assert doc["error"] == message and doc["exit_code"] == code
    elif fmt == "junit":
        check_junit(r.out, message, code)
    elif fmt == "github":
        check_github(r.out, message, code, source)
    else:
        check_markdown(r.out, message, code)


@pytest.mark.parametrize("command", ["inspect", "trend"])
@pytest.mark.parametrize("fmt", ["json", "junit", "github", "markdown"])
def test_a_name_that_needs_escapes_is_escaped_once_in_every_format(
        gradclip, tmp_path, fmt, command):  # noqa: F811
    """A backslash and a control character in the name: stderr shows it ``visible`` once;
    junit's ``<error>`` and github's ``::error`` showed the stderr line escaped again
    (``a\\\\b``: a backslash the name does not hold), unlike their own ``file``."""
    missing = tmp_path / "back\\slash\ttab.pt"
    r = gradclip(command, missing, "--format", fmt)
    assert r.code == 3, r.err
    message = stderr_message(r)
    assert message.startswith(f"{visible(missing)}: "), message
    if fmt == "json":
        assert r.json()["error"] == message
    elif fmt == "junit":
        check_junit(r.out, message, 3)
    elif fmt == "github":
        check_github(r.out, message, 3, str(missing))
    else:
        check_markdown(r.out, message, 3)


@pytest.mark.parametrize("fmt", ["json", "junit", "github", "markdown"])
def test_the_failure_goes_to_the_output_file(gradclip, tmp_path, fmt):  # noqa: F811
    report = tmp_path / "report.out"
    r = gradclip("inspect", tmp_path / "missing.pt", "--format", fmt, "--output-file", report)
    assert r.code == 3 and r.out == ""
    message = stderr_message(r)
    text = report.read_text(encoding="utf-8")
    if fmt == "json":
        assert json.loads(text)["error"] == message
    elif fmt == "junit":
        check_junit(text, message, 3)
    elif fmt == "github":
        check_github(text, message, 3, str(tmp_path / "missing.pt"))
    else:
        check_markdown(text, message, 3)


def test_a_table_carries_the_failure_on_stderr_alone(gradclip, tmp_path):  # noqa: F811
    r = gradclip("inspect", tmp_path / "missing.pt")
    assert r.code == 3 and r.out == "" and len(r.err_lines) == 1


def test_an_unknown_format_is_a_usage_error_with_no_document(gradclip, tmp_path):  # noqa: F811
    r = gradclip("inspect", tmp_path / "missing.pt", "--format", "xml")
    assert r.code == 2 and r.out == "" and "--format" in stderr_message(r)


@pytest.mark.parametrize("fmt", ["json", "junit", "github", "markdown"])
@pytest.mark.parametrize("target", ["itself", "hard link", "inside"])
def test_a_failure_never_lands_on_the_input(gradclip, tmp_path, fmt, target):  # noqa: F811
    """A run can fail because --output-file names its input: the failure must not then
    do what the check prevents. The document goes to stdout; the input keeps its bytes."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    damaged = folder / "g.pt"
    damaged.write_bytes(b"PK\x03\x04 truncated")
    before = damaged.read_bytes()
    path, report = damaged, damaged
    if target == "hard link":
        report = tmp_path / "link.pt"
        report.hardlink_to(damaged)
    elif target == "inside":
        path, report = folder, folder / "report.out"
    r = gradclip("inspect", path, "--format", fmt, "--output-file", report)
    assert r.code in (2, 3), r.err
    assert damaged.read_bytes() == before
    assert not (folder / "report.out").exists()
    assert r.out  # the failure, on stdout instead
    if fmt == "json":
        assert r.json()["exit_code"] == r.code


# Usage errors found while the command line is parsed: a bad value, an unknown
# option, a missing PATH.
PARSE_ERRORS = {
    "bad value": ["inspect", "{good}", "--norm-type", "abc"],
    "unknown option": ["inspect", "{good}", "--no-such-flag"],
    "missing PATH": ["clip", "--max-norm", "1"],
    "bad value, two inputs": ["compare", "{good}", "{good}", "--fail-above", "0.5"],
}


@pytest.mark.parametrize("case", list(PARSE_ERRORS))
@pytest.mark.parametrize("fmt", ["json", "junit", "github", "markdown"])
def test_a_usage_error_goes_to_the_output_file(gradclip, tmp_path, fmt, case):  # noqa: F811
    """As a failure found later does: CI that reads the report file learns why."""
    good = tmp_path / "good.pt"
    torch.save({"grads": {"w": torch.ones(3)}}, good)
    report = tmp_path / "report.out"
    args = [a.format(good=good) for a in PARSE_ERRORS[case]]
    r = gradclip(*args, "--format", fmt, "--output-file", report)
    assert r.code == 2 and r.out == "", (r.out, r.err)
    message = stderr_message(r)
    text = report.read_text(encoding="utf-8")
    if fmt == "json":
        doc = json.loads(text)
        validate(doc, "error-1")
        assert doc["error"] == message and doc["exit_code"] == 2
    elif fmt == "junit":
        check_junit(text, message, 2)
    elif fmt == "github":
        assert parse_workflow_command(text.rstrip("\n"))[2] == message
    else:
        check_markdown(text, message, 2)


@pytest.mark.parametrize("report", ["g.pt", "g.clipped.pt", "out.pt"])
def test_a_usage_error_never_lands_on_a_named_path(gradclip, tmp_path, monkeypatch,  # noqa: F811
                                                   report):
    """The command line did not parse, so what it reads and writes is not known: a report
    file that is any path it names (or clip's default output) gets nothing; stdout does."""
    monkeypatch.chdir(tmp_path)
    torch.save({"grads": {"w": torch.ones(3)}}, "g.pt")
    for name in ("g.clipped.pt", "out.pt"):
        (tmp_path / name).write_bytes(b"kept")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    r = gradclip("clip", "g.pt", "-o", "out.pt", "--max-norm", "x", "--format", "json",
                 "--output-file", report)
    assert r.code == 2 and r.json()["exit_code"] == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_usage_error_never_lands_in_a_named_folder(gradclip, tmp_path,  # noqa: F811
                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = gradclip("trend", ".", "--no-such-flag", "--format", "junit", "--output-file", "r.xml")
    assert r.code == 2 and "<error" in r.out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["junit", "github", "markdown"])
def test_a_refused_clip_is_a_finding_in_every_ci_format(gradclip, tmp_path, fmt):  # noqa: F811
    """clip refuses a non-finite total (exit 1, a finding): the report file says so, as
    one ``::error``, a JUnit ``<failure>``, a Markdown failure line; it is never left
    missing (or stale from an earlier run)."""
    path = tmp_path / "nan.pt"
    torch.save({"grads": {"w": torch.tensor([math.nan, 1.0])}}, path)
    report = tmp_path / "report.out"
    report.write_text("an earlier run's report")
    r = gradclip("clip", path, "--max-norm", "1", "-o", tmp_path / "out.pt", "--format", fmt,
                 "--output-file", report)
    assert r.code == 1 and r.out == "", (r.out, r.err)
    assert not (tmp_path / "out.pt").exists()
    reason = stderr_message(r)
    assert "refusing to clip" in reason
    text = report.read_text(encoding="utf-8")
    if fmt == "junit":
        root = ET.fromstring(text.encode("utf-8"))
        assert root.get("failures") == "1"
        (failure,) = root.iter("failure")
        assert failure.text == reason
    elif fmt == "github":
        (line,) = text.splitlines()
        name, _, data = parse_workflow_command(line)
        assert name == "error" and data == reason
    else:
        tokens = MarkdownIt("commonmark").parse(text)
        shown = ["".join(c.content for c in t.children if c.type == "text")
                 for t in tokens if t.type == "inline"]
        assert f"❌ FAIL: {reason}" in shown


def test_a_clip_that_would_zero_every_gradient_is_an_annotation(gradclip, tmp_path):  # noqa: F811
    out = tmp_path / "zero.pt"
    r = gradclip("clip", SAMPLES / "healthy.pt", "--max-norm", "1", "--norm-type", "1e-3",
                 "-o", out, "--format", "github")
    assert r.code == 1 and not out.exists()
    (line,) = r.out.splitlines()
    name, _, data = parse_workflow_command(line)
    assert name == "error" and data == stderr_message(r)
    assert "round every gradient to zero" in data
