"""NeMo 2 checkpoints: a folder holding ``weights/`` (Megatron ``torch_dist``) and ``context/``.

NeMo 2's ``ModelCheckpoint`` (``nemo.lightning``, nemo-toolkit 2.7.3) saves each checkpoint
as a folder named from its metrics (``<name>--reduced_train_loss=4.15-epoch=0-
consumed_samples=6.0/``), holding:

* ``weights/``: written by NeMo's ``MegatronCheckpointIO`` through Megatron-core's
  ``dist_checkpointing.save``: a Megatron ``torch_dist`` folder (``.metadata``,
  ``__R_N.distcp``, ``common.pt``, ``metadata.json``; ``megatron`` states its rules), the
  model's tensors under NeMo's ``module.`` prefix (``module.decoder.layers.mlp.linear_fc1
  .weight``, stacked by layer and split here into one tensor per layer) and the optimizer's
  moments as ``optimizer.state.exp_avg.module.<name>``. Its ``common.pt`` is Lightning's
  checkpoint dict: ``global_step`` (the step), ``optimizer`` a list of one optimizer's
  param groups and ``state.common_step``, and the callbacks' state, whose
  ``ModelCheckpoint`` entry pickles its folder as a ``pathlib.PosixPath``: read as its text,
  inert, nothing of ``pathlib`` called;
* ``context/``: NeMo's ``TrainerContext`` ``io_dump`` (``io.json``: the model, trainer
  and data module as Fiddle configs; ``model.yaml``), which says how to rebuild the model
  and which gradclip only checks to be a JSON object.

A checkpoint saved at the end of training with ``save_optim_on_train_end`` False holds
the weights only: measured as weights, the optimizer's quantities refused saying so.

Recognised by content, before ``megatron``: a folder whose ``weights/`` is a ``torch_dist``
folder beside ``context/io.json``, or such a ``weights/`` folder itself (read as its
checkpoint). Read by ``megatron.open_dist_ckpt`` under this layout's kind and title.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path, PurePosixPath

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.weights_pickle import Outside, allowing
from gradclip_cli.source.interface import Contents

from . import dcp_frameworks as frameworks
from .megatron import open_dist_ckpt
from .megatron.tracker import is_dist_ckpt
from .paths import inside, read_json

KIND = "nemo"
TITLE = "NeMo 2 checkpoint"
_WEIGHTS, _CONTEXT = "weights", "context"
_IO = f"{_CONTEXT}/io.json"


def recognises(path: Path) -> bool:
    if not os.path.isdir(path):
        return False
    return _is_checkpoint(path) or (path.name == _WEIGHTS and _is_checkpoint(path.parent))


def _is_checkpoint(path: Path) -> bool:
    return is_dist_ckpt(path / _WEIGHTS) and os.path.isfile(path / _IO)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    frameworks.refuse_key(path, key, "a NeMo 2 checkpoint")
    if not _is_checkpoint(path):  # its weights/ given: the checkpoint is the folder above
        path = path.parent
    io = inside(path, _IO, named_by=path)
    if not isinstance(read_json(io, what="NeMo 2 training context"), dict):
        raise InputError(f"{io}: not NeMo's training context: not a JSON object")
    with allowing(_INERT):
        contents = open_dist_ckpt(
            path, inside(path, _WEIGHTS, named_by=path), None, kind=KIND, title=TITLE,
            trust_pickle=trust_pickle, verify=verify,
        )
    return replace(contents, files=(io, *contents.files))


def _path_text(*parts) -> str:
    """A pickled ``pathlib.PosixPath`` (``PosixPath(*parts)``) as its text: plain strings
    only, joined as pathlib joins them."""
    if not parts or any(type(p) is not str for p in parts):
        raise Outside("pathlib.PosixPath arguments are not strings",
                      culprit="pathlib.PosixPath with what its inert stand-in does not take")
    return str(PurePosixPath(*parts))


_INERT = {("pathlib", "PosixPath"): _path_text}
