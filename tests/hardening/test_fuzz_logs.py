"""Fuzzing the small-file and log readers: ``trend`` over mutated norm logs, and the
one JSON parser and bounded reader every layout's small files go through.

Invariant (``test_fuzz.py``'s, for ``trend``): exit 0 or 1 with a trend JSON
document on stdout, or exit 3 with exactly one line naming the file and the
JSON error document (or exit 2 where a flipped byte makes one log hold norms
of two kinds, trend's own usage error). Never a traceback, never another exit code. The bases
are a monitor log (JSON Lines) and a ``trainer_state.json`` as the monitor
and the Trainer write them; mutations are byte edits, then whole JSON values
(nested, huge integers, floats past range, any text) put where a norm, a step
or a group goes. The JSON files inside real layouts are fuzzed in
``tests/layouts/test_small_files.py``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.json_text import parse_json
from gradclip_cli.source.files.small_file import excerpt, read_small_file
from tests.cli.test_cli_trend import monitor_line

from .support import run_cli
from .test_fuzz import COUNTS, FUZZ, _apply, _mutations

_DIR = Path(tempfile.mkdtemp(prefix="gradclip-fuzz-logs-"))

MONITOR = "".join(monitor_line(step, 1.0 + step / 10, {"h.0": 0.5, "h.1": 0.75 + step})
                  for step in range(1, 6)).encode()
TRAINER_STATE = json.dumps({
    "global_step": 5, "best_metric": None,
    "log_history": [{"loss": 2.0 - s / 10, "grad_norm": 1.0 + s, "learning_rate": 1e-3,
                     "step": s} for s in range(1, 6)] + [{"train_runtime": 1.5, "step": 5}],
}, indent=2).encode()  # fmt: skip
BASES = {"monitor": ("norms.jsonl", MONITOR), "trainer-state": ("trainer_state.json",
                                                                 TRAINER_STATE)}


def _check_trend(name: str, data: bytes, label: str) -> None:
    COUNTS[label] = COUNTS.get(label, 0) + 1
    folder = Path(tempfile.mkdtemp(dir=_DIR))
    path = folder / name
    path.write_bytes(data)
    try:
        result = run_cli("trend", path, "--format", "json")
        assert "Traceback" not in result.err, result.err
        if result.code in (0, 1):
            assert json.loads(result.out)["schema"] == "gradclip.trend/1"
            return
        lines = [line for line in result.err.splitlines() if line.strip()]
        if result.code == 2:  # one log in two kinds of norm: trend's own usage error
            assert len(lines) == 1 and "compares one kind of norm" in lines[0], result.err
            return
        assert result.code == 3, (result.code, result.err)
        assert len(lines) == 1 and str(path) in lines[0], result.err
        assert json.loads(result.out)["schema"] == "gradclip.error/1"
    finally:
        path.unlink()
        folder.rmdir()


@pytest.mark.parametrize("kind", list(BASES))
def test_fuzz_log_bytes(kind):
    name, base = BASES[kind]

    @FUZZ
    @given(mutations=_mutations(len(base)))
    def run(mutations):
        _check_trend(name, _apply(base, mutations), f"log-bytes-{kind}")

    run()


def _json_texts():
    """JSON text as a hostile writer might put it where one value goes."""
    scalars = st.one_of(
        # Any finite float, up to float's range: the spike rule judges them all.
        st.none(), st.booleans(),
        st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
        st.integers(-10**30, 10**30).map(str),
        st.integers(50, 6000).map(lambda n: "9" * n),  # far past a float, past int's limit
        st.sampled_from(["1e400", "-1e999", "NaN", "Infinity", '"nan"', '"inf"', "1.5", "0"]),
        st.text(max_size=20).map(json.dumps),
    ).map(lambda v: v if isinstance(v, str) else json.dumps(v))
    nested = st.tuples(st.integers(1, 3000), st.sampled_from(["[]", "{}"])).map(
        lambda d: ("[" * d[0] + "]" * d[0]) if d[1] == "[]"
        else ('{"a":' * d[0] + "1" + "}" * d[0]))
    return st.one_of(scalars, nested)


@pytest.mark.parametrize("field", ["total_norm", "step", "norm_type", "group", "nonfinite"])
def test_fuzz_monitor_values(field):
    """Any JSON text as a monitor entry's value; one of five lines changed (``norm_type``:
    all five, since one log in two kinds of norm is a usage error of its own)."""
    lines = MONITOR.decode().splitlines(keepends=True)

    def changed(line: str, value: str) -> str:
        entry = json.loads(line)
        marker = "\u2063MARK\u2063"
        if field == "group":
            entry["groups"]["h.1"] = marker
        elif field == "nonfinite":
            entry["nonfinite"]["nan"] = marker
        else:
            entry[field] = marker
        return json.dumps(entry).replace(json.dumps(marker), value) + "\n"

    @FUZZ
    @given(value=_json_texts(), at=st.integers(0, len(lines) - 1))
    def run(value, at):
        new = [changed(line, value) if i == at or field == "norm_type" else line
               for i, line in enumerate(lines)]
        _check_trend("norms.jsonl", "".join(new).encode(), f"monitor-{field}")

    run()


def test_fuzz_trainer_state_values():
    """Any JSON text as a logged grad_norm or step."""
    @FUZZ
    @given(value=_json_texts(), field=st.sampled_from(["grad_norm", "step"]),
           at=st.integers(0, 4))
    def run(value, field, at):
        state = json.loads(TRAINER_STATE)
        state["log_history"][at][field] = "\u2063MARK\u2063"
        text = json.dumps(state).replace(json.dumps("\u2063MARK\u2063"), value)
        _check_trend("trainer_state.json", text.encode(), f"trainer-state-{field}")

    run()


@FUZZ
@given(data=st.binary(max_size=300) | _json_texts().map(str.encode))
def test_fuzz_parse_json(data):
    """The one parser: a value, or an InputError of one line naming the place."""
    COUNTS["parse-json"] = COUNTS.get("parse-json", 0) + 1
    try:
        value = parse_json(data, where="f.json", what="a thing")
    except InputError as error:
        message = str(error)
        assert message.startswith("f.json: not a thing: ") and "\n" not in message
        assert len(message) < 200
        return
    if isinstance(value, float):
        assert not math.isinf(value) or data.strip().lstrip(b"-") == b"Infinity"


@FUZZ
@given(content=st.binary(max_size=200), limit=st.integers(0, 250),
       kind=st.sampled_from(["file", "fifo", "folder", "link-out", "dangling"]))
def test_fuzz_small_file_reader(content, limit, kind):
    """The bounded reader: the bytes (at most ``limit``), or one line naming the file that
    quotes none of its content; a FIFO never blocks."""
    COUNTS[f"small-file-{kind}"] = COUNTS.get(f"small-file-{kind}", 0) + 1
    folder = Path(tempfile.mkdtemp(dir=_DIR))
    outside = Path(tempfile.mkdtemp(dir=_DIR)) / "secret"
    outside.write_bytes(content)
    path = folder / "small"
    if kind == "file":
        path.write_bytes(content)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "link-out":
        path.symlink_to(outside)
    else:
        path.symlink_to(folder / "missing")
    try:
        data = read_small_file(path, limit=limit, what="a tag", folder=folder)
    except InputError as error:
        message = str(error)
        assert message.startswith(f"{path}: ") and "\n" not in message
        if kind == "link-out" and len(content) >= 8:
            assert excerpt(content) not in message
        assert kind != "file" or len(content) > limit
        return
    assert kind == "file" and data == content and len(data) <= limit
