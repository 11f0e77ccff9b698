"""Fixtures for the end-to-end CLI tests: an in-process runner and small checkpoints."""

from __future__ import annotations

import pytest
import torch

from gradclip_cli.cli import main

from .support import Result, gpt_like_grads


@pytest.fixture
def gradclip(capsys, monkeypatch):
    """Run ``gradclip ARGS`` in this process; returns the exit code and both streams."""
    for var in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE"):
        monkeypatch.delenv(var, raising=False)

    def run(*args: object) -> Result:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
        except SystemExit as exit_:
            code = exit_.code
        else:
            pytest.fail("gradclip's main() returned without sys.exit")
        out, err = capsys.readouterr()
        assert isinstance(code, int), f"exit code {code!r} is not an int"
        return Result(code, out, err)

    return run


@pytest.fixture
def grads() -> dict[str, torch.Tensor]:
    return gpt_like_grads()


@pytest.fixture
def grads_file(tmp_path, grads):
    """``{"grads": {...}, "step": 7}`` saved with torch.save (zip format)."""
    path = tmp_path / "grads.pt"
    torch.save({"grads": grads, "step": 7}, path)
    return path
