"""What other libraries say while gradclip reads through them stays off its stderr (issue 41, 10).

A Trainer checkpoint's parameter order is rebuilt from ``config.json`` with
transformers; a config that another version of transformers wrote (here:
``num_labels`` against a shorter ``id2label``, which transformers logs a
warning about) must not put transformers' log lines on gradclip's stderr.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings

import pytest

from gradclip_cli.source.foreign import silenced

from .support import as_float, rel_err
from .test_cli_trend import checkpointed_run, optimizer_reference  # noqa: F401 (fixture)


def test_inspect_of_a_trainer_checkpoint_prints_no_transformers_warning(
        gradclip, checkpointed_run, tmp_path):  # noqa: F811
    pytest.importorskip("transformers")
    step = checkpointed_run.steps
    folder = tmp_path / f"checkpoint-{step}"
    shutil.copytree(checkpointed_run.output_dir / f"checkpoint-{step}", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update({"num_labels": 3, "id2label": {"0": "a", "1": "b"}})
    (folder / "config.json").write_text(json.dumps(config))
    r = gradclip("inspect", folder, "-q")
    assert r.code == 0 and r.err == "", r.err
    assert r.out.startswith("OK: AdamW exp_avg total norm ")
    doc = gradclip("inspect", folder, "--format", "json").json()
    assert rel_err(as_float(doc["total_norm"]),
                   optimizer_reference(checkpointed_run, step, "exp_avg")["total"]) < 1e-6


def test_silenced_puts_every_level_back(caplog):
    logger = logging.getLogger("gradclip.test.foreign")
    logger.setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with silenced("gradclip.test.foreign"):
            logger.error("not shown")
            logging.getLogger("gradclip.test.foreign.child").warning("nor this")
            warnings.warn("nor this warning", stacklevel=1)
        logger.info("shown")
    assert [r.getMessage() for r in caplog.records] == ["shown"]
    assert seen == [] and logger.level == logging.INFO
