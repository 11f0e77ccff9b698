"""A parameter name in a DeepSpeed refusal is shown escaped exactly once.

The files are DeepSpeed's own (``deepspeed_runs.py``), one entry edited with
DeepSpeed's classes loaded, as ``test_deepspeed.py`` edits them. A name that
the layout passed through ``visible`` showed its backslashes doubled again when
the whole line was made visible on stderr and in the failure formats.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gradclip_cli.escaping import visible
from tests.cli.test_cli_errors_escaped_once import HOSTILE
from tests.hardening.support import run_cli

TAG = "global_step2"


def _rename_frozen(root: dict, old: str, new: str, edit=lambda t: t) -> None:
    """``old`` renamed ``new`` wherever the model state file names a frozen parameter."""
    for key in ("frozen_param_shapes", "frozen_param_fragments"):
        root[key] = {(new if k == old else k): (edit(v) if k == old and
                                                 key == "frozen_param_fragments" else v)
                     for k, v in root[key].items()}
    root["module"] = {(new if k == old else k): v for k, v in root["module"].items()}


def test_a_frozen_parameter_name_in_a_zero2_refusal(deepspeed_runs, tmp_path):
    pytest.importorskip("deepspeed")
    run = tmp_path / "run"
    shutil.copytree(deepspeed_runs / "zero2", run)
    file = run / TAG / "mp_rank_00_model_states.pt"
    root = torch.load(file, weights_only=False)
    _rename_frozen(root, "4.weight", HOSTILE, lambda t: t.flatten()[:4].clone())
    torch.save(root, file)
    r = run_cli("inspect", run, "--what", "weights")
    assert r.code == 3, r.err
    line = r.err_lines[-1]
    assert line.endswith(f"frozen_param_fragments gives {visible(HOSTILE)} 4 elements, "
                         "its shape [3, 3]"), line
    doc = json.loads(run_cli("inspect", run, "--what", "weights", "--format", "json").out)
    assert doc["error"] == line.removeprefix("gradclip: ")
