"""``--verify`` through the CLI: damage is exit 3 naming the entry; its cost on a big file.

The cost measurement is slow and prints figures instead of asserting them::

    GRADCLIP_SLOW=1 .venv/bin/pytest -s -m slow tests/hardening/test_verify.py
"""

from __future__ import annotations

import os
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch

from .support import assert_refused, f32, run_cli, safetensors_bytes


def _entry_data_offset(path: Path, suffix: str) -> tuple[str, int]:
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    n, e = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    return info.filename, info.header_offset + 30 + n + e


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("entry_index", [0, 2])
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_flipped_data_byte_names_the_entry(tmp_path, command, entry_index):
    path = tmp_path / "g.pt"
    torch.save({"grads": {f"w{i}": torch.ones(256) * (i + 1) for i in range(3)}}, path)
    entry, offset = _entry_data_offset(path, f"data/{entry_index}")
    _flip(path, offset + 100, bit=3)
    extra = ["--max-norm", "1"] if command == "clip" else []
    plain = run_cli(command, path, "-q", *extra)
    assert plain.code == 0  # torch.load never checks: the damage passes unseen...
    (tmp_path / "g.clipped.pt").unlink(missing_ok=True)
    line = assert_refused(run_cli(command, path, "-q", "--verify", *extra), path)
    assert entry in line and "checksum" in line  # ...--verify names it
    assert not (tmp_path / "g.clipped.pt").exists()


def test_flipped_bit_in_the_last_byte_of_the_last_entry(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(1000)}}, path)
    entry, offset = _entry_data_offset(path, "data/0")
    _flip(path, offset + 3999, bit=7)
    assert entry in assert_refused(run_cli("inspect", path, "-q", "--verify"), path)


def test_stored_crc_edited_instead_of_data(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(16)}}, path)
    raw = bytearray(path.read_bytes())
    cd = raw.index(b"PK\x01\x02")
    while not raw[cd + 46 : cd + 46 + struct.unpack("<H", raw[cd + 28 : cd + 30])[0]].endswith(
        b"data/0"
    ):
        cd = raw.index(b"PK\x01\x02", cd + 4)
    raw[cd + 16] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert "data/0" in assert_refused(run_cli("inspect", path, "-q", "--verify"), path)


@pytest.mark.parametrize(
    "header, buffer, words",
    [
        ({"a": f32(0, 2), "b": f32(4, 2)}, bytes(12), "overlaps"),
        ({"a": f32(0, 1), "b": f32(8, 1)}, bytes(12), "unexplained"),
        ({"a": f32(0, 1)}, bytes(8), "after the last tensor"),
    ],
    ids=["overlap", "gap", "trailing"],
)
@pytest.mark.parametrize("command", ["inspect", "clip"])
def test_safetensors_layout_faults(tmp_path, command, header, buffer, words):
    path = tmp_path / "g.safetensors"
    path.write_bytes(safetensors_bytes(header, buffer))
    extra = ["--max-norm", "1"] if command == "clip" else []
    assert_refused(run_cli(command, path, "-q", "--verify", *extra), path, words)
    assert not (tmp_path / "g.clipped.safetensors").exists()


def test_verify_passes_a_clean_file(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(4)}}, path)
    assert run_cli("inspect", path, "-q", "--verify").code == 0


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("GRADCLIP_SLOW"), reason="set GRADCLIP_SLOW=1")
def test_verify_cost_on_200mb(tmp_path):
    path = tmp_path / "big.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({"grads": {f"w{i}": torch.randn(5_000_000, generator=g) for i in range(10)}}, path)
    print(f"\nfile: {path.stat().st_size / 1e6:.0f} MB")
    for label, extra in [
        ("warm-up", []),
        ("plain", []),
        ("verify", ["--verify"]),
        ("plain", []),
        ("verify", ["--verify"]),
    ]:
        start = time.perf_counter()
        assert run_cli("inspect", path, "-q", "--format", "json", *extra).code == 0
        print(f"{label:8s} {time.perf_counter() - start:.2f} s")


_FORMATS = ["table", "json", "markdown", "github", "junit"]


@pytest.mark.parametrize("format", _FORMATS)
def test_legacy_file_says_verify_checked_nothing(tmp_path, format):
    """A legacy torch file stores no checksums: --verify cannot see a flipped data byte, so
    the report says nothing was checked (in every format), and the exit code stays."""
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(256)}}, path, _use_new_zipfile_serialization=False)
    clean = run_cli("inspect", path, "--format", "json")
    _flip(path, path.stat().st_size - 1, bit=3)  # the last float's high byte
    damaged = run_cli("inspect", path, "--format", "json")
    assert damaged.code == clean.code == 0 and damaged.out != clean.out  # the damage is read
    result = run_cli("inspect", path, "--verify", "--format", format)
    assert result.code == 0, result.err
    assert "stores no checksums" in result.out and "nothing was checked" in result.out
    if format == "json":
        import json
        description = json.loads(result.out)["description"]
        assert any("nothing was checked" in line for line in description), description
    plain = run_cli("inspect", path, "--format", format)  # without --verify: no such note
    assert "checksums" not in plain.out


