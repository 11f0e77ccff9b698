"""Megatron ``torch_dist`` checkpoints: ``iter_NNNNNNN/``, or the save folder with its tracker.

Megatron-LM's ``save_checkpoint`` (``ckpt_format torch_dist``) writes
``<save>/iter_0000003/`` through Megatron-core's ``dist_checkpointing.save``
and then ``<save>/latest_checkpointed_iteration.txt``, the tracker naming the
newest iteration (or ``release``). An iteration folder holds:

* ``.metadata`` and ``__R_N.distcp``: a DCP folder (Megatron's planner keeps
  every rank's save plan in the metadata, ``all_local_plans``: inert records
  here) of the *sharded* tensors: the model's by Megatron's names, and the
  optimizer's moments as ``optimizer.state.exp_avg.<name>`` and
  ``optimizer.state.exp_avg_sq.<name>``;
* ``common.pt``: what is not sharded: ``iteration``, ``args`` (an
  ``argparse.Namespace``, read as inert data: ``files/megatron_pickle``), the
  optimizer's ``param_groups`` (hyperparameters; the parameters each group
  holds are not saved) and ``state.common_step``, the step of every moment;
* ``metadata.json``: ``{"sharded_backend": "torch_dist", ...}``.

Transformer layers are stacked: ``decoder.layers.mlp.linear_fc1.weight`` is
one tensor of shape ``[num_layers, ...]``, each layer a chunk of its own
(``sharded_offsets`` prepended by the layer's global number). Each layer is
split off as a tensor of its own, ``decoder.layers.3.mlp.linear_fc1.weight``,
so the report's groups name the layer. A tensor under ``layers`` whose chunks
do not each hold one layer is refused: its layers cannot be told apart.

A tracker naming a legacy iteration (``iter_N/mp_rank_XX/model_optim_rng.pt``) hands it
to ``megatron_legacy``.

Recognised by content, before any flat-mapping rule: ``metadata.json`` with
``sharded_backend`` beside ``common.pt`` and ``.metadata``, or a folder
whose tracker names such a folder inside it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files.dcp_metadata import METADATA_NAME
from gradclip_cli.source.files.megatron_pickle import GLOBALS, NamespaceState
from gradclip_cli.source.files.small_file import excerpt, read_small_file
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import Contents, OptimizerState, Piece, StoredTensor

from . import dcp_folder
from . import dcp_frameworks as frameworks
from . import megatron_legacy as legacy
from .paths import inside, json_head_keys, read_json

KIND = "megatron"
TRACKER = "latest_checkpointed_iteration.txt"
_COMMON, _JSON = "common.pt", "metadata.json"
_MOMENT = re.compile(r"optimizer\.state\.(exp_avg|exp_avg_sq)\.(.+)")
_LAYERS = re.compile(r"(^|.*\.)layers\.(?!\d)")  # a stacked key: ``layers.`` then no number


def recognises(path: Path) -> bool:
    if not os.path.isdir(path):
        return False
    if os.path.isfile(path / TRACKER):
        return True
    return _is_iteration(path)


def _is_iteration(path: Path) -> bool:
    return (
        os.path.isfile(path / _COMMON)
        and os.path.isfile(path / METADATA_NAME)
        and "sharded_backend" in json_head_keys(path / _JSON)
    )


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    frameworks.refuse_key(path, key, "a Megatron checkpoint")
    folder_path, tracker = _iteration_folder(path)
    if legacy.is_iteration(folder_path):  # the tracker names a legacy iteration
        return legacy.open_iteration(
            path, folder_path, tracker, trust_pickle=trust_pickle, verify=verify
        )
    stated = read_json(
        inside(folder_path, _JSON, named_by=folder_path), what="Megatron checkpoint metadata"
    )
    backend = stated.get("sharded_backend") if isinstance(stated, dict) else None
    if backend != "torch_dist":
        raise InputError(
            f"{folder_path / _JSON}: sharded_backend is "
            f"{visible(repr(backend))[:40]}; gradclip reads torch_dist"
        )
    folder = dcp_folder.read_folder(folder_path, verify=verify, trust_pickle=trust_pickle)
    common_file = inside(folder_path, _COMMON, named_by=folder_path)
    with allowing(GLOBALS):
        common = load_checkpoint(common_file, trust_pickle=trust_pickle, verify=verify)
    root = common.root
    if not isinstance(root, dict):
        raise InputError(f"{common_file}: not Megatron's common state: not a dict")
    files = [folder_path / _JSON, common_file, *folder.files]
    if tracker is not None:
        files.insert(0, tracker)
    contents = Contents(
        path=path,
        kind=KIND,
        files=files,
        index=folder.metadata_file,
        folder=folder_path,
        trusted_pickle=folder.trusted or common.trusted_pickle,
    )
    split = _split_layers(folder)
    weights = {n: t for k, (n, t) in _named(split).items() if not k.startswith("optimizer.")}
    contents.weights = weights or None
    said = f"a torch_dist checkpoint: {_JSON} sharded_backend torch_dist"
    contents.evidence[roles.WEIGHT] = said
    optimizer = _optimizer(folder, split, root, common_file)
    if optimizer is not None:
        contents.optimizers.append(optimizer)
        contents.evidence[roles.OPTIMIZER_STATE] = \
            f"{said}, optimizer.state entries, {_COMMON}'s step and betas"
    held = f"optimizer state for {len(optimizer.state) if optimizer else 0} parameters"
    sharding = _distributed_sharding(folder, root) if optimizer is None else None
    if sharding is not None:
        held = (
            "the optimizer state is Megatron's distributed optimizer's "
            f"({visible(sharding)}: flat grad-buffer buckets, optimizer.distributed.*), "
            "which gradclip does not read: moments not measured"
        )
        contents.optimizer_error = held.replace("the optimizer state is", "its optimizer state is")
    contents.step = _iteration(root, common_file, folder_path)
    contents.gradient_error = (
        f"{path}: a Megatron torch_dist checkpoint saves no gradients "
        "(model, optimizer state, common.pt)"
    )
    layers = {n.split(".layers.")[1].split(".")[0] for n in weights if ".layers." in n}
    via = f" ({TRACKER} names {folder_path.name})" if tracker is not None else ""
    contents.description.append(
        f"Megatron torch_dist checkpoint{via} at iteration {contents.step}: {len(weights)} "
        f"model tensors ({len(layers)} stacked layers split per layer), {held}"
    )
    return contents


def _distributed_sharding(folder: dcp_folder.DcpFolder, root: dict) -> str | None:
    """The distributed optimizer's ``param_state_sharding_type`` when its state is what the
    folder holds (``DistributedOptimizer.sharded_state_dict``: ``dp_reshardable``, Megatron-LM's
    default, saves each grad-buffer bucket as flat tensors under ``optimizer.distributed.``),
    else None."""
    optim = root.get("optimizer")
    sharding = optim.get("param_state_sharding_type") if isinstance(optim, dict) else None
    if sharding is None and not any(k.startswith("optimizer.distributed.") for k in folder.tensors):
        return None
    return repr(sharding) if sharding is not None else "its buckets"


def _iteration_folder(path: Path) -> tuple[Path, Path | None]:
    """The iteration folder: ``path`` itself, or the one its tracker names (inside it)."""
    tracker = path / TRACKER
    if not os.path.isfile(tracker):
        return path, None
    text = (
        read_small_file(tracker, limit=64, what="Megatron's tracker file", folder=path)
        .decode("utf-8", errors="replace")
        .strip()
    )
    if text == "release":
        name = "release"
    elif text.isdigit():
        name = f"iter_{int(text):07d}"
    else:
        raise InputError(f"{tracker}: names {excerpt(text)}, not an iteration number or 'release'")
    folder = inside(path, name, named_by=tracker)
    if not os.path.isdir(folder) or not (_is_iteration(folder) or legacy.is_iteration(folder)):
        raise InputError(
            f"{tracker}: names iteration {text}, but {name}/ is not a Megatron (torch_dist or "
            "legacy) checkpoint folder inside it"
        )
    return folder, tracker


def _split_layers(folder: dcp_folder.DcpFolder) -> dict[str, list[tuple[str, StoredTensor]]]:
    """Each tensor of the folder as ``[(name, tensor)]``: one per layer for a stacked one."""
    out: dict[str, list[tuple[str, StoredTensor]]] = {}
    for key, tensor in folder.tensors.items():
        model_key = _MOMENT.fullmatch(key)
        name = model_key.group(2) if model_key else key
        stacked = _LAYERS.match(name)
        if not stacked or not tensor.shape:
            out[key] = [(name, tensor)]
            continue
        if any(piece.shape[0] != 1 for piece in tensor.pieces):
            raise InputError(
                f"{folder.metadata_file}: {visible(repr(key))} is stacked by layer "
                f"(shape {list(tensor.shape)}) but a chunk holds several layers: "
                "its layers cannot be told apart"
            )
        head = stacked.group(0)
        rest = name[len(head) :]
        per_layer = []
        for layer in range(tensor.shape[0]):
            pieces = [
                Piece(p.offsets[1:], p.shape[1:], _squeezed(p.read), p.file)
                for p in tensor.pieces
                if p.offsets[0] == layer
            ]
            layer_name = f"{head}{layer}.{rest}"
            per_layer.append(
                (layer_name, StoredTensor(layer_name, tensor.shape[1:], tensor.dtype, pieces))
            )
        out[key] = per_layer
    return out


def _squeezed(read):
    return lambda: read()[0]


def _named(split) -> dict[str, tuple[str, StoredTensor]]:
    """``{key + '#' + layer name: (name, tensor)}`` flattened, keys keeping their kind."""
    return {
        f"{key}#{name}": (name, tensor) for key, parts in split.items() for name, tensor in parts
    }


def _optimizer(folder, split, root: dict, common_file: Path) -> OptimizerState | None:
    moments: dict[str, dict] = {}
    for key, parts in split.items():
        found = _MOMENT.fullmatch(key)
        if not found:
            continue
        for name, tensor in parts:
            moments.setdefault(name, {})[found.group(1)] = dcp_folder.renamed(
                tensor, f"{name}.{found.group(1)}"
            )
    if not moments:
        return None
    optim = root.get("optimizer")
    state = optim.get("state") if isinstance(optim, dict) else None
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    if not isinstance(state, dict) or "common_step" not in state:
        raise InputError(f"{common_file}: holds no optimizer.state.common_step (the moments' step)")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise InputError(
            f"{common_file}: holds no optimizer param_groups (the moments' betas, lr and eps)"
        )
    # The groups' members are not saved (Megatron drops their ``params``); only lr, betas and
    # eps enter the measured quantities, so any number of groups that agree on them is one.
    used = ("lr", "betas", "eps")
    shared = {k: groups[0].get(k) for k in used}
    if any({k: g.get(k) for k in used} != shared for g in groups[1:]):
        raise InputError(
            f"{common_file}: the optimizer's {len(groups)} param groups differ in "
            "lr, betas or eps, and Megatron does not save which parameters each "
            "holds"
        )
    names = list(moments)
    step = state["common_step"]
    group = {
        **{k: v for k, v in groups[0].items() if k != "params"},
        "params": list(range(len(names))),
    }
    return OptimizerState(
        [group],
        {i: {**moments[n], "step": step} for i, n in enumerate(names)},
        dict(enumerate(names)),
        common_file,
    )


def _iteration(root: dict, common_file: Path, folder: Path) -> int | None:
    value = root.get("iteration")
    if value is None:
        args = root.get("args")
        value = args.state.get("iteration") if isinstance(args, NamespaceState) else None
    if value is None:
        found = re.fullmatch(r"iter_(\d+)", folder.name)
        return int(found.group(1)) if found else None
    return frameworks.int_value(value, common_file, "iteration")
