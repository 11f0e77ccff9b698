"""OLMo-core checkpoints: ``stepN/`` as the trainer's ``Checkpointer.save`` writes it.

``olmo_core.train.checkpoint.Checkpointer`` writes, per step:

* ``.metadata.json``: ``{"ephemeral": ..., "version": ...}``;
* ``train/rankR.pt``: the trainer's ``state_dict()`` per rank
  (``global_step``, tokens seen, the data loader's position, and the
  Python, numpy, torch and CUDA RNG states);
* ``model_and_optim/``: a DCP folder written through OLMo-core's own storage
  writer (its ``_StorageInfo`` records the same three fields as DCP's and is
  read as DCP's), holding the train module's state dict: the model under
  ``model`` (``model.<fqn>``) and the optimizer flattened by parameter name
  under ``optim`` (``optim.state.<fqn>.exp_avg``, ``optim.param_groups.<fqn>.lr``:
  ``get_optimizer_state_dict`` with ``flatten_optimizer_state_dict``).

Recognised by content: a folder holding ``.metadata.json``, ``train/`` and
``model_and_optim/.metadata``. ``train/`` or one of its files given alone is
refused naming the checkpoint's folder (``train_state_alone``): the trainer's
state holds no tensor gradclip measures. The step is ``global_step`` of
``train/rank0.pt``, read from its pickle's opcodes without unpickling (the
numpy RNG state would need numpy's reconstructors: ``files/pickle_scan``),
else the folder's ``stepN`` name.
"""

from __future__ import annotations

import os
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import roles
from gradclip_cli.source.files.dcp_metadata import METADATA_NAME
from gradclip_cli.source.files.pickle_scan import top_level_int
from gradclip_cli.source.interface import Contents

from . import dcp_folder
from . import dcp_frameworks as frameworks
from .draft import Draft
from .facts import FILES, Found, NoGradients, wording
from .paths import inside, read_json

KIND = "olmo-core"
_JSON, _TRAIN, _DCP = ".metadata.json", "train", "model_and_optim"
_SAID = "an OLMo-core checkpoint"


def recognises(path: Path) -> bool:
    return (
        os.path.isdir(path)
        and os.path.isfile(path / _JSON)
        and os.path.isdir(path / _TRAIN)
        and os.path.isfile(path / _DCP / METADATA_NAME)
    )


def train_state_alone(path: Path) -> str | None:
    """Why ``stepN/train/`` or a file in it, given alone, is not measured: the trainer's
    state per rank (step, data position, RNG states), no weights or optimizer state. None
    for any other path."""
    train = path if os.path.isdir(path) else path.parent
    step = train.parent
    if train.name != _TRAIN or not recognises(step):
        return None
    return (f"{path}: the trainer's state of the OLMo-core checkpoint {step} (its step, data "
            "position and RNG states), which holds no weights or optimizer state; give the "
            f"checkpoint folder: {step}")


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    frameworks.refuse_key(path, key, "an OLMo-core checkpoint")
    stated = read_json(inside(path, _JSON, named_by=path), what="OLMo-core checkpoint metadata")
    if not isinstance(stated, dict):
        raise InputError(f"{path / _JSON}: not OLMo-core checkpoint metadata: not an object")
    dcp_path = inside(path, _DCP, named_by=path)
    folder = dcp_folder.read_folder(dcp_path, verify=verify, trust_pickle=trust_pickle)
    train = inside(path, f"{_TRAIN}/rank0.pt", named_by=path)
    contents = Draft(
        path=path,
        kind=KIND,
        files=[path / _JSON, train, *folder.files],
        index=folder.metadata_file,
        folder=dcp_path,
        trusted_pickle=folder.trusted,
    )
    weights = {
        str(p[1]): dcp_folder.renamed(folder.tensors[k], str(p[1]))
        for k, p in folder.paths.items()
        if len(p) == 2 and p[0] == "model" and k in folder.tensors
    }
    contents.weights = weights or None
    said = f"{_JSON} and {_DCP}/'s"
    found = [Found(roles.WEIGHT, FILES, (f"{said} model entries",), _SAID)]
    optimizer = frameworks.fqn_optimizer(
        folder, {k: str(p[1]) for k, p in folder.paths.items() if len(p) == 2 and p[0] == "optim"}
    )
    if optimizer is not None:
        contents.optimizers.append(optimizer)
        found.append(Found(roles.OPTIMIZER_STATE, FILES, (f"{said} optim entries",), _SAID))
    contents.step = _step(path, train)
    contents.say(wording(*found, NoGradients(path, _SAID, (
        "model and optimizer state", "trainer state"))))
    version = stated.get("version")
    made = f" (OLMo-core {visible(str(version))})" if isinstance(version, str) else ""
    contents.description.append(
        f"OLMo-core checkpoint{made} at step {contents.step}: {len(weights)} model tensors, "
        f"optimizer state for {len(optimizer.state) if optimizer else 0} parameters; "
        f"{len(folder.files) - 1} DCP files"
    )
    return contents.finish()


def _step(path: Path, train: Path) -> int | None:
    """``global_step`` of ``train/rank0.pt`` (its opcodes, not unpickled), else the name's N."""
    if not os.path.isfile(train):
        raise InputError(
            f"{train}: missing: an OLMo-core checkpoint keeps the trainer's state there"
        )
    step = top_level_int(train, "global_step")
    return step if step is not None else frameworks.step_folder_number(path, "step")