@pytest.mark.parametrize("format", _FORMATS)
def test_safetensors_says_verify_checked_the_header_alone(tmp_path, format):
    """safetensors stores no checksums: --verify checks the header's layout, not the data."""
    path = tmp_path / "g.safetensors"
    path.write_bytes(safetensors_bytes({"w": f32(0, 2)}, struct.pack("<2f", 3.0, 4.0)))
    result = run_cli("inspect", path, "--verify", "--format", format)
    assert result.code == 0, result.err
    assert "stores no checksums" in result.out and "header" in result.out
    assert "checksums" not in run_cli("inspect", path, "--format", format).out


@pytest.mark.parametrize("format", _FORMATS)
def test_torch_zip_verified_has_no_such_note(tmp_path, format):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(4)}}, path)
    result = run_cli("inspect", path, "--verify", "--format", format)
    assert result.code == 0 and "checksums" not in result.out


def _legacy(folder: Path, name: str, step: int, scale: float = 1.0) -> Path:
    path = folder / name
    torch.save({"grads": {"w": torch.ones(16) * scale}, "step": step}, path,
               _use_new_zipfile_serialization=False)
    return path


def _command_args(command: str, tmp_path: Path) -> list[object]:
    a = _legacy(tmp_path, "a.pt", 1)
    b = _legacy(tmp_path, "b.pt", 2, scale=2.0)
    return {"clip": ["clip", a, "--max-norm", "1", "--output", tmp_path / "out.pt"],
            "trend": ["trend", a, b],
            "compare": ["compare", a, b],
            "autopsy": ["autopsy", a, b]}[command]


@pytest.mark.parametrize("format", _FORMATS)
@pytest.mark.parametrize("command", ["clip", "trend", "compare", "autopsy"])
def test_legacy_files_say_verify_checked_nothing_in_every_command(tmp_path, command, format):
    """Every command that takes --verify says, as a note, that a legacy torch file (no
    checksums) could not be checked; without --verify, no such note; the exit code is the
    one without it."""
    args = _command_args(command, tmp_path)
    plain = run_cli(*args, "--format", format)
    result = run_cli(*args, "--verify", "--format", format)
    assert result.code == plain.code, result.err
    assert "stores no checksums" in result.out and "nothing was checked" in result.out
    assert "a.pt" in result.out
    if format == "json":
        from ..json_schemas import assert_valid
        notes = assert_valid(result.out)["notes"]  # the schemas allow it
        assert any("a.pt" in n and "nothing was checked" in n for n in notes), notes
        if command != "clip":  # clip reads one file
            assert any("b.pt" in n and "nothing was checked" in n for n in notes), notes
    assert "checksums" not in plain.out


def _refused_clip(kind: str, folder: Path) -> tuple[list[object], int, str]:
    """clip arguments that refuse (exit 1, 2 or 3) a file storing no checksums, the code,
    and the words --verify's note uses for that kind."""
    legacy = "nothing was checked"
    if kind == "nonfinite":  # a finding: refused to clip (exit 1)
        path = folder / "g.pt"
        torch.save({"grads": {"w": torch.tensor([1.0, float("nan")])}}, path,
                   _use_new_zipfile_serialization=False)
        return ["clip", path, "--max-norm", "1"], 1, legacy
    if kind == "usage":  # exit 2: --clip-value on complex gradients
        path = folder / "g.pt"
        torch.save({"grads": {"w": torch.ones(2, dtype=torch.complex64)}}, path,
                   _use_new_zipfile_serialization=False)
        return ["clip", path, "--clip-value", "1"], 2, legacy
    if kind == "input":  # exit 3: --key names nothing in the file
        path = folder / "g.pt"
        torch.save({"grads": {"w": torch.ones(2)}}, path, _use_new_zipfile_serialization=False)
        return ["clip", path, "--max-norm", "1", "--key", "nope"], 3, legacy
    path = folder / "g.safetensors"  # exit 1 on a safetensors file
    path.write_bytes(safetensors_bytes({"w": f32(0, 2)},
                                       struct.pack("<2f", 3.0, float("inf"))))
    return ["clip", path, "--max-norm", "1"], 1, "header"


