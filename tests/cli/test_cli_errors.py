"""Usage errors (exit 2) and unreadable inputs (exit 3): one plain line, no traceback."""

from __future__ import annotations

import argparse
import collections
import json
import random

import pytest
import torch

from .support import assert_no_report, save_safetensors


def assert_one_line_error(result, code: int, *needles: str) -> None:
    assert result.code == code, (result.code, result.err)
    assert_no_report(result)
    assert "Traceback" not in result.err
    assert len(result.err_lines) == 1, result.err
    assert result.err_lines[0].startswith("gradclip")
    for needle in needles:
        assert needle in result.err, (needle, result.err)


# -- usage errors: exit 2 ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-2", "nan", "0", "abc", "-inf", ""])
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_bad_norm_type(gradclip, grads_file, command, value):
    extra = ["--max-norm", "1"] if command == "clip" else []
    result = gradclip(command, grads_file, "--norm-type", value, *extra)
    assert_one_line_error(result, 2, "--norm-type")


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "abc", "-inf"])
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_bad_max_norm(gradclip, grads_file, command, value):
    assert_one_line_error(gradclip(command, grads_file, "--max-norm", value), 2, "--max-norm")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x"])
def test_bad_clip_value(gradclip, grads_file, value):
    result = gradclip("clip", grads_file, "--clip-value", value)
    assert_one_line_error(result, 2, "--clip-value")


def test_clip_needs_exactly_one_rule(gradclip, grads_file):
    both = gradclip("clip", grads_file, "--max-norm", "1", "--clip-value", "1")
    assert_one_line_error(both, 2, "--max-norm", "--clip-value")
    neither = gradclip("clip", grads_file)
    assert_one_line_error(neither, 2, "--max-norm")


def test_in_place_with_output(gradclip, grads_file, tmp_path):
    result = gradclip("clip", grads_file, "--max-norm", "1", "--in-place", "-o", tmp_path / "x.pt")
    assert_one_line_error(result, 2, "--in-place")
    assert not (tmp_path / "x.pt").exists()


def test_output_equal_to_input(gradclip, grads_file, monkeypatch):
    from .support import sha256

    before = sha256(grads_file)
    assert_one_line_error(
        gradclip("clip", grads_file, "--max-norm", "1", "-o", grads_file), 2, "--in-place"
    )
    monkeypatch.chdir(grads_file.parent)
    (grads_file.parent / "sub").mkdir()
    other_spelling = "sub/../grads.pt"
    assert_one_line_error(
        gradclip("clip", "grads.pt", "--max-norm", "1", "-o", other_spelling), 2, "--in-place"
    )
    assert sha256(grads_file) == before


def test_output_is_a_directory(gradclip, grads_file, tmp_path):
    (tmp_path / "d").mkdir()
    # The output cannot be written: exit 3, as the contract says (not a usage error).
    assert_one_line_error(gradclip("clip", grads_file, "--max-norm", "1", "-o", tmp_path / "d"), 3)


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "xla:0"])
def test_bad_device(gradclip, grads_file, device):
    assert_one_line_error(gradclip("inspect", grads_file, "--device", device), 2, "--device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_cuda_without_cuda(gradclip, grads_file, device, command):
    extra = ["--max-norm", "1"] if command == "clip" else []
    result = gradclip(command, grads_file, "--device", device, *extra)
    assert_one_line_error(result, 2, "--device")
    assert not grads_file.with_name("grads.clipped.pt").exists()


def test_device_auto_and_cpu_work(gradclip, grads_file):
    for device in ("cpu", "auto", "CPU"):
        assert gradclip("inspect", grads_file, "--device", device).code == 0, device


@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_bad_format(gradclip, grads_file, command):
    result = gradclip(command, grads_file, "--format", "xml", "--max-norm", "1")
    assert_one_line_error(result, 2, "--format")
    assert not grads_file.with_name("grads.clipped.pt").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "{f}", "--bogus"],
        ["clip", "{f}", "--max-norm", "1", "--bogus"],
        ["inspect", "{f}", "--top", "-1"],
        ["inspect", "{f}", "--top", "many"],
        ["inspect"],
        ["inspect", "{f}", "extra-argument"],
        ["inspect", "{f}", "--max-norm"],
        ["frobnicate", "{f}"],
    ],
)
def test_parse_errors(gradclip, grads_file, args):
    result = gradclip(*[a.format(f=grads_file) for a in args])
    assert_one_line_error(result, 2)


