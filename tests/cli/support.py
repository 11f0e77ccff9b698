"""Shared helpers for the end-to-end CLI tests: running gradclip, building files, references.

Every number a test compares against comes from :func:`ref_norm` (float64, scaled by the
largest magnitude so it neither overflows nor underflows), never from gradclip itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.safetensors_files import save_safetensors  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_checkpoints"

INSPECT_KEYS = {
    "schema", "source", "norm_type", "total_norm", "max_abs", "num_tensors", "num_elements",
    "nonfinite", "status", "groups", "tensors",
}  # fmt: skip
GROUP_KEYS = {"name", "norm", "max_abs", "num_tensors", "num_elements", "nonfinite"}
TENSOR_KEYS = {"name", "group", "shape", "dtype", "norm", "max_abs", "nonfinite"}
CLIP_KEYS = {
    "schema", "source", "output", "norm_type", "max_norm", "total_norm_before", "clip_coef",
    "total_norm_after", "clipped",
}  # fmt: skip
NONFINITE_KEYS = {"nan", "posinf", "neginf"}


@dataclass
class Result:
    """What a user sees: the exit code and the two streams."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


# The table's prose (header details, notes, the verdict) wraps between words
# to the width, continuing with this indent (format/fitting.py ``wrap``).
WRAP_INDENT = "  "


def logical_lines(text: str) -> list[str]:
    """The table's lines as written before wrapping: a continuation (a line that starts with
    the wrap indent) is joined to the line above with one space.

    Where a line breaks depends on the width and on what else it holds (a
    temporary path's length), never on what it says: assert on these lines.
    """
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith(WRAP_INDENT) and lines:
            lines[-1] = f"{lines[-1]} {line.strip()}"
        else:
            lines.append(line)
    return lines


def unwrapped(text: str) -> str:
    """``text`` with every wrapped line joined back (``logical_lines``)."""
    return "\n".join(logical_lines(text))


def verdict(text: str) -> str:
    """The table's last line, the verdict, unwrapped."""
    return [line for line in logical_lines(text) if line.strip()][-1]


