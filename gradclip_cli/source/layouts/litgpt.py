"""litgpt checkpoint folders: ``out/pretrain/step-NNNNNNNN/`` and its exports.

litgpt's ``pretrain.save_checkpoint`` writes, at every ``save_interval``,
``<out_dir>/step-{step_count:08d}/``:

* ``lit_model.pth``: ``fabric.save`` of the training state: ``model`` (its
  state dict), ``optimizer`` (the optimizer's ``state_dict()``), ``iter_num``
  (micro-batches seen) and ``step_count`` (optimizer steps);
* ``model_config.yaml`` (the model's ``Config``), ``hyperparameters.yaml``
  and the tokenizer's files when it was given one.

Its weight exports (``convert_hf_checkpoint``, ``merge_lora``, a finetune's
``final/``) write ``lit_model.pth`` as the model's state dict alone, beside
``model_config.yaml``. Recognised by content: a folder holding
``lit_model.pth`` and ``model_config.yaml``. The file is read as one
checkpoint file is (``single_file.fill_from_root``: the weights, the optimizer
mapped in the model's order, the step by the vocabulary's rule, which takes
``step_count`` before ``iter_num``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.interface import Contents

from . import single_file
from .draft import Draft
from .paths import member

KIND = "litgpt"
MODEL_FILE, CONFIG_FILE = "lit_model.pth", "model_config.yaml"


def recognises(path: Path) -> bool:
    return (
        os.path.isdir(path)
        and os.path.isfile(path / MODEL_FILE)
        and os.path.isfile(path / CONFIG_FILE)
    )


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    file = member(path, MODEL_FILE)
    ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
    contents = Draft(
        path=path, kind=KIND, files=[file], checkpoint=ckpt, trusted_pickle=ckpt.trusted_pickle
    )
    single_file.fill_from_root(contents, ckpt.root, file, key, metadata=ckpt.metadata)
    root = ckpt.root if isinstance(ckpt.root, Mapping) else {}
    if "model" in root and "optimizer" in root:
        held = "training state (model, optimizer"
        held += ", iter_num, step_count)" if "step_count" in root else ")"
    else:
        held = "the model's weights"
    step = f" at step {contents.step}" if contents.step is not None else ""
    contents.description.append(f"litgpt checkpoint{step}: {MODEL_FILE}, {held}")
    return contents.finish()