# -- unreadable inputs: exit 3 -------------------------------------------------------------


def unreadable_files(tmp_path, grads_file):
    files = {}
    files["missing"] = tmp_path / "missing.pt"
    (tmp_path / "dir.pt").mkdir()
    files["directory"] = tmp_path / "dir.pt"
    files["empty"] = tmp_path / "empty.pt"
    files["empty"].write_bytes(b"")
    data = grads_file.read_bytes()
    for name, cut in (
        ("truncated-half", len(data) // 2),
        ("truncated-tail", len(data) - 10),
        ("truncated-head", 100),
    ):
        files[name] = tmp_path / f"{name}.pt"
        files[name].write_bytes(data[:cut])
    rng = random.Random(0)
    files["random"] = tmp_path / "random.bin"
    files["random"].write_bytes(b"\xfe\xff" + rng.randbytes(4000))
    files["text"] = tmp_path / "notes.pt"
    files["text"].write_text("step,loss\n1,2.5\n2,2.1\n")
    files["json"] = tmp_path / "config.safetensors"
    files["json"].write_text('{"a": 1}')
    st = tmp_path / "whole.safetensors"
    save_safetensors(st, {"a.w": torch.ones(100)})
    files["safetensors-truncated"] = tmp_path / "cut.safetensors"
    files["safetensors-truncated"].write_bytes(st.read_bytes()[:-50])
    files["no-floating"] = tmp_path / "ints.pt"
    torch.save({"grads": {"a": torch.arange(4)}}, files["no-floating"])
    files["not-a-mapping"] = tmp_path / "list.pt"
    torch.save([torch.ones(2)], files["not-a-mapping"])
    files["empty-grads"] = tmp_path / "nograds.pt"
    torch.save({"grads": {}, "step": 1}, files["empty-grads"])
    files["scalar-only"] = tmp_path / "scalars.pt"
    torch.save({"step": 3, "loss": 1.5}, files["scalar-only"])
    return files


CASES = ["missing", "directory", "empty", "truncated-half", "truncated-tail", "truncated-head",
         "random", "text", "json", "safetensors-truncated", "no-floating", "not-a-mapping",
         "scalar-only"]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_unreadable_input_exits_3(gradclip, tmp_path, grads_file, case, command):
    path = unreadable_files(tmp_path, grads_file)[case]
    extra = ["--max-norm", "1"] if command == "clip" else []
    before = sorted(p.name for p in tmp_path.iterdir())
    result = gradclip(command, path, *extra)
    assert result.code == 3, (result.code, result.err)
    assert_no_report(result)
    assert "Traceback" not in result.err
    assert 1 <= len(result.err_lines) <= 2, result.err
    assert str(path) in result.err_lines[0], result.err
    assert "--debug" not in result.err, f"an unexpected error escaped the readers: {result.err}"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_unreadable_input_json_mode_prints_the_error_object(gradclip, tmp_path, grads_file):
    """CONTRACT: with --format json a failed run still prints one gradclip.error/1 object."""
    path = unreadable_files(tmp_path, grads_file)["truncated-half"]
    result = gradclip("inspect", path, "--format", "json")
    assert result.code == 3
    assert result.out.count("\n") == 1
    doc = result.json()
    assert doc == {"schema": "gradclip.error/1", "exit_code": 3, "source": str(path),
                   "error": result.err_lines[0].removeprefix("gradclip: ")}
    assert str(path) in doc["error"]


def test_usage_error_in_json_mode_prints_the_error_object(gradclip, grads_file):
    result = gradclip("inspect", grads_file, "--format", "json", "--norm-type", "-1")
    assert result.code == 2
    doc = result.json()
    assert doc["schema"] == "gradclip.error/1" and doc["exit_code"] == 2
    assert "--norm-type" in doc["error"]
    parse = gradclip("inspect", grads_file, "--format=json", "--no-such-flag")
    assert parse.code == 2
    assert parse.json()["exit_code"] == 2 and "--no-such-flag" in parse.json()["error"]


def test_error_object_goes_to_the_output_file(gradclip, tmp_path):
    report = tmp_path / "report.json"
    missing = tmp_path / "missing.pt"
    result = gradclip("inspect", missing, "--format", "json", "--output-file", report)
    assert result.code == 3
    assert_no_report(result)
    doc = json.loads(report.read_text())
    assert doc["exit_code"] == 3 and doc["source"] == str(missing)


def unsafe_file(tmp_path, grads):
    path = tmp_path / "unsafe.pt"
    torch.save({"grads": grads, "args": argparse.Namespace(lr=0.1)}, path)
    return path


def test_pickle_needing_full_unpickling_is_refused(gradclip, tmp_path, grads):
    path = tmp_path / "unsafe.pt"
    torch.save({"grads": grads, "hook": collections.OrderedDict.fromkeys}, path)
    for command, extra in (("inspect", []), ("clip", ["--max-norm", "1"])):
        result = gradclip(command, path, *extra)
        assert result.code == 3
        assert "Traceback" not in result.err and 1 <= len(result.err_lines) <= 2
        assert str(path) in result.err and "--trust-pickle" in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unsafe.pt"]


def test_args_read_as_data_are_measured_but_not_written_back(gradclip, tmp_path, grads):
    """A script's ``args`` (argparse.Namespace) is read as inert data: inspect needs no
    --trust-pickle, but clip cannot write the record back in the object's place: it
    refuses naming --trust-pickle, writing nothing; with it the object is kept."""
    from .support import ref_norm, rel_err

    path = unsafe_file(tmp_path, grads)
    doc = gradclip("inspect", path, "--format", "json")
    assert doc.code == 0, doc.err
    assert rel_err(doc.json()["total_norm"], ref_norm(grads.values(), 2)) <= 1e-6
    result = gradclip("clip", path, "--max-norm", "1")
    assert result.code == 3 and len(result.err_lines) == 1
    assert "argparse.Namespace" in result.err and "--trust-pickle" in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unsafe.pt"]


def test_trust_pickle_loads_and_warns(gradclip, tmp_path, grads):
    from .support import ref_norm, rel_err

    path = unsafe_file(tmp_path, grads)
    result = gradclip("inspect", path, "--trust-pickle", "--format", "json")
    assert result.code == 0
    assert rel_err(result.json()["total_norm"], ref_norm(grads.values(), 2)) <= 1e-6
    assert "--trust-pickle" in result.err and str(path) in result.err
    assert len(result.err_lines) == 1
    clip = gradclip("clip", path, "--trust-pickle", "--max-norm", "1", "--format", "json")
    assert clip.code == 0 and "--trust-pickle" in clip.err
    out = torch.load(path.with_name("unsafe.clipped.pt"), weights_only=False)
    assert out["args"].lr == 0.1


def flip_tensor_byte(src, dst) -> None:
    """Corrupt one byte of a stored tensor: the zip's CRC32 no longer matches."""
    import zipfile

    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename)
    # The data follows the local header (30 bytes), the name and the local extra field,
    # whose length may differ from the central directory's copy.
    offset = info.header_offset
    name_len = int.from_bytes(data[offset + 26 : offset + 28], "little")
    extra_len = int.from_bytes(data[offset + 28 : offset + 30], "little")
    start = offset + 30 + name_len + extra_len
    data[start + 1] ^= 0x40
    dst.write_bytes(bytes(data))


