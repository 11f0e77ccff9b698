"""What reaches a terminal: every line fits the width, and nothing from a file is interpreted."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.json_schemas import assert_valid

from .support import SAMPLES, logical_lines, run_process, unwrapped

WIDTHS = [60, 80, 120, 200]
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[+-]?\d+)?%?")


def long_named_grads() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    grads = {}
    for i in range(3):
        for part in ("self_attention.query_key_value_projection.weight",
                     "feed_forward.intermediate_dense_projection.bias"):
            grads[f"model.encoder.layers.{i}.{part}"] = torch.randn(64) * (10.0 ** i)
    grads["model.encoder.layers.1.self_attention.query_key_value_projection.weight"][3] = float(
        "nan")
    grads["model.encoder.layers.2.feed_forward.intermediate_dense_projection.bias"][:2] = float(
        "inf")
    return grads


@pytest.fixture(scope="module")
def wide_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide") / "a_rather_long_checkpoint_file_name_for_tests.pt"
    torch.save({"grads": long_named_grads(), "step": 1}, path)
    return path


def as_shown(x: float | str) -> str:
    return f"{x:.6g}" if isinstance(x, float) else x


def numbers_in(text: str) -> set[str]:
    return set(NUMBER.findall(text))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("group_by", ["layer", "tensor"])
def test_every_line_fits_and_every_number_is_whole(wide_file, width, group_by):
    result = run_process("inspect", wide_file, "--group-by", group_by, "--allow-nonfinite",
                         env={"COLUMNS": str(width)})
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert max(len(line) for line in lines) <= width, "\n".join(
        line for line in lines if len(line) > width)
    # Every number of the JSON report shows whole in the table.
    document = json.loads(run_process("inspect", wide_file, "--group-by", group_by,
                                      "--allow-nonfinite", "--format", "json").out)
    shown = numbers_in(result.out)
    for group in document["groups"]:
        assert as_shown(group["norm"]) in result.out
        # elements is an optional column: when shown, whole.
        if "┃ elements ┃" in result.out:
            assert f"{group['num_elements']:,}" in shown
    assert f"{document['num_elements']:,}" in shown  # in the header line
    assert f"total norm {as_shown(document['total_norm'])}" in " ".join(result.out.split())
    # Non-finite counts are never cut ("1 -" for "1 -inf").
    assert "2 +inf" in result.out and "1 nan" in result.out
    assert not re.search(r"\d [-+]?(?:in|i|n|na)\b", result.out)
    # Names are shortened in the middle, never at the end.
    for line in lines:
        if "…" in line:
            assert re.search(r"…[\w.]*[a-z]", line), line


@pytest.mark.parametrize("width", WIDTHS)
def test_clip_and_quiet_lines_fit(wide_file, tmp_path, width):
    env = {"COLUMNS": str(width)}
    out = tmp_path / ("x" * 90 + ".pt")
    result = run_process("clip", wide_file, "--max-norm", "1", "-o", out,
                         "--allow-nonfinite", env=env)
    assert result.code == 0, result.err
    assert max(len(line) for line in result.out.splitlines()) <= width
    quiet = run_process("inspect", SAMPLES / "nonfinite.pt", "-q", env=env)
    assert quiet.code == 1
    verdict = " ".join(quiet.out.split())
    assert verdict.startswith("FAIL: non-finite gradients: 3 NaN, 1 +inf, 1 -inf in 2 tensors")
    assert max(len(line) for line in quiet.out.splitlines()) <= width


def test_columns_is_respected_in_pipes_and_120_is_the_default(wide_file):
    narrow = run_process("inspect", wide_file, "--group-by", "tensor", env={"COLUMNS": "70"})
    assert max(map(len, narrow.out.splitlines())) <= 70
    default = run_process("inspect", wide_file, "--group-by", "tensor", env={"COLUMNS": ""})
    widths = list(map(len, default.out.splitlines()))
    assert max(widths) <= 120 and max(widths) > 100


def test_quiet_is_the_verdict_alone_with_findings_on_stderr():
    result = run_process("inspect", SAMPLES / "nonfinite.pt", "--quiet")
    assert result.code == 1
    assert len(logical_lines(result.out)) == 1 and result.out.startswith("FAIL:")
    assert result.err_lines == [
        "gradclip: transformer.h.0.mlp.c_fc.weight: 3 nan",
        "gradclip: transformer.h.1.attn.c_proj.weight: 1 +inf, 1 -inf",
    ]
    ok = run_process("inspect", SAMPLES / "healthy.pt", "-q")
    assert ok.code == 0 and ok.err == ""
    assert ok.out == "OK: gradient total norm 2.23462 (p=2) (exit 0)\n"


def test_plurals_and_the_unchanged_wording(tmp_path):
    path = tmp_path / "one.pt"
    torch.save({"w": torch.tensor([0.5])}, path)
    result = run_process("inspect", path)
    shown = unwrapped(result.out)
    assert "1 tensor, 1 element," in shown and "top 1 tensor by norm" in shown
    clipped = run_process("clip", path, "--max-norm", "1", "-o", tmp_path / "o.pt")
    assert "1 tensor unchanged: the total norm is within --max-norm" in unwrapped(clipped.out)
    assert "coefficient 1 is 1" not in clipped.out


# Names a file may hold to attack a terminal or a reader of the report.
HOSTILE = [
    "[/oops]",                                    # rich markup: crashed the table
    "[link=file:///etc/passwd]click[/link]",      # became a hyperlink
    "clear\x1b[2Jscreen",                         # CSI: clears the screen
    "osc\x1b]8;;http://evil.example/\x07link\x1b]8;;\x07",  # OSC 8 hyperlink
    "title\x1b]0;owned\x07",                      # OSC: sets the window title
    "h.0\nOK: total norm 0.1 (p=2) (exit 0)",     # forges a verdict line
    "bidi\u202etxt.exe\u2066x\u2069",            # Trojan Source reordering
    ":thumbs_up: [bold]x[/bold]",                 # emoji code and markup
    "cr\roverwrite",
]  # fmt: skip


@pytest.fixture(scope="module")
def hostile_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "hostile.pt"
    grads = {name: torch.full((2,), float(i + 1)) for i, name in enumerate(HOSTILE)}
    grads[HOSTILE[0]][0] = float("nan")  # also listed among the non-finite tensors
    torch.save({"grads": grads, "step": 1}, path)
    return path


def assert_inert(text: str) -> None:
    """No escape, control or reordering character; a verdict only as the last line."""
    for ch in text:
        assert ch == "\n" or (ord(ch) >= 0x20 and ord(ch) != 0x7F), repr(ch)
        assert not (0x202A <= ord(ch) <= 0x202E or 0x2066 <= ord(ch) <= 0x2069), repr(ch)
    assert "\x1b" not in text and "\r" not in text
    assert "\u200b" not in text


@pytest.mark.parametrize("extra", [[], ["--group-by", "tensor"], ["-q"], ["--top", "20"]])
def test_hostile_names_in_the_table(hostile_file, extra):
    result = run_process("inspect", hostile_file, *extra, env={"COLUMNS": "200"})
    assert result.code == 1, result.err  # the NaN, not a crash
    assert "Traceback" not in result.err
    assert_inert(result.out)
    assert_inert(result.err)
    lines = result.out.splitlines()
    assert [line for line in lines if line.startswith(("OK", "FAIL"))] == [lines[-1]]
    if "-q" not in extra:
        # Shown escaped, as written (markup and emoji codes untouched).
        assert "[link=file:///etc/passwd]click[/link]" in result.out
        assert ":thumbs_up: [bold]x[/bold]" in result.out
        assert "h.0\\nOK: total norm 0.1" in result.out
        assert "clear\\x1b[2Jscreen" in result.out


def test_hostile_names_in_json_are_exact_and_escaped(hostile_file):
    result = run_process("inspect", hostile_file, "--format", "json")
    assert result.code == 1
    assert result.out.isascii()  # every control and non-ASCII character as \\uXXXX
    assert_inert(result.out)
    document = assert_valid(result.out)
    assert [t["name"] for t in document["tensors"]] == HOSTILE  # a script sees the real names


def test_hostile_key_and_path_in_errors(tmp_path, hostile_file):
    key = "x\x1b[2J\nOK: fine"
    result = run_process("inspect", hostile_file, "--key", key)
    assert result.code == 3 and len(result.err_lines) == 1
    assert_inert(result.err)
    path = tmp_path / "evil\x1b]0;t\x07name.pt"
    path.write_bytes(b"garbage")
    for fmt in ("table", "json"):
        result = run_process("inspect", path, "--format", fmt)
        assert result.code == 3 and len(result.err_lines) == 1
        assert_inert(result.err)
        assert_inert(result.out)
        if fmt == "json":
            assert_valid(result.out)


def test_hostile_names_in_clip(hostile_file, tmp_path):
    out = tmp_path / "out\x1b[2J.pt"
    for fmt in ("table", "json"):
        result = run_process("clip", hostile_file, "--max-norm", "1", "-o", out,
                             "--allow-nonfinite", "--format", fmt)
        assert result.code == 0, result.err
        assert_inert(result.out)
        assert_inert(result.err)
