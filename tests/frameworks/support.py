"""What the framework tests share: float64 references from a flattened optimizer state, the
hostile-copy checks, and running a list of commands once alone and once under torchrun."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from tests.cli.support import rel_err
from tests.distributed.launch import same_under_torchrun  # noqa: F401  (the tests import it here)

TOL = 1e-6  # the contract's accuracy; the references are float64
VARIABLE = "GRADCLIP_FRAMEWORKS_PYTHON"


def skip_without_frameworks() -> None:
    """Skip the calling test module, once, when no frameworks venv is named."""
    python = os.environ.get(VARIABLE)
    if not python or not os.access(python, os.X_OK):
        pytest.skip(
            f"{VARIABLE} does not name a python: it names the python of a venv with "
            "torchtitan, ai2-olmo-core, megatron-core, torchtune, litgpt and timm "
            "(.ci/run builds one)",
            allow_module_level=True,
        )


QUANTITIES = ("exp_avg", "grad_rms", "update")


def norm(tensors) -> float:
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm())


def flat_optimizer(flat: dict) -> tuple[dict, dict]:
    """An optimizer state flattened by parameter name (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``) as ``{fqn: state}`` and ``{fqn: hyperparameters}``."""
    state: dict[str, dict] = {}
    hyper: dict[str, dict] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        (state if head == "state" else hyper).setdefault(fqn, {})[name] = value
    return state, hyper


def adam_measured(state: dict, hyper: dict, what: str) -> dict[str, torch.Tensor]:
    """fqn -> the float64 ``exp_avg``, ``grad_rms`` or ``update`` (the contract's formulas)."""
    out = {}
    for fqn, s in state.items():
        h = hyper[fqn]
        beta1, beta2 = h["betas"]
        step = float(s["step"])
        m = s["exp_avg"].double() / (1 - beta1**step)
        v = s["exp_avg_sq"].double() / (1 - beta2**step)
        out[fqn] = {
            "exp_avg": m,
            "grad_rms": v.sqrt(),
            "update": h["lr"] * m / (v.sqrt() + h["eps"]),
        }[what]
    return out


def grouped_optimizer(ref: dict) -> tuple[dict, dict]:
    """A reference's ``state`` and ``groups`` (each naming its ``params``) as ``{name: state}``
    and ``{name: hyperparameters}``, as ``adam_measured`` takes them."""
    return ref["state"], {n: g for g in ref["groups"] for n in g["params"]}


def inspect_json(gradclip, folder: Path, what: str) -> dict:
    """``gradclip inspect FOLDER --what WHAT --format json``, which must succeed."""
    result = gradclip("inspect", folder, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    return result.json()


def matches_reference(doc: dict, expected: dict, weights: dict) -> None:
    """Each tensor's norm and ratio, and the total, within ``TOL`` of the float64 reference
    (``expected`` by name; ``weights``: the loader's weights, for the ratios)."""
    assert rel_err(doc["total_norm"], norm(expected.values())) <= TOL
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([expected[name]])) <= TOL, name
        assert rel_err(row["ratio"], norm([expected[name]]) / norm([weights[name]])) <= TOL, name


def weights_match_reference(doc: dict, weights: dict) -> None:
    """Each weight's norm and shape, and the total, as the loader's ``weights`` give them
    (norms within ``TOL`` of float64)."""
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(weights)
    for name, row in rows.items():
        assert rel_err(row["norm"], norm([weights[name]])) <= TOL, name
        assert tuple(row["shape"]) == tuple(weights[name].shape), name
    assert rel_err(doc["total_norm"], norm(weights.values())) <= TOL


def one_line_exit_3(result, *words: str) -> None:
    assert result.code == 3, (result.code, result.err)
    assert len(result.err_lines) == 1, result.err
    for word in words:
        assert word in result.err, result.err


def rewrite_metadata(folder: Path, change) -> None:
    """Change a real ``.metadata`` with torch's own classes (the test may import them)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(folder).read_metadata()
    change(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


class RunsCode:
    """Pickles as a call to ``os.system``: proof that a refused file ran nothing."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