def test_verify_catches_a_flipped_bit(gradclip, tmp_path, grads_file):
    bad = tmp_path / "flipped.pt"
    flip_tensor_byte(grads_file, bad)
    assert gradclip("inspect", bad).code == 0  # torch.load never checks CRCs
    result = gradclip("inspect", bad, "--verify")
    assert result.code == 3
    assert str(bad) in result.err and "Traceback" not in result.err
    assert gradclip("inspect", grads_file, "--verify").code == 0
    assert gradclip("clip", bad, "--verify", "--max-norm", "1").code == 3
    assert not bad.with_name("flipped.clipped.pt").exists()


def test_unwritable_output_folder(gradclip, grads_file, tmp_path):
    result = gradclip("clip", grads_file, "--max-norm", "1", "-o", tmp_path / "no" / "x.pt")
    assert result.code == 3
    assert "Traceback" not in result.err and 1 <= len(result.err_lines) <= 2
    assert "x.pt" in result.err


def test_debug_shows_the_traceback(gradclip, tmp_path):
    path = tmp_path / "t.pt"
    path.write_text("hello\n")
    result = gradclip("inspect", path, "--debug")
    assert "Traceback" in result.err  # --debug shows where it failed...
    assert result.code == 3  # ...and the exit code still follows the contract
