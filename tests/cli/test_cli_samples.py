"""Every committed sample checkpoint inspects with the exit code sample_checkpoints/README.md
claims, read from the README itself so that the two cannot drift apart."""

from __future__ import annotations

import re

import pytest
import torch

from .support import SAMPLES, load_safetensors, ref_norm, rel_err, verdict

ROW = re.compile(r"^\|\s*`(?P<file>[^`]+)`\s*\|.*\|\s*(?P<claim>[^|]*?)\s*\|\s*$")
VARIANT = re.compile(r"(?:(?P<code>\d+) with|also with) `(?P<flags>[^`]+)`")


def readme_claims() -> list[tuple[str, list[str], int]]:
    """(file, extra flags, exit code) for every claim in the README's table."""
    claims = []
    for line in (SAMPLES / "README.md").read_text().splitlines():
        match = ROW.match(line)
        if not match or match["file"] == "file":
            continue
        claim = match["claim"]
        default = int(re.match(r"\d+", claim)[0])
        claims.append((match["file"], [], default))
        for variant in VARIANT.finditer(claim):
            code = int(variant["code"]) if variant["code"] else default
            claims.append((match["file"], variant["flags"].split(), code))
    return claims


CLAIMS = readme_claims()


def test_readme_covers_every_committed_sample():
    committed = {p.name for p in SAMPLES.iterdir() if p.suffix not in (".md", ".py")}
    assert committed and committed == {file for file, _, _ in CLAIMS}
    # The variants the README spells out are parsed, not silently dropped.
    assert ("exploding.pt", ["--max-norm", "100"], 1) in CLAIMS
    assert ("nonfinite.pt", ["--allow-nonfinite"], 0) in CLAIMS
    assert ("healthy.pt", ["--max-norm", "100"], 0) in CLAIMS


@pytest.mark.parametrize(
    ("file", "flags", "code"), CLAIMS, ids=[f"{f}{''.join(x)}" for f, x, _ in CLAIMS]
)
def test_sample_exit_code(gradclip, file, flags, code):
    path = SAMPLES / file
    result = gradclip("inspect", path, *flags)
    assert result.code == code, result.out + result.err
    json_result = gradclip("inspect", path, "--format", "json", *flags)
    assert json_result.code == code
    doc = json_result.json()
    assert doc["status"] == ("ok" if code == 0 else doc["status"])
    assert verdict(result.out).startswith("OK" if code == 0 else "FAIL")


def sample_grads(file: str) -> dict[str, torch.Tensor]:
    path = SAMPLES / file
    if path.suffix == ".safetensors":
        return load_safetensors(path)[0]
    loaded = torch.load(path, weights_only=True)
    return loaded["grads"] if "grads" in loaded else loaded


@pytest.mark.parametrize(
    "file",
    [
        "healthy.pt",
        "exploding.pt",
        "bf16.pt",
        "training_state.pt",
        "healthy.safetensors",
        "flat_legacy.pt",
    ],
)
def test_sample_totals_match_reference(gradclip, file):
    doc = gradclip("inspect", SAMPLES / file, "--format", "json").json()
    assert rel_err(doc["total_norm"], ref_norm(sample_grads(file).values(), 2)) <= 1e-6


def test_nonfinite_sample_counts(gradclip):
    doc = gradclip("inspect", SAMPLES / "nonfinite.pt", "--format", "json").json()
    assert doc["nonfinite"] == {"nan": 3, "posinf": 1, "neginf": 1}
    rows = {t["name"]: t["nonfinite"] for t in doc["tensors"]}
    assert rows["transformer.h.0.mlp.c_fc.weight"] == {"nan": 3, "posinf": 0, "neginf": 0}
    assert rows["transformer.h.1.attn.c_proj.weight"] == {"nan": 0, "posinf": 1, "neginf": 1}


def test_training_state_clip_round_trip(gradclip, tmp_path):
    out = tmp_path / "state.clipped.pt"
    result = gradclip("clip", SAMPLES / "training_state.pt", "--max-norm", "1", "-o", out)
    assert result.code == 0, result.err
    state = torch.load(out, weights_only=True)
    model = state["model"]
    assert model["lm_head.weight"].data_ptr() == model["transformer.wte.weight"].data_ptr()
    total = ref_norm(sample_grads("training_state.pt").values(), 2)
    assert rel_err(ref_norm(state["grads"].values(), 2), total * min(1, 1 / (total + 1e-6))) <= 1e-6