def run_process(*args: object, cwd: Path | None = None, env: dict | None = None) -> Result:
    """``python -m gradclip_cli ARGS`` in a real process, stdout and stderr piped."""
    full_env = {**os.environ, **(env or {})}
    for var in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE"):
        full_env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "gradclip_cli", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, env=full_env, timeout=600,
    )  # fmt: skip
    return Result(proc.returncode, proc.stdout, proc.stderr)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def load_dcp(folder: Path, out: Path) -> dict:
    """A DCP folder's whole state dict as torch's own reader reassembles it (saved to
    ``out`` by ``dcp_to_torch_save``, loaded back): the reference, never gradclip."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


def ref_norm(tensors, p: float) -> float:
    """The p-norm of all elements as one vector, in float64, scaled by the largest |x|."""
    flat = [t.detach().to("cpu", torch.float64).reshape(-1) for t in tensors]
    x = torch.cat(flat).abs() if flat else torch.zeros(0, dtype=torch.float64)
    if x.numel() == 0:
        return 0.0
    top = float(x.max())
    if math.isinf(p):
        return top
    if top == 0.0:
        return 0.0
    if p == 1:
        return math.fsum(x.tolist())
    return top * float(((x / top) ** p).sum()) ** (1.0 / p)


def rel_err(actual: float, expected: float) -> float:
    if expected == 0:
        return abs(actual)
    return abs(actual - expected) / abs(expected)


def as_float(value: float | str) -> float:
    """A JSON number as the contract writes it: non-finite values are strings."""
    if isinstance(value, str):
        assert value in ("nan", "inf", "-inf"), value
        return float(value)
    assert isinstance(value, (int, float)) and not isinstance(value, bool), value
    return float(value)


def nonfinite_counts(tensors) -> dict[str, int]:
    counts = {"nan": 0, "posinf": 0, "neginf": 0}
    for t in tensors:
        t = t.detach().float()
        counts["nan"] += int(t.isnan().sum())
        counts["posinf"] += int((t == math.inf).sum())
        counts["neginf"] += int((t == -math.inf).sum())
    return counts


def gpt_like_grads(seed: int = 0, layers: int = 3) -> dict[str, torch.Tensor]:
    """Gradients with real-looking GPT-2 names and different magnitudes per layer."""
    g = torch.Generator().manual_seed(seed)
    grads = {
        "transformer.wte.weight": torch.randn(32, 8, generator=g),
        "transformer.wpe.weight": torch.randn(8, 8, generator=g) * 0.5,
    }
    for i in range(layers):
        scale = 10.0**i
        grads[f"transformer.h.{i}.attn.c_attn.weight"] = torch.randn(24, 8, generator=g) * scale
        grads[f"transformer.h.{i}.attn.c_attn.bias"] = torch.randn(24, generator=g) * scale
        grads[f"transformer.h.{i}.mlp.c_fc.weight"] = torch.randn(32, 8, generator=g) * scale
    grads["transformer.ln_f.weight"] = torch.randn(8, generator=g) * 0.1
    return grads


def assert_no_report(result) -> None:
    """A failed run prints no report: stdout is empty, or (``--format json``) holds just
    the contract's one ``gradclip.error/1`` object with the run's exit code."""
    if result.out == "":
        return
    assert result.out.count("\n") == 1 and result.out.endswith("\n"), result.out
    doc = json.loads(result.out)
    assert doc["schema"] == "gradclip.error/1", doc
    assert doc["exit_code"] == result.code, (doc, result.code)
    assert doc["error"] and "\n" not in doc["error"], doc


def assert_quantities_refused(gradclip, path, kind: str, reasons: dict[str, str],
                              available: str = "--what weights") -> None:
    """``inspect --what W`` on ``path`` is exit 3 with one line naming ``kind`` and the
    reason for each W, offering ``available``."""
    for what, why in reasons.items():
        result = gradclip("inspect", path, "--what", what)
        assert result.code == 3
        line = result.err_lines[0]
        assert f"--what {what}: {kind}: {why}" in line, line
        assert line.endswith(f"available: {available}"), line


def suggestions(err: str) -> list[list[str]]:
    """The flags a refusal offers: ``--what X`` from "available:", ``--key K`` candidates."""
    out = []
    if "available: " in err:
        offered = err.split("available: ", 1)[1].strip()
        if offered != "nothing gradclip measures":
            out += [w.split() for w in offered.split(", ")]
    if "candidates for --key: " in err:
        listed = err.split("candidates for --key: ", 1)[1].split(";")[0].strip()
        out += [["--key", k.split(" (")[0]] for k in listed.split(", ")]
    return out


def walk_refusals(gradclip, paths, out) -> tuple[int, int]:
    """Every refusal of inspect and clip over ``paths`` (each --what): each flag it offers
    is followed and must succeed and measure what it says; clip never offers weights or
    optimizer state. ``--what auto`` picks as the contract says: grads where ``--what
    grads`` works, else exp_avg where it works, else weights. Returns (refusals met,
    suggestions followed)."""
    refusals = followed = 0
    writes = iter(range(1_000_000))

    def output(path) -> Path:  # a fresh one each time: a clip never meets an earlier output
        folder = Path(out) / f"walk{next(writes)}"
        folder.mkdir()
        return folder / f"clipped{Path(path).suffix}"

    for path in paths:
        for command in ("inspect", "clip"):
            codes = {}
            for what in (None, "grads", "exp_avg", "grad_rms", "update", "weights"):
                if command == "clip" and what not in (None, "grads"):
                    continue
                args = [command, path, *(("--what", what) if what else ())]
                if command == "clip":
                    args += ["--max-norm", "1", "-o", output(path)]
                result = gradclip(*args, "--format", "json")
                codes[what] = result.code
                if command == "inspect" and result.code in (0, 1):
                    codes[what] = result.json()["what"]
                if result.code != 3:
                    continue
                refusals += 1
                assert "Traceback" not in result.err and len(result.err_lines) == 1
                for flags in suggestions(result.err):
                    if command == "clip":
                        assert flags[0] == "--key", result.err  # never --what weights/moments
                        args[-1] = output(path)
                    base = args[:2] + args[4:] if flags[0] == "--what" and what else args
                    done = gradclip(*base, *flags, "--format", "json")
                    assert done.code in (0, 1), (result.err, flags, done.err)
                    if command == "inspect":
                        said = flags[1] if flags[0] == "--what" else what or "grads"
                        assert done.json()["what"] == said, (path, args, flags)
                    followed += 1
            if command == "clip":
                assert codes[None] == codes["grads"], (path, codes)
                continue
            works = [w for w in ("grads", "exp_avg", "weights") if codes[w] == w]
            assert codes[None] == (works[0] if works else 3), (path, codes)
    return refusals, followed
