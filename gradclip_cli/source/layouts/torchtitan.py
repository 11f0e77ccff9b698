"""torchtitan checkpoints: ``checkpoint/step-N/``, a DCP folder laid out torchtitan's way.

torchtitan's ``CheckpointManager`` (``components/checkpointer/dcp.py``)
saves one state dict with ``dcp.save``: the model's state dict *flattened
into the top level* (``tok_embeddings.weight``, ``layers.0...``: no
``model.`` prefix), beside ``optimizer`` (its ``OptimizersContainer``,
flattened by parameter name: ``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``),
``lr_scheduler``, ``dataloader`` and ``train_state`` (the trainer's
``state_dict()``: ``step`` and ``ntokens_seen``, ints stored as bytes
values). Recognised by content: a DCP folder whose planner records
``train_state.step`` and ``optimizer`` entries of that flattened form.

Its last save is by default a weights-only export (``last_save_model_only``):
the model's state dict alone, in a ``step-N/`` folder. Recognised as that: a
``step-N/`` DCP folder holding nothing but top-level tensors, a model state
dict with no gradient mark; read as weights, its step the folder's number.

torchtitan's fused ``wqkv`` (``FusedQKVLinear``) is trained as one
parameter, so the optimizer names ``...qkv_linear.wqkv.weight``, while the
model's state dict stores ``wq``, ``wk`` and ``wv``. Their weights together
are compared with its moments (``ratio``), see
``dcp_frameworks.fused_weights``.
"""

from __future__ import annotations

import os
from pathlib import Path

from gradclip_cli.errors import InputError, UnsafeCheckpointError
from gradclip_cli.escaping import visible
from gradclip_cli.source import roles
from gradclip_cli.source.files.dcp_metadata import METADATA_NAME
from gradclip_cli.source.interface import Contents

from . import dcp_folder
from . import dcp_frameworks as frameworks
from .draft import Draft
from .facts import FILES, PROOF, Found, NoGradients, wording

KIND = "torchtitan"
_OPTIMIZER, _TRAIN_STATE = "optimizer", "train_state"
_MARKS = (b"train_state", b"optimizer", b"state.")


def recognises(path: Path) -> bool:
    return _kind(path) is not None


def _kind(path: Path) -> str | None:
    """``"full"``, ``"export"`` or None, from the folder's metadata (cached, small)."""
    if not os.path.isdir(path) or not os.path.isfile(path / METADATA_NAME):
        return None
    try:
        meta = dcp_folder.read_metadata(path / METADATA_NAME)
    except UnsafeCheckpointError:
        # Refused as it stands: say so (or open it under --trust-pickle) here when its
        # records name torchtitan's state, rather than as a plain DCP folder.
        return "full" if dcp_folder.names_all(path / METADATA_NAME, _MARKS) else None
    except InputError:
        return None
    return _kind_of(path, meta)


def _kind_of(path: Path, meta) -> str | None:
    paths = {k: tuple(meta.paths.get(k, (k,))) for k in meta.entries}
    if (_TRAIN_STATE, "step") in paths.values() and any(
        len(p) == 2 and p[0] == _OPTIMIZER and str(p[1]).startswith(("state.", "param_groups."))
        for p in paths.values()
    ):
        return "full"
    if (
        frameworks.step_folder_number(path, "step-") is not None
        and paths
        and all(len(p) == 1 for p in paths.values())
        and all(not isinstance(e, str) for e in meta.entries.values())
    ):
        return "export"
    return None


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    frameworks.refuse_key(path, key, "a torchtitan checkpoint")
    folder = dcp_folder.read_folder(path, verify=verify, trust_pickle=trust_pickle)
    kind = _kind_of(path, folder.meta)
    if kind is None:
        raise InputError(
            f"{folder.metadata_file}: not a torchtitan checkpoint: no train_state.step "
            "and optimizer state, nor a step-N/ folder of model tensors alone"
        )
    contents = Draft(
        path=path,
        kind=KIND,
        files=folder.files,
        index=folder.metadata_file,
        folder=path,
        trusted_pickle=folder.trusted,
    )
    weights = {
        k: dcp_folder.renamed(t, k) for k, t in folder.tensors.items() if len(folder.paths[k]) == 1
    }
    contents.weights = weights or None
    if kind == "export":
        export = "a torchtitan weights-only export"
        folder_name = os.path.basename(os.path.normpath(path))
        contents.say(wording(
            Found(roles.WEIGHT, PROOF, (), export, f"{folder_name}/ of model tensors alone"),
            NoGradients(path, f"{export} (a step-N/ folder holding only the model's state "
                        "dict)", ())))
        contents.step = frameworks.step_folder_number(path, "step-")
        contents.description.append(
            f"torchtitan weights-only export at step {contents.step}: {len(weights)} model "
            "tensors, no optimizer state"
        )
        return contents.finish()
    optimizer = frameworks.fqn_optimizer(
        folder,
        {k: str(p[1]) for k, p in folder.paths.items() if len(p) == 2 and p[0] == _OPTIMIZER},
    )
    said, marked = "a torchtitan checkpoint", (".metadata's train_state.step",)
    found = [Found(roles.WEIGHT, FILES, marked, said, "model keys at the top level")]
    if optimizer is not None:
        contents.optimizers.append(optimizer)
        found.append(Found(roles.OPTIMIZER_STATE, FILES, marked, said,
                           "optimizer.state.<fqn> entries"))
    step_key = next(k for k, p in folder.paths.items() if p == (_TRAIN_STATE, "step"))
    contents.step = frameworks.int_value(
        folder.value(step_key), folder.metadata_file, "train_state.step"
    )
    contents.say(wording(*found, NoGradients(path, said, (
        "model", "optimizer", "lr_scheduler", "dataloader", "train_state"))))
    fused, notes = frameworks.fused_weights(optimizer, weights)
    contents.fused_weights = fused
    contents.order = _model_order(list(weights), fused)
    contents.description.append(
        f"torchtitan checkpoint at step {contents.step}: {len(weights)} model tensors, "
        f"optimizer state for {len(optimizer.state) if optimizer else 0} parameters; "
        f"{folder.chunk_count} chunks in {len(folder.files) - 1} files"
    )
    if fused:
        contents.description.append(
            f"fused parameters {', '.join(visible(n) for n in fused)} have optimizer state "
            "under their fused name and weights stored split as wq, wk, wv: ratio compares "
            "the same elements"
        )
    contents.description.extend(notes)
    return contents.finish()


def _model_order(names: list[str], fused: dict) -> list[str]:
    """The model's parameter names in state-dict order, each fused name where its wq is."""
    order = list(names)
    for name in fused:
        module, _, param = name.rpartition(".")
        first = f"{module[: -len('wqkv')]}wq.{param}"
        order.insert(order.index(first) if first in order else len(order), name)
    return order