def _verify_notes(path: Path) -> list[str]:
    """What --verify could not check in the file ``path``, as inspect's report of it says:
    the reference for what a refusal after reading it says."""
    from ..json_schemas import assert_valid

    result = run_cli("inspect", path, "--verify", "--format", "json", "--allow-nonfinite")
    assert result.code == 0, result.err
    notes = [d for d in assert_valid(result.out)["description"] if d.startswith("--verify")]
    assert notes, result.out
    return notes


def _said_on_stderr(result, plain, notes: list[str]) -> None:
    """stderr holds the one error line the run without --verify prints (``plain``), then
    one 'note:' line per note."""
    assert len(plain.err_lines) == 1, plain.err
    assert result.err_lines == [*plain.err_lines, *(f"gradclip: note: {n}" for n in notes)]


@pytest.mark.parametrize("format", _FORMATS)
@pytest.mark.parametrize("kind", ["nonfinite", "usage", "input", "safetensors"])
def test_a_refused_clip_still_says_what_verify_could_not_check(tmp_path, kind, format):
    """clip --verify refusing a file that stores no checksums (exit 1, 2 or 3) says, as a
    run it does not refuse does, that the check asked for was not made: in the document
    of every format that writes one, stderr keeping its one error line; where the format
    writes none (the table; JSON at exit 1), on stderr as 'note:' lines after the error
    line, which stays one line and the first."""
    args, code, words = _refused_clip(kind, tmp_path)
    notes = _verify_notes(args[1])
    out = tmp_path / "out.pt"
    plain = run_cli(*args, "--format", format, "--output", out)  # without --verify: none
    assert plain.code == code and "checksums" not in plain.out + plain.err
    result = run_cli(*args, "--verify", "--format", format, "--output", out)
    assert result.code == code, result.err
    assert not out.exists()
    writes_document = format in ("markdown", "github", "junit") or (
        format == "json" and code != 1)
    if writes_document:
        _said_on_stderr(result, plain, [])
        assert "stores no checksums" in result.out and words in result.out, result.out
    else:
        _said_on_stderr(result, plain, notes)
        assert all(words in n for n in notes), notes
    if format == "json" and code != 1:
        from ..json_schemas import assert_valid
        assert assert_valid(result.out)["notes"] == notes


@pytest.mark.parametrize("path_kind", ["legacy", "safetensors"])
def test_a_refused_inspect_shows_the_notes_after_its_error_line(tmp_path, path_kind):
    """inspect --verify refused (exit 3: --what names a quantity the file does not hold)
    after reading a file that stores no checksums: the table's stderr is the error line,
    then what --verify could not check, as clip's refusals say it; under -q, as -q shows a
    report without its notes, the error line alone."""
    if path_kind == "legacy":
        path = _legacy(tmp_path, "g.pt", 1)
    else:
        path = tmp_path / "g.safetensors"
        path.write_bytes(safetensors_bytes({"w": f32(0, 2)}, struct.pack("<2f", 3.0, 4.0)))
    notes = _verify_notes(path)
    plain = run_cli("inspect", path, "--what", "exp_avg")
    result = run_cli("inspect", path, "--verify", "--what", "exp_avg")
    assert result.code == plain.code == 3 and not result.out, (result.out, result.err)
    assert str(path) in plain.err
    _said_on_stderr(result, plain, notes)
    quiet = run_cli("inspect", path, "--verify", "--what", "exp_avg", "-q")
    assert quiet.code == 3 and quiet.err_lines == plain.err_lines  # -q: the error line alone


# -- refusals over several inputs keep the notes of those read ------------------------------


def _notes_of(*args: object) -> list[str]:
    """--verify's notes in the JSON report of a run that succeeds: the reference for what a
    refused run over the same inputs says of them."""
    from ..json_schemas import assert_valid

    result = run_cli(*args, "--verify", "--format", "json")
    assert result.code in (0, 1), result.err
    return [n for n in assert_valid(result.out)["notes"] if "--verify" in n]


def _damaged_zip(folder: Path) -> Path:
    """A torch zip that loads (torch.load checks no CRC) but fails --verify (exit 3)."""
    path = folder / "z3.pt"
    torch.save({"grads": {"w": torch.ones(256)}, "step": 3}, path)
    _, offset = _entry_data_offset(path, "data/0")
    _flip(path, offset + 100, bit=3)
    return path


def _weights(folder: Path) -> Path:
    """A legacy torch file of a model's weights: with gradients beside it, a mix of kinds
    (exit 2), read (and noted) before it is refused."""
    path = folder / "w3.pt"
    torch.save(torch.nn.Linear(4, 16).state_dict(), path, _use_new_zipfile_serialization=False)
    return path


