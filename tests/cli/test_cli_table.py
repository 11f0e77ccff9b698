"""The table a person reads: groups, verdict, top tensors, non-finite names, plain in pipes."""

from __future__ import annotations

import io
import math

import pytest
import torch

import gradclip_cli.cli as cli_module
import gradclip_cli.commands.common as common_module
import gradclip_cli.progress as progress_module

from .support import verdict

ANSI = "\x1b["


def test_groups_and_ok_verdict(gradclip, grads_file, grads):
    result = gradclip("inspect", grads_file)
    assert result.code == 0
    for group in (
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.2",
        "transformer.ln_f",
    ):
        assert group in result.out
    assert verdict(result.out).startswith("OK")
    assert "FAIL" not in result.out
    assert result.err == ""


def test_exceeded_verdict_is_fail(gradclip, grads_file):
    result = gradclip("inspect", grads_file, "--max-norm", "1")
    assert result.code == 1
    line = verdict(result.out)
    assert line.startswith("FAIL") and "--max-norm" in line
    assert result.err == ""


def test_nonfinite_verdict_names_the_tensors(gradclip, tmp_path, grads):
    grads["transformer.h.1.mlp.c_fc.weight"][0, 0] = math.nan
    grads["transformer.h.2.attn.c_attn.bias"][3] = -math.inf
    path = tmp_path / "bad.pt"
    torch.save({"grads": grads}, path)
    result = gradclip("inspect", path, "--top", "0")
    assert result.code == 1
    assert verdict(result.out).startswith("FAIL")
    assert "transformer.h.1.mlp.c_fc.weight" in result.out
    assert "transformer.h.2.attn.c_attn.bias" in result.out
    allowed = gradclip("inspect", path, "--allow-nonfinite", "--top", "0")
    assert allowed.code == 0
    assert verdict(allowed.out).startswith("OK")
    assert "transformer.h.1.mlp.c_fc.weight" in allowed.out  # still named


@pytest.mark.parametrize("top", [1, 2, 3])
def test_top_k_tensors(gradclip, tmp_path, top):
    # One layer group ("net"), so tensor names show only in the top-K list.
    names = ["net.small.w", "net.big.w", "net.mid.w", "net.tiny.w"]
    norms = [1.0, 100.0, 10.0, 0.1]
    path = tmp_path / "g.pt"
    torch.save({n: torch.tensor([v]) for n, v in zip(names, norms)}, path)
    result = gradclip("inspect", path, "--top", top, "--group-by", "depth:1")
    assert result.code == 0
    by_size = [n for _, n in sorted(zip(norms, names), reverse=True)]
    for name in by_size[:top]:
        assert name in result.out
    for name in by_size[top:]:
        assert name not in result.out


def test_no_ansi_when_stdout_is_not_a_terminal(gradclip, tmp_path, grads, monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLORTERM", "truecolor")
    grads["transformer.h.0.mlp.c_fc.weight"][0, 0] = math.nan
    path = tmp_path / "g.pt"
    torch.save({"grads": grads}, path)
    for args in ((path,), (path, "--allow-nonfinite"), (path, "--max-norm", "1")):
        result = gradclip("inspect", *args)
        assert ANSI not in result.out and ANSI not in result.err
    result = gradclip("clip", path, "--max-norm", "1", "--allow-nonfinite")
    assert result.code == 0
    assert ANSI not in result.out and ANSI not in result.err


def test_long_names_are_not_cut_in_pipes(gradclip, tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe's width: 120
    name = "model.encoder.layers.17.self_attention.query_key_value_projection.weight"
    path = tmp_path / "g.pt"
    torch.save({name: torch.ones(3)}, path)
    result = gradclip("inspect", path, "--group-by", "tensor")
    assert name in result.out


def test_clip_table(gradclip, grads_file):
    result = gradclip("clip", grads_file, "--max-norm", "1")
    assert result.code == 0
    assert "grads.clipped.pt" in result.out
    assert result.err == ""


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def slow_load(monkeypatch, seconds: float) -> None:
    real = common_module.open_checkpoint

    def load(*args, **kwargs):
        import time

        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(common_module, "open_checkpoint", load)


def test_quiet_draws_no_progress_even_on_a_terminal(grads_file, monkeypatch, capsys):
    """With stderr a terminal and a slow run, progress shows; --quiet silences it."""
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)
    slow_load(monkeypatch, 0.3)
    for quiet, expect_progress in ((False, True), (True, False)):
        fake = FakeTerminal()
        monkeypatch.setattr("sys.stderr", fake)
        args = ["inspect", str(grads_file), "--format", "json"] + (["--quiet"] if quiet else [])
        with pytest.raises(SystemExit) as exit_:
            cli_module.main(args)
        assert exit_.value.code == 0
        assert bool(fake.getvalue()) == expect_progress, (quiet, fake.getvalue()[:200])
    capsys.readouterr()


def test_no_progress_when_stderr_is_not_a_terminal(gradclip, grads_file, monkeypatch):
    monkeypatch.setattr(progress_module, "DELAY_S", 0.0)
    slow_load(monkeypatch, 0.3)
    result = gradclip("inspect", grads_file)
    assert result.code == 0 and result.err == ""
    result = gradclip("clip", grads_file, "--max-norm", "1", "--format", "json")
    assert result.code == 0 and result.err == ""
