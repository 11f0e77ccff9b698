"""Helpers for the hardening tests: an in-process CLI runner and file surgery."""

from __future__ import annotations

import contextlib
import io
import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gradclip_cli.cli import main
from tests.cli.support import assert_no_report


@dataclass
class Outcome:
    code: object
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def run_cli(*args: object) -> Outcome:
    """``gradclip ARGS`` in this process; a traceback escaping main() is re-raised."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exit_:
            code = exit_.code
        else:
            code = "returned without sys.exit"
    return Outcome(code, out.getvalue(), err.getvalue())


def assert_refused(result: Outcome, path: Path, *words: str) -> str:
    """Exit 3, exactly one stderr line naming the file, no traceback, nothing on stdout."""
    assert result.code == 3, (result.code, result.err)
    assert len(result.err_lines) == 1, result.err
    line = result.err_lines[0]
    assert str(path) in line, line
    assert "Traceback" not in result.err
    for word in words:
        assert word in line, line
    assert_no_report(result)
    return line


def assert_clean_inspect(result: Outcome, path: Path) -> None:
    """The fuzz invariant: exit 0/1 with JSON, or exit 3 with one line. Nothing else."""
    assert "Traceback" not in result.err, result.err
    if result.code in (0, 1):
        doc = json.loads(result.out)
        assert doc["schema"] == "gradclip.inspect/1"
    else:
        assert result.code == 3, (result.code, result.err)
        assert len(result.err_lines) == 1, result.err
        assert str(path) in result.err_lines[0], result.err
        assert_no_report(result)


def rewrite_zip(source: Path, target: Path, edits: dict) -> None:
    """Copy a torch zip entry by entry; ``edits`` maps a name suffix to bytes -> bytes."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            for suffix, edit in edits.items():
                if info.filename.endswith(suffix):
                    data = edit(data)
            dst.writestr(info.filename, data)


def safetensors_bytes(header: dict, buffer: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + buffer


def f32(begin: int, count: int) -> dict:
    return {"dtype": "F32", "shape": [count], "data_offsets": [begin, begin + 4 * count]}
