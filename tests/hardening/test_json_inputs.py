"""JSON read from files: every malformed document is exit 3 with one line naming the
file and the place (docs/reference/contract.md: "Every malformed input is exit 3").

Norm logs here: monitor logs (JSON Lines: the line's number) and
``trainer_state.json`` read by ``trend``. A norm written as an integer of 400
digits (``float()`` overflows) or 5,000 (past ``int``'s digit limit), a float
literal past float's range, nesting deeper than Python's parser recurses.
Never a traceback, never exit 1, and with ``--format json`` the error document
on stdout. The JSON files inside layouts: ``tests/layouts/test_small_files.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_cli_trend import monitor_line

from .support import run_cli

DEEP = "[" * 100_000 + "]" * 100_000  # past any recursion limit
HOSTILE_NUMBERS = {
    "400 digits": ("1" * 400, "an integer of 400 digits"),
    "5000 digits": ("7" * 5000, "an integer of 5000 digits"),
    "past float": ("1e400", "too large for a float"),
}


def refused(result, *fragments) -> str:
    assert result.code == 3, (result.code, result.err)
    assert "Traceback" not in result.err and "Error:" not in result.err, result.err
    lines = [line for line in result.err.splitlines() if line.strip()]
    assert len(lines) == 1, result.err
    for fragment in fragments:
        assert str(fragment) in lines[0], lines[0]
    return lines[0]


def json_error(result) -> None:
    doc = json.loads(result.out)
    assert doc["schema"] == "gradclip.error/1" and doc["exit_code"] == 3


@pytest.mark.parametrize("number, words", HOSTILE_NUMBERS.values(), ids=list(HOSTILE_NUMBERS))
def test_a_monitor_log_norm_out_of_range(tmp_path, number, words):
    log = tmp_path / "m.jsonl"
    bad = monitor_line(2, 1.0, {"h.0": 1.0}).replace('"total_norm": 1.0', f'"total_norm": {number}')
    log.write_text(monitor_line(1, 1.0, {"h.0": 1.0}) + bad + monitor_line(3, 1.0, {"h.0": 1.0}))
    result = run_cli("trend", log, "--format", "json")
    refused(result, f"{log}:2: ", words, "column")
    json_error(result)


def test_a_monitor_log_nested_deeply(tmp_path):
    log = tmp_path / "m.jsonl"
    log.write_text(monitor_line(1, 1.0, {}) + monitor_line(2, 1.0, {}) + DEEP + "\n")
    result = run_cli("trend", log, "--format", "json")
    refused(result, f"{log}:3: ", "nested too deeply")
    json_error(result)


def test_a_monitor_log_group_nested_within_the_parser_s_reach(tmp_path):
    """A group norm that is a list nested 200 deep parses, and is refused by its kind
    without being written out."""
    log = tmp_path / "m.jsonl"
    nested = "[" * 200 + "]" * 200
    log.write_text(monitor_line(1, 1.0, {"h.0": 1.0}).replace('{"h.0": 1.0}',
                                                              '{"h.0": ' + nested + "}"))
    line = refused(run_cli("trend", log), f"{log}:1: ", "got a list")
    assert "[[[" not in line


def _trainer_log(tmp_path: Path, norm: str) -> Path:
    state = tmp_path / "trainer_state.json"
    state.write_text('{"global_step": 2, "log_history": [{"loss": 1.0, "grad_norm": 1.5, '
                     f'"step": 1}}, {{"loss": 1.0, "grad_norm": {norm}, "step": 2}}]}}')
    return state


@pytest.mark.parametrize("number, words", HOSTILE_NUMBERS.values(), ids=list(HOSTILE_NUMBERS))
def test_a_trainer_state_log_norm_out_of_range(tmp_path, number, words):
    state = _trainer_log(tmp_path, number)
    result = run_cli("trend", state, "--format", "json")
    refused(result, state, words, "line 1 column")
    json_error(result)


def test_a_trainer_state_log_nested_deeply(tmp_path):
    state = _trainer_log(tmp_path, DEEP)
    result = run_cli("trend", state, "--format", "json")
    refused(result, state, "nested too deeply")
    json_error(result)
