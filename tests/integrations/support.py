"""Shared checks for the monitor tests: float64 references, the log's shape, inspecting dumps.

References never come from gradclip: group norms are float64 sums over every
element of the gradients, grouped by a rule written out here.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from tests.cli.support import as_float, ref_norm

LOG_KEYS = [
    "schema", "step", "total_norm", "norm_type", "groups", "nonfinite", "z", "spike",
    "spike_groups", "dump", "clipped_to", "clip_coef", "dump_skipped",
]  # fmt: skip


def layer_of(name: str) -> str:
    """``--group-by layer`` restated: up to the first all-digit part, else the parent module."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def reference_norms(
    model: torch.nn.Module, p: float = 2.0, only=None
) -> tuple[float, dict[str, float]]:
    """Total and per-layer float64 norms of the model's gradients as they are now
    (of the parameters in ``only`` alone, when given)."""
    by_group: dict[str, list[torch.Tensor]] = {}
    chosen = None if only is None else {id(param) for param in only}
    for name, param in model.named_parameters():
        if param.grad is not None and (chosen is None or id(param) in chosen):
            by_group.setdefault(layer_of(name), []).append(param.grad.detach().clone())
    every = [g for grads in by_group.values() for g in grads]
    return ref_norm(every, p), {g: ref_norm(ts, p) for g, ts in by_group.items()}


def read_log(path: Path) -> list[dict]:
    """Every line of a monitor log, each checked against the log's fixed shape."""
    raw = Path(path).read_bytes()
    assert raw.endswith(b"\n"), "the log must end with a whole line"
    records = []
    for line in raw.decode().split("\n")[:-1]:
        record = json.loads(line)
        assert list(record) == LOG_KEYS, line
        assert record["schema"] == "gradclip.monitor/1"
        assert isinstance(record["step"], int)
        as_float(record["total_norm"])
        assert all(isinstance(k, str) for k in record["groups"])
        for norm in record["groups"].values():
            as_float(norm)
        assert list(record["nonfinite"]) == ["nan", "posinf", "neginf"]
        assert record["z"] is None or isinstance(record["z"], float | int | str)
        assert isinstance(record["spike"], bool)
        assert set(record["spike_groups"]) <= set(record["groups"])
        assert record["dump"] is None or isinstance(record["dump"], str)
        assert (record["clipped_to"] is None) == (record["clip_coef"] is None)
        # A dump is written, or a step that wanted one (a spike, a non-finite
        # gradient) says why not; a calm step neither.
        if record["dump"] is not None or not record["spike"] and not any(
                record["nonfinite"].values()):
            assert record["dump_skipped"] is None, line
        else:
            assert isinstance(record["dump_skipped"], str) and record["dump_skipped"], line
        records.append(record)
    return records


def assert_norms_match(record: dict, total: float, groups: dict[str, float]) -> None:
    """The logged norms equal the float64 reference to 1e-6 relative."""
    assert list(record["groups"]) == list(groups)
    assert math.isclose(as_float(record["total_norm"]), total, rel_tol=1e-6), record
    for name, want in groups.items():
        assert math.isclose(as_float(record["groups"][name]), want, rel_tol=1e-6), (name, record)


def inspect_dump(gradclip, path: Path) -> dict:
    """``gradclip inspect PATH --format json``, through the CLI's entry point."""
    result = gradclip("inspect", path, "--format", "json", "--allow-nonfinite")
    assert result.code == 0, result.err
    return result.json()


def culprit(report: dict) -> str:
    """The group ``inspect`` shows with the largest norm (NaN counts as largest)."""

    def size(group: dict) -> float:
        norm = as_float(group["norm"])
        return math.inf if math.isnan(norm) else norm

    return max(report["groups"], key=size)["name"]


def assert_spike_found(gradclip, folder: Path, spike: dict, culprit_group: str,
                       quiet_group: str, first_step: int) -> None:
    """A framework run's injected spike: flagged, naming ``culprit_group``, and dumped.

    It is the one step flagged (mini-batch noise is not a spike) and the one
    dumped, after the warm-up (25 steps from ``first_step``), and ``gradclip
    inspect`` on its dump must show the culprit.
    """
    assert spike["spike"] and culprit_group in spike["spike_groups"] and spike["z"] > 2.5
    assert quiet_group not in spike["spike_groups"]
    # Unclipped: the monitor measures before the framework (or itself) clips to 1.
    assert spike["total_norm"] > 100
    records = read_log(folder / "grads.jsonl")
    assert [r["step"] for r in records if r["spike"]] == [spike["step"]]
    dumped = [r["step"] for r in records if r["dump"]]
    assert dumped == [spike["step"]] and spike["step"] >= first_step + 25
    assert sorted(os.listdir(folder / "spikes")) == sorted(f"step-{s}.pt" for s in dumped)
    dump = folder / "spikes" / f"step-{spike['step']}.pt"
    assert spike["dump"] == str(dump)
    report = inspect_dump(gradclip, dump)
    assert culprit(report) == culprit_group
    assert math.isclose(report["total_norm"], spike["total_norm"], rel_tol=1e-6)
