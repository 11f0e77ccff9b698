"""Every JSON document gradclip prints conforms to the schema file it ships (8.4, 8.5)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from gradclip_cli.schemas import names, schema
from tests.json_schemas import assert_valid

from .support import SAMPLES

SAMPLE_FILES = ["healthy.pt", "exploding.pt", "nonfinite.pt", "bf16.pt", "training_state.pt",
                "healthy.safetensors", "flat_legacy.pt"]


def test_the_package_ships_valid_draft_2020_12_schemas():
    assert {"gradclip.inspect/1", "gradclip.clip/1", "gradclip.error/1"} <= set(names())
    for name in names():
        document = schema(name)
        jsonschema.Draft202012Validator.check_schema(document)
        assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert document["title"] == name
    assert schema("inspect-1") == schema("gradclip.inspect/1")
    with pytest.raises(KeyError):
        schema("gradclip.nothing/9")


def test_the_schemas_reject_what_the_contract_forbids():
    good = {"schema": "gradclip.error/1", "exit_code": 3, "error": "x.pt: bad", "source": "x.pt"}
    assert_valid(good)
    for bad in ({**good, "exit_code": 1}, {**good, "error": "two\nlines"},
                {k: v for k, v in good.items() if k != "source"}):
        with pytest.raises(jsonschema.ValidationError):
            assert_valid(bad)


@pytest.mark.parametrize("name", SAMPLE_FILES)
@pytest.mark.parametrize("extra", [[], ["--max-norm", "1"], ["--norm-type", "inf"]])
def test_inspect_output_conforms(gradclip, name, extra):
    result = gradclip("inspect", SAMPLES / name, "--format", "json", *extra)
    assert result.code in (0, 1), result.err
    document = assert_valid(result.out)
    assert document["schema"] == "gradclip.inspect/1"


@pytest.mark.parametrize("extra", [["--max-norm", "1"], ["--max-norm", "1e9"],
                                   ["--clip-value", "0.01"]])
def test_clip_output_conforms(gradclip, tmp_path, extra):
    out = tmp_path / "out.pt"
    result = gradclip("clip", SAMPLES / "healthy.pt", "-o", out, "--format", "json", *extra)
    assert result.code == 0, result.err
    assert assert_valid(result.out)["output"] == str(out)


def test_clip_of_nonfinite_under_allow_conforms(gradclip, tmp_path):
    out = tmp_path / "out.pt"
    result = gradclip("clip", SAMPLES / "nonfinite.pt", "--max-norm", "1", "-o", out,
                      "--allow-nonfinite", "--format", "json")
    assert result.code == 0, result.err
    assert_valid(result.out)


def failing_runs(tmp_path):
    """(arguments, exit code or None for either): ways a run fails with exit 2 or 3."""
    missing = tmp_path / "missing.pt"
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    empty = tmp_path / "empty.pt"
    torch.save({"grads": {}}, empty)
    healthy = SAMPLES / "healthy.pt"
    folder = tmp_path / "folder"
    folder.mkdir()
    return [
        (["inspect", missing], 3),
        (["inspect", garbage], 3),
        (["inspect", empty], 3),
        (["inspect", healthy, "--key", "nope"], 3),
        (["inspect", healthy, "--norm-type", "-1"], 2),
        (["inspect", healthy, "--max-norm", "x"], 2),
        (["inspect", healthy, "--device", "tpu"], 2),
        (["inspect", healthy, "--top", "-1"], 2),
        (["inspect", healthy, "--no-such-flag"], 2),
        (["clip", missing, "--max-norm", "1"], 3),
        (["clip", garbage, "--max-norm", "1"], 3),
        (["clip", healthy], 2),
        (["clip", healthy, "--max-norm", "1", "--clip-value", "1"], 2),
        (["clip", healthy, "--max-norm", "0"], 2),
        (["clip", healthy, "--max-norm", "1", "-o", folder], None),  # 2 or 3: see issue 7.14
        (["clip", healthy, "--max-norm", "1", "--in-place", "-o", tmp_path / "x.pt"], 2),
        (["clip", healthy, "--max-norm", "1", "-o", tmp_path / "no" / "dir" / "x.pt"], 3),
    ]


def test_every_failure_in_json_mode_prints_exactly_one_error_object(gradclip, tmp_path):
    for args, code in failing_runs(tmp_path):
        result = gradclip(*args, "--format", "json")
        assert result.code in (2, 3), (args, result.code, result.err)
        assert code is None or result.code == code, (args, result.code)
        lines = result.out.splitlines()
        assert len(lines) == 1, (args, result.out)
        document = assert_valid(lines[0])
        assert document["exit_code"] == result.code
        # The same one-line message as on stderr.
        assert result.err_lines[-1] == f"gradclip: {document['error']}", args


def test_errors_go_to_the_output_file_for_both_commands(gradclip, tmp_path):
    for command in (["inspect"], ["clip", "--max-norm", "1"]):
        report = tmp_path / f"{command[0]}.json"
        result = gradclip(command[0], tmp_path / "missing.pt", *command[1:], "--format", "json",
                          "--output-file", report)
        assert result.code == 3
        assert result.out == ""  # the report went to the file, not stdout
        document = assert_valid(report.read_text())
        assert document["source"] == str(tmp_path / "missing.pt")
        assert json.loads(report.read_text())["exit_code"] == 3


def test_a_successful_report_goes_to_the_output_file_and_conforms(gradclip, tmp_path):
    report = tmp_path / "clip.json"
    result = gradclip("clip", SAMPLES / "healthy.pt", "--max-norm", "1", "-o",
                      tmp_path / "out.pt", "--format", "json", "--output-file", report)
    assert result.code == 0 and result.out == ""
    assert assert_valid(report.read_text())["clipped"] is True