def _refused_over_several(command: str, failure: str, folder: Path
                          ) -> tuple[list[object], int, list[str]]:
    """Arguments of a run that reads a legacy torch file and a safetensors file (compare:
    the legacy one alone) under --verify and then is refused; its exit code; the notes it
    must carry, as the runs that succeed over the same inputs word them."""
    a = _legacy(folder, "a1.pt", 1)
    s = folder / "g2.safetensors"
    s.write_bytes(safetensors_bytes({"w": f32(0, 16)}, struct.pack("<16f", *[2.0] * 16)))
    read = [a] if command == "compare" else [a, s]
    before = [n for n in _notes_of(command, a, s) if any(n.startswith(f"{p}: ") for p in read)]
    if failure == "damaged":
        return [command, *read, _damaged_zip(folder)], 3, before
    w = _weights(folder)
    return [command, *read, w], 2, before + _notes_of("trend", w, "--what", "weights")


_SEVERAL = [("trend", "damaged"), ("trend", "mixed"), ("compare", "damaged"),
            ("compare", "mixed"), ("autopsy", "damaged")]


@pytest.mark.parametrize("format", _FORMATS)
@pytest.mark.parametrize("command, failure", _SEVERAL)
def test_a_refusal_over_several_inputs_keeps_the_notes_of_those_read(tmp_path, command,
                                                                     failure, format):
    """trend, compare and autopsy refused (exit 2 or 3) at an input after others were read
    under --verify still say what --verify could not check in each input read (the one
    refused included): the same notes a run over them that succeeds gives, each once, in
    every format; the table as note lines after its one error line."""
    import xml.etree.ElementTree as ET

    from ..json_schemas import assert_valid

    args, code, notes = _refused_over_several(command, failure, tmp_path)
    assert notes and len(notes) == len(set(notes)), notes
    result = run_cli(*args, "--verify", "--format", format)
    assert result.code == code, result.err
    error = result.err_lines[0]
    assert error.startswith("gradclip: ") and str(args[-1]) in error, result.err
    if format == "table":
        assert result.err_lines == [error] + [f"gradclip: note: {n}" for n in notes]
        assert not result.out
        return
    assert result.err_lines == [error]  # the document carries the notes
    if format == "json":
        document = assert_valid(result.out)
        assert document["exit_code"] == code and f"gradclip: {document['error']}" == error
        assert document["notes"] == notes
    elif format == "github":
        shown = [line.split("::", 2)[2] for line in result.out.splitlines()
                 if line.startswith("::notice ")]
        assert shown == notes, result.out
    elif format == "junit":
        texts = [e.text or "" for e in ET.fromstring(result.out).iter("system-out")]
        assert "\n".join(texts).splitlines() == [f"note: {n}" for n in notes], result.out
    else:  # markdown: one item each, escaped as markdown escapes (a backslash before)
        shown = [line[2:] for line in result.out.splitlines() if line.startswith("- ")]
        assert [line.replace("\\", "") for line in shown] == notes, result.out
        assert not any("\\" in n for n in notes)  # so the unescaping above is exact


def _adam_states(folder: Path, steps: int) -> list[Path]:
    """Legacy torch files of a model and its Adam state after steps 1..``steps``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    paths = []
    for step in range(1, steps + 1):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        paths.append(folder / f"s{step}.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   paths[-1], _use_new_zipfile_serialization=False)
    return paths


@pytest.mark.parametrize("format", ["table", "json"])
def test_inspect_previous_says_what_verify_could_not_check_in_both_files(tmp_path, format):
    """inspect --previous PREV --verify reads two files: the report says what --verify could
    not check in each (PREV's was left out), and a refusal of the pair (steps 1 and 3: not
    consecutive, exit 3) says it of both too."""
    from ..json_schemas import assert_valid

    s1, s2, s3 = _adam_states(tmp_path, 3)
    pair = ["--what", "grads", "--verify", "--format", "json"]
    done = run_cli("inspect", s2, "--previous", s1, *pair)
    assert done.code == 0, done.err
    shown = [d for d in assert_valid(done.out)["description"] if d.startswith("--verify")]
    assert shown == _verify_notes(s2) + _verify_notes(s1)
    notes = _verify_notes(s3) + _verify_notes(s1)
    plain = run_cli("inspect", s3, "--previous", s1, "--what", "grads", "--format", format)
    result = run_cli("inspect", s3, "--previous", s1, "--what", "grads", "--verify",
                     "--format", format)
    assert result.code == plain.code == 3, result.err
    if format == "json":
        assert assert_valid(result.out)["notes"] == notes
        assert result.err_lines == plain.err_lines
    else:
        _said_on_stderr(result, plain, notes)
