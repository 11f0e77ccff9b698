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

In bf16 (or fp16) mixed precision, as Megatron-LM's ``--bf16`` trains (``Float16Module``,
Megatron's DDP, ``Float16OptimizerWithFloat16Params``), the model's tensors are bf16 and
the optimizer keeps an fp32 main param of each, the copy Adam updates, saved as
``optimizer.state.fp32_param.<name>`` beside the moments; ``common.pt`` then holds torch's
optimizer state one level down (``optimizer.optimizer.param_groups``,
``optimizer.optimizer.state.common_step``). The fp32 main params are the weights measured
(``_fp32_params``), each chunk checked, as it is read, to round to the model's chunk.

Transformer layers are stacked: ``decoder.layers.mlp.linear_fc1.weight`` is
one tensor of shape ``[num_layers, ...]``, each layer a chunk of its own
(``sharded_offsets`` prepended by the layer's global number). Each layer is
split off as a tensor of its own, ``decoder.layers.3.mlp.linear_fc1.weight``,
so the report's groups name the layer. A tensor under ``layers`` whose chunks
do not each hold one layer is refused: its layers cannot be told apart.

A Mixture of Experts (``num_moe_experts``; the local spec's ``SequentialMLP``) saves each
layer's router as ``decoder.layers.mlp.router.weight``, a parameter like any (with
aux-loss-free balancing also its ``expert_bias``, a buffer: never a weight, nor laid out in
the distributed optimizer's buckets), and its experts stacked once more:
``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is ``[num_layers, num_experts,
...]``, the global expert index a second prepended axis (each expert-parallel rank saving
its own experts' chunks of it). Each expert of each layer is
split off too, named by its global index as Megatron's ``singleton_local_shards`` keys
name it, ``decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight``: in its layer's group,
and a tensor of its own (``--group-by regex:`` makes each expert a group). A chunk holding
several experts is cut at each. Under expert parallelism Megatron-LM's
``get_megatron_optimizer`` chains two optimizers, the dense parameters' and the experts'
(``ChainedOptimizer``): plain, their moments are saved per parameter by name as one
optimizer's are, and ``common.pt``'s ``optimizer`` is ``{0: ..., 1: ...}``, each with its
param groups and ``common_step`` (the steps must agree, as must lr, betas and eps);
distributed (``dp_reshardable``), their buckets are under ``chained_0.`` and
``chained_1.`` (``_chained_bucketed``); distributed ``fully_reshardable``, their state is
per parameter by name again, each one's step in its own ``optimizer.<N>.optimizer``'s param
groups. A chain saved otherwise is refused. Keys under ``chained_N.optimizer.`` are the
optimizer's, never the model's weights. Megatron's per-layer keys (``decoder.layers.0.mlp
.experts.experts.linear_fc1.weight``, as it saves layers that differ, ``moe_layer_freq``)
have the expert axis first, split the same way.

With Megatron's distributed optimizer, saved as Megatron-LM saves it by default
(``common.pt``'s ``optimizer.param_state_sharding_type`` ``dp_reshardable``), the
moments are not per parameter: each grad-buffer bucket is flat tensors under
``optimizer.distributed.`` and the step is in its param groups' object there;
``_bucketed`` cuts each parameter's moments out of them by Megatron's bucket
layout (``megatron_buckets``, shared with the legacy ``distrib_optim.pt``; a layer's
experts in turn, as ``SequentialMLP`` lists them), checked against the model's tensors
(their ``param``, fp32 main params, are the weights measured under bf16); with tensor or
pipeline parallelism, each model-parallel rank's buckets (``dp_group_idx_N``) hold its
stage's parameters, its shards of them.
Saved ``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``), the
state is per parameter again, in the model's shape and chunks,
``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>``, and the step is only in
``common.pt``'s ``optimizer.optimizer.param_groups``: read as the plain optimizer's, the
``param`` entries as its fp32 main params. Another sharding type is refused, saying so.

A tracker naming a legacy iteration (``iter_N/mp_rank_XX/model_optim_rng.pt``) hands it
to ``megatron_legacy``.

Recognised by content, before any flat-mapping rule: ``metadata.json`` with
``sharded_backend`` beside ``common.pt`` and ``.metadata``, or a folder
whose tracker names such a folder inside it.
"""

from __future__ import annotations

import bisect
import os
import re
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files.dcp_metadata import METADATA_NAME
from gradclip_cli.source.files.megatron_pickle import GLOBALS, NamespaceState
from gradclip_cli.source.files.small_file import excerpt, read_small_file
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import (
    Contents,
    OptimizerState,
    Piece,
    StoredTensor,
    chained,
)
from gradclip_cli.source.untrusted import is_int, is_number
from gradclip_cli.source.vocabulary import step_after

from . import dcp_folder
from . import dcp_frameworks as frameworks
from . import megatron_legacy as legacy
from .master_copy import rounds_to
from .megatron_buckets import buckets, fits_one_bucket_size, one_setting
from .paths import inside, json_head_keys, read_json

KIND = "megatron"
TRACKER = "latest_checkpointed_iteration.txt"
_COMMON, _JSON = "common.pt", "metadata.json"
_MOMENT = re.compile(r"optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.+)")
_MAIN = ("fp32_param", "param")  # the fp32 main params: the plain optimizer's, fully_reshardable's
_FULLY = "fully_reshardable"
_CHAINED = re.compile(r"chained_(\d+)\.optimizer\.distributed\.")
# The optimizer's keys, a chained one's too (``chained_N.``): never the model's
_OPTIMIZER = re.compile(r"(chained_\d+\.)?optimizer\.")
_SIXTEEN = (torch.bfloat16, torch.float16)
_LAYERS = re.compile(r"(^|.*\.)layers\.(?!\d)")  # a stacked key: ``layers.`` then no number
_EXPERTS = re.compile(r"(^|.*\.)experts\.experts\.(?!\d)")  # stacked experts: then no number
_EXPERT = re.compile(r"(?:^|.*\.)experts\.experts\.(\d+)\.")  # one expert, split off
_BUFFER = legacy.BUFFER


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
    weights = {n: t for k, (n, t) in _named(split).items() if not _OPTIMIZER.match(k)}
    buffers = {n: t for n, t in weights.items() if _BUFFER.fullmatch(n)}
    weights = {n: t for n, t in weights.items() if n not in buffers}
    contents.weights = weights or None
    contents.buffers = buffers or None
    said = f"a torch_dist checkpoint: {_JSON} sharded_backend torch_dist"
    contents.evidence[roles.WEIGHT] = said
    optimizer = _optimizer(folder, split, root, common_file)
    mains = _fp32_params(folder, split, weights)
    if optimizer is not None:
        contents.optimizers.append(optimizer)
        contents.evidence[roles.OPTIMIZER_STATE] = \
            f"{said}, optimizer.state entries, {_COMMON}'s step and betas"
    held = f"optimizer state for {len(optimizer.state) if optimizer else 0} parameters"
    fully = _sharding(root) == _FULLY and optimizer is not None
    if fully:
        optim = root["optimizer"]
        which = (  # a ChainedOptimizer's under expert parallelism: {0: ..., 1: ...}
            f"a ChainedOptimizer's {len(optim)} distributed optimizers'"
            if "param_state_sharding_type" not in optim
            else "the distributed optimizer's"
        )
        held += f" from {which} fully_reshardable state (optimizer.state.*)"
        contents.evidence[roles.OPTIMIZER_STATE] = (
            f"{said}, {which} fully_reshardable optimizer.state entries, "
            f"{_COMMON}'s param groups' step and betas"
        )
    mains = {n: t for n, t in mains.items() if weights[n].dtype in _SIXTEEN}
    if mains:
        kind = "optimizer.state.param" if fully else "optimizer.state.fp32_param"
        held += f" and the fp32 main params of {len(mains)} ({kind})"
        whose = (
            f"distributed optimizer's fp32 main params ({kind} entries"
            if fully
            else f"mixed-precision optimizer's fp32 main params ({kind} entries"
        )
    sharding = _distributed_sharding(folder, root) if optimizer is None else None
    chain = _chained_buckets(folder) if optimizer is None else 0
    if chain or sharding == repr("dp_reshardable"):
        if chain:
            optimizer, held, mains = _chained_bucketed(folder, split, weights, root, common_file)
            which = "a ChainedOptimizer's distributed optimizers' dp_reshardable buckets "
            which += "(chained_N.optimizer.distributed.*)"
        else:
            optimizer, held, mains = _bucketed(folder, split, weights)
            which = "the distributed optimizer's dp_reshardable buckets (optimizer.distributed.*)"
        held += _PLACED
        contents.optimizers.append(optimizer)
        contents.evidence[roles.OPTIMIZER_STATE] = (
            f"{said}, {which}, their param groups' step and betas"
        )
        # The buckets' param is every parameter's fp32 copy; only a 16-bit model's differs.
        mains = {n: t for n, t in mains.items() if weights[n].dtype in _SIXTEEN}
        if mains:
            held += f"; their param, the fp32 main params of {len(mains)}"
            whose = "distributed optimizer's fp32 main params (its buckets' param"
    elif sharding is not None:
        held = (
            "the optimizer state is Megatron's distributed optimizer's "
            f"({visible(sharding)}: flat grad-buffer buckets, optimizer.distributed.*), "
            "which gradclip does not read: moments not measured"
        )
        contents.optimizer_error = held.replace("the optimizer state is", "its optimizer state is")
        sixteen = [n for n, t in weights.items() if t.dtype in _SIXTEEN]
        if sixteen:
            # The fp32 main params are in that unread state: the weights measured are the
            # model's 16-bit tensors (their rounding), and the report says so.
            kinds = _dtypes(weights, sixteen)
            held += (f"; the weights measured are the model's {kinds} tensors, its fp32 main "
                     "params being in that state")
            contents.evidence[roles.WEIGHT] = (
                f"{said}, the model's {kinds} tensors (the fp32 main params Adam updates are "
                "in the distributed optimizer's state, not read)"
            )
    model = f"{len(weights)} model tensors"
    if mains:
        contents.weights = {n: mains.get(n, t) for n, t in weights.items()}
        sixteen = _dtypes(weights, mains)
        model = (
            f"{len(weights)} {sixteen} model tensors"
            if len(mains) == len(weights)
            else f"{len(weights)} model tensors, {len(mains)} of them {sixteen},"
        )
        held += ", the weights measured"
        contents.evidence[roles.WEIGHT] = (
            f"{said}, the {whose}: the weights Adam updates; the model's {sixteen} tensors "
            "are them rounded, checked)"
        )
    contents.step = _iteration(root, common_file, folder_path)
    contents.gradient_error = (
        f"{path}: a Megatron torch_dist checkpoint saves no gradients "
        "(model, optimizer state, common.pt)"
    )
    layers = {n.split(".layers.")[1].split(".")[0] for n in weights if ".layers." in n}
    via = f" ({TRACKER} names {folder_path.name})" if tracker is not None else ""
    contents.description.append(
        f"Megatron torch_dist checkpoint{via} at iteration {contents.step}: {model} "
        f"({len(layers)} stacked layers split per layer), {held}"
    )
    return contents


def _sharding(root: dict) -> object:
    """``common.pt``'s ``optimizer.param_state_sharding_type`` (the distributed optimizer's;
    a ChainedOptimizer's, ``optimizer.<N>.``, where its optimizers agree), or None."""
    optim = root.get("optimizer")
    if not isinstance(optim, dict):
        return None
    if optim and all(is_int(k) for k in optim):
        kinds = [p.get("param_state_sharding_type") if isinstance(p, dict) else None
                 for p in optim.values()]
        return kinds[0] if all(k == kinds[0] for k in kinds) else None
    return optim.get("param_state_sharding_type")


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


def _chained_buckets(folder: dcp_folder.DcpFolder) -> int:
    """How many chained distributed optimizers the folder holds buckets of
    (``ChainedOptimizer.sharded_state_dict`` prefixes each one's ``chained_N.``, as under
    expert parallelism, where ``get_megatron_optimizer`` chains the dense parameters'
    optimizer and the experts'), 0 for none."""
    found = {m.group(1) for k in folder.tensors if (m := _CHAINED.match(k))}
    return len(found)


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
    """Each tensor of the folder as ``[(name, tensor)]``: one per layer for a stacked one,
    and one per expert (of each layer) for a Mixture of Experts' stacked experts."""
    out: dict[str, list[tuple[str, StoredTensor]]] = {}
    for key, tensor in folder.tensors.items():
        model_key = _MOMENT.fullmatch(key)
        name = model_key.group(2) if model_key else key
        parts = [(name, tensor)]
        if _LAYERS.match(name) and tensor.shape:
            if any(piece.shape[0] != 1 for piece in tensor.pieces):
                raise InputError(
                    f"{folder.metadata_file}: {visible(repr(key))} is stacked by layer "
                    f"(shape {list(tensor.shape)}) but a chunk holds several layers: "
                    "its layers cannot be told apart"
                )
            parts = _split_axis(name, tensor, _LAYERS)
        if _EXPERTS.match(name):
            parts = [each for n, t in parts for each in _experts(folder, key, n, t)]
        out[key] = parts
    return out


def _experts(folder, key: str, name: str, tensor: StoredTensor) -> list[tuple[str, StoredTensor]]:
    """A layer's stacked experts (``SequentialMLP.sharded_state_dict``, core_v0.16.1: each
    local expert's tensors under ``experts.experts.``, the global expert index an axis
    prepended after the layer's) as one tensor per expert, named as Megatron's
    ``singleton_local_shards`` keys name it: ``...mlp.experts.experts.3.linear_fc1.weight``.
    A chunk may hold several experts (``GroupedMLP`` saves a rank's local experts as one):
    each is cut out of it by its offset."""
    if len(tensor.shape) < 2:
        raise InputError(
            f"{folder.metadata_file}: {visible(repr(key))} is named as a Mixture of Experts' "
            f"stacked experts (experts.experts.) but has shape {list(tensor.shape)}: "
            "no expert axis to split"
        )
    return _split_axis(name, tensor, _EXPERTS)


def _split_axis(name: str, tensor: StoredTensor, stacked: re.Pattern) -> list:
    """``tensor`` split along its first axis, index ``i`` named ``name`` with ``i`` inserted
    after ``stacked``'s match; each chunk's slice at ``i`` a piece of its own."""
    head = stacked.match(name).group(0)
    rest = name[len(head) :]
    parts = []
    for i in range(tensor.shape[0]):
        pieces = [
            Piece(p.offsets[1:], p.shape[1:], _sliced(p.read, i - p.offsets[0]), p.file)
            for p in tensor.pieces
            if p.offsets[0] <= i < p.offsets[0] + p.shape[0]
        ]
        each = f"{head}{i}.{rest}"
        parts.append((each, StoredTensor(each, tensor.shape[1:], tensor.dtype, pieces)))
    return parts


def _sliced(read, i: int):
    return lambda: read()[i]


def _named(split) -> dict[str, tuple[str, StoredTensor]]:
    """``{key + '#' + layer name: (name, tensor)}`` flattened, keys keeping their kind."""
    return {
        f"{key}#{name}": (name, tensor) for key, parts in split.items() for name, tensor in parts
    }


def _optimizer(folder, split, root: dict, common_file: Path) -> OptimizerState | None:
    moments: dict[str, dict] = {}
    for key, parts in split.items():
        found = _MOMENT.fullmatch(key)
        if not found or found.group(1) in _MAIN:
            continue
        for name, tensor in parts:
            moments.setdefault(name, {})[found.group(1)] = dcp_folder.renamed(
                tensor, f"{name}.{found.group(1)}"
            )
    if not moments:
        return None
    groups: list[dict] = []
    steps = []
    for where, optim in _chained(root.get("optimizer"), common_file):
        mine, step = _groups_and_step(optim, where, common_file)
        groups += mine
        steps.append(step)
    if len({repr(_step_value(s)) for s in steps}) != 1:
        raise InputError(
            f"{common_file}: the chained optimizers' steps differ "
            f"({', '.join(visible(repr(_step_value(s))) for s in steps)}), and Megatron does not "
            "save which parameters each holds"
        )
    step = steps[0]
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
    group = {
        **{k: v for k, v in groups[0].items() if k not in ("params", "step")},
        "params": list(range(len(names))),
    }
    return OptimizerState(
        [group],
        {i: {**moments[n], "step": step} for i, n in enumerate(names)},
        dict(enumerate(names)),
        common_file,
    )


def _chained(optim, common_file: Path) -> list[tuple[str, object]]:
    """The optimizers of ``common.pt``'s ``optimizer``, each with where it is: the one, or
    a ``ChainedOptimizer``'s (``{0: ..., 1: ...}``, ``ChainedOptimizer.state_dict``: under
    expert parallelism ``get_megatron_optimizer`` chains the dense parameters' optimizer and
    the experts'; their moments are saved per parameter as one optimizer's are, by name,
    when they are plain or distributed ``fully_reshardable``)."""
    if not isinstance(optim, dict) or not optim or not all(is_int(k) for k in optim):
        return [("optimizer", optim)]
    if sorted(optim) != list(range(len(optim))):
        raise InputError(
            f"{common_file}: the chained optimizers are numbered {sorted(optim)[:8]}, "
            "not 0, 1, ..."
        )
    kinds = [p.get("param_state_sharding_type") if isinstance(p, dict) else None
             for p in optim.values()]
    if any(k != kinds[0] for k in kinds) or kinds[0] not in (None, _FULLY):
        raise InputError(
            f"{common_file}: the chained optimizers are saved as {visible(repr(kinds))[:80]} "
            "beside moments per parameter (optimizer.state.*); gradclip reads them plain or "
            "each fully_reshardable"
        )
    return [(f"optimizer.{k}", optim[k]) for k in range(len(optim))]


def _groups_and_step(optim, where: str, common_file: Path) -> tuple[list, object]:
    """One optimizer's param groups and the step of its moments, from ``common.pt``."""
    fully = isinstance(optim, dict) and optim.get("param_state_sharding_type") == _FULLY
    if isinstance(optim, dict) and "param_groups" not in optim and "optimizer" in optim:
        # Mixed precision (Float16OptimizerWithFloat16Params.state_dict): torch's state dict
        # one level down, beside the fp32 main params (in .metadata: fp32_param entries)
        optim, where = optim["optimizer"], f"{where}.optimizer"
    state = optim.get("state") if isinstance(optim, dict) else None
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise InputError(
            f"{common_file}: holds no {where}.param_groups (the moments' betas, lr and eps)"
        )
    if fully:
        # The distributed optimizer's state_dict keeps the one step of every parameter in its
        # param groups (DistributedOptimizer.state_dict); fully_reshardable saves them as they are
        steps = {g.get("step") for g in groups}
        step = next(iter(steps))
        if len(steps) != 1 or not is_number(step):
            raise InputError(
                f"{common_file}: the distributed optimizer's {where}.param_groups give no one "
                "step (fully_reshardable keeps the moments' step there)"
            )
        return groups, int(step) if isinstance(step, float) and step.is_integer() else step
    if not isinstance(state, dict) or "common_step" not in state:
        raise InputError(f"{common_file}: holds no {where}.state.common_step (the moments' step)")
    return groups, state["common_step"]


def _step_value(step) -> object:
    """A step as a plain number to compare (``common_step`` is a 0-dim tensor)."""
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        return step.item()
    return step


def _fp32_params(folder, split, weights: dict[str, StoredTensor]) -> dict[str, StoredTensor]:
    """The optimizer's fp32 main params by model name, where it saves them per parameter
    (none: ``{}``).

    ``Float16OptimizerWithFloat16Params.sharded_state_dict`` (core_v0.16.1) saves each 16-bit
    parameter's fp32 copy, the one Adam updates, as ``optimizer.state.fp32_param.<key>``,
    chunked as the model's tensor is; the distributed optimizer's ``fully_reshardable``
    sharding saves every parameter's as ``optimizer.state.param.<key>``
    (``sharded_param_state_fully_reshardable``: the model's sharded tensor, its data
    replaced). After each step Megatron copies it into the model's parameter
    (``_copy_main_params_to_model_params``: rounded to the parameter's dtype). Under mixed
    precision these are the weights measured. Each chunk, when read, is checked against
    the model's chunk: rounded, it must be it, bit for bit (NaN for NaN), else the file is
    refused: the two copies disagree, and neither can be trusted as the weights. A 16-bit
    parameter with moments but no fp32 copy, where others have one, is refused too."""
    where = folder.metadata_file
    out: dict[str, StoredTensor] = {}
    moments: set[str] = set()
    kinds: set[str] = set()
    for key, parts in split.items():
        found = _MOMENT.fullmatch(key)
        if found and found.group(1) not in _MAIN:
            moments.update(name for name, _ in parts)
        if not found or found.group(1) not in _MAIN:
            continue
        kind = f"optimizer.state.{found.group(1)}"
        kinds.add(kind)
        for name, main in parts:
            model = weights.get(name)
            if model is None:
                raise InputError(
                    f"{where}: holds {visible(repr(key))[:120]}, the fp32 main param of "
                    f"{visible(name)}, which the model does not hold"
                )
            if (
                main.dtype != torch.float32
                or main.shape != model.shape
                or sorted((p.offsets, p.shape) for p in main.pieces)
                != sorted((p.offsets, p.shape) for p in model.pieces)
            ):
                raise InputError(
                    f"{where}: {visible(repr(key))[:120]} is not an fp32 tensor chunked as the "
                    f"model's {visible(name)} ({model.dtype}, shape {list(model.shape)}): not "
                    "its fp32 main param"
                )
            by_place = {(p.offsets, p.shape): p for p in model.pieces}
            pieces = [
                Piece(p.offsets, p.shape, _checked(name, kind, p, by_place[(p.offsets, p.shape)]),
                      p.file)
                for p in main.pieces
            ]
            out[name] = StoredTensor(name, main.shape, torch.float32, pieces)
    if len(kinds) > 1:
        raise InputError(f"{where}: holds both {' and '.join(sorted(kinds))} entries")
    missing = [n for n in moments if n not in out and n in weights and weights[n].dtype in _SIXTEEN]
    if out and missing:
        raise InputError(
            f"{where}: holds no {kinds.pop()} of {visible(missing[0])} "
            f"({weights[missing[0]].dtype}, with moments), where the other 16-bit parameters "
            "have their fp32 main params: the mixed-precision state is incomplete"
        )
    return out


def _checked(name: str, kind: str, main: Piece, model: Piece):
    """``main.read`` that first checks the chunk rounds to the model's chunk."""

    def read() -> torch.Tensor:
        value, rounded = main.read(), model.read()
        if not rounds_to(value, rounded):
            raise InputError(
                f"{main.file}: {visible(name)}'s fp32 main param ({kind}) "
                f"rounded to {str(rounded.dtype).removeprefix('torch.')} is not the model's "
                "tensor: the optimizer's weights and the model's disagree"
            )
        return value

    return read


def _dtypes(weights: dict[str, StoredTensor], names) -> str:
    """The model's dtypes of ``names``, as words (``bfloat16``)."""
    return "/".join(sorted({str(weights[n].dtype).removeprefix("torch.") for n in names}))


def _iteration(root: dict, common_file: Path, folder: Path) -> int | None:
    value = root.get("iteration")
    if value is None:
        args = root.get("args")
        value = args.state.get("iteration") if isinstance(args, NamespaceState) else None
    if value is None:
        return step_after(folder.name, "iter_")
    return frameworks.int_value(value, common_file, "iteration")


# ----------------------------------------------------------------- distributed optimizer

_BUCKET = re.compile(
    r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)"
    r"\.dtype_\((torch\.\w+), (torch\.\w+)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)"
)
_GROUPS = "optimizer.distributed.dp_group_idx_{}.optimizer/shard_0_1"
_PLACED = (
    ", each parameter's slice placed by Megatron's bucket layout and checked against the "
    "model's tensors"
)


def _chained_bucketed(
    folder: dcp_folder.DcpFolder, split, weights, root: dict, common_file: Path
) -> tuple[OptimizerState, str, dict[str, StoredTensor]]:
    """A ``ChainedOptimizer``'s distributed optimizers' ``dp_reshardable`` state, each one's
    under its ``chained_N.`` prefix (``ChainedOptimizer.sharded_state_dict``, core_v0.16.1),
    as per-parameter moments.

    Under expert parallelism ``get_megatron_optimizer`` chains two: the dense parameters'
    optimizer, over the data-parallel ranks of each model-parallel rank, and the experts'
    (its param groups' ``is_expert_parallel`` True), over the expert-data-parallel ranks of
    each expert-model-parallel rank, whose buckets (``dp_group_idx_N``, N the expert-parallel
    rank) hold that rank's experts, laid out by its DDP's expert buffers. Each is read as
    the one distributed optimizer is (``_bucketed``), its layout rebuilt over its own
    parameters: the experts' the split experts (``experts.experts.<e>``), the dense one's
    the rest, and checked as there. Any other chain (not one dense and one expert optimizer,
    or another sharding type in ``common.pt``) is refused."""
    optim = root.get("optimizer")
    parts = list(optim.values()) if isinstance(optim, dict) else []
    shardings = [p.get("param_state_sharding_type") if isinstance(p, dict) else p for p in parts]
    if shardings != ["dp_reshardable"] * 2:
        raise InputError(
            f"{common_file}: the optimizer is a ChainedOptimizer of distributed optimizers "
            f"saved as {visible(repr(shardings))[:80]}; gradclip reads the two of expert "
            "parallelism (the dense parameters' and the experts'), each dp_reshardable"
        )
    count = _chained_buckets(folder)
    if count != 2:
        raise InputError(
            f"{folder.metadata_file}: holds the buckets of {count} chained distributed "
            f"optimizers (chained_N.optimizer.distributed.*), where {common_file.name} "
            "lists 2"
        )
    experts = {name for name in weights if _EXPERT.match(name)}
    flags = [
        _bucket_groups(folder, 1, f"chained_{k}.")[1].get("is_expert_parallel") for k in (0, 1)
    ]
    if sorted(flags, key=repr) != [False, True]:
        raise InputError(
            f"{folder.metadata_file}: the chained distributed optimizers' param groups say "
            f"is_expert_parallel {visible(repr(flags))[:60]}, not one dense and one expert "
            "optimizer: gradclip cannot tell which parameters each holds"
        )
    states, helds, mains = [], [], {}
    for k, expert in enumerate(flags):
        state, held, main = _bucketed(
            folder,
            split,
            weights,
            f"chained_{k}.",
            experts if expert else set(weights) - experts,
            "expert-parallel" if expert else "model-parallel",
        )
        states.append(state)
        helds.append(held.replace("the distributed optimizer's", "the experts'" if expert else
                                  "the dense parameters'"))
        mains.update(main)
    optimizer, _ = chained(states, folder.metadata_file)
    held = (
        f"optimizer state for {len(optimizer.state)} parameters from a ChainedOptimizer's 2 "
        f"distributed optimizers: {' and '.join(h.split(' from ', 1)[1] for h in helds)}"
    )
    return optimizer, held, mains


def _bucketed(
    folder: dcp_folder.DcpFolder,
    split,
    weights,
    prefix: str = "",
    only: set[str] | None = None,
    ranked: str = "model-parallel",
) -> tuple[OptimizerState, str, dict[str, StoredTensor]]:
    """The distributed optimizer's ``dp_reshardable`` state as per-parameter moments.

    ``DistributedOptimizer.sharded_param_state_dp_reshardable`` (core_v0.16.1) saves each
    bucket of each grad buffer as flat tensors of its ``numel_unpadded`` elements,
    ``optimizer.distributed.dp_group_idx_N.gbuf_idx_G.dtype_(param, grad).bucket_idx_K.
    {param,exp_avg,exp_avg_sq}``, one chunk per parameter's range (or padding's, its
    elements left unset) on each data-parallel rank, and the param groups (their ``step``)
    as ``optimizer.distributed.dp_group_idx_N.optimizer``. ``N`` is the rank in the
    model-parallel group (``get_megatron_optimizer``'s ``data_parallel_group_idx``: the
    rank in ``parallel_state.get_model_parallel_group()``, tensor-parallel rank fastest),
    and group N's buckets hold that rank's own parameters (``_holdings``): its pipeline
    stage's, with tensor parallelism its shard of each split tensor and a whole copy of
    each replicated one (layer norms: measured once, from Megatron's main replica). The
    parameters' places are rebuilt as
    Megatron's DDP lays them out (``megatron_buckets``), from the model's order (the
    metadata's, each stacked layer in turn), the buffers by parameter dtype, each bucket
    closing at its saved length; then checked before any moment is read: one bucket size
    closes them all so, every chunk lies within one parameter or between two, and each
    parameter's ``param`` (its fp32 main copy) rounded to the model's dtype is the model's
    tensor (its shard), bit for bit, in every group. Else the checkpoint is refused,
    naming ``.metadata`` or the file. Also returns each parameter's ``param`` as a tensor
    of its own (assembled over tensor-parallel ranks as the moments are): under mixed
    precision the weights Adam updates."""
    where = folder.metadata_file
    whose = f" ({prefix}*)" if prefix else ""

    def unfit(why: str, file: Path = where) -> InputError:
        return InputError(
            f"{file}: the distributed optimizer's buckets{whose} do not fit Megatron's layout "
            f"of the model's parameters ({why}): gradclip cannot tell which elements are whose"
        )

    found: dict[int, dict[int, tuple[str, dict[int, dict[str, StoredTensor]]]]] = {}
    for key, tensor in folder.tensors.items():
        if not key.startswith(f"{prefix}optimizer.distributed."):
            continue
        part = _BUCKET.fullmatch(key[len(prefix) :])
        if part is None:
            raise InputError(
                f"{where}: holds {visible(repr(key))[:120]}, not a bucket's param, exp_avg or "
                "exp_avg_sq of Megatron's dp_reshardable distributed optimizer"
            )
        per_buffer = found.setdefault(int(part.group(1)), {})
        dtype, entry = per_buffer.setdefault(int(part.group(2)), (part.group(3), {}))
        if dtype != part.group(3):
            raise unfit(f"grad buffer {part.group(2)} holds buckets of two dtypes")
        if tensor.dtype != torch.float32 or len(tensor.shape) != 1:
            raise unfit(f"{visible(repr(key))[:120]} is not a flat fp32 tensor")
        entry.setdefault(int(part.group(5)), {})[part.group(6)] = tensor
    ranks = len(found)
    if sorted(found) != list(range(ranks)):
        raise unfit(f"model-parallel groups {sorted(found)}, not numbered 0, 1, ...")
    order = [name for name in _model_order(split) if only is None or name in only]
    held, main = _holdings(order, weights, found, unfit)
    step, group = _bucket_groups(folder, ranks, prefix)
    index = {name: i for i, name in enumerate(order)}
    # Each parameter's moments: per model-parallel rank holding it, its shard and moments.
    parts: dict[str, dict[int, tuple[Piece | None, dict[str, StoredTensor]]]] = {}
    count = 0
    for rank in range(ranks):
        which = f"model-parallel group {rank}'s " if ranks > 1 else ""
        shards = held[rank]
        by_dtype: dict[str, list[str]] = {}
        for name in shards:  # Megatron's DDP: one grad buffer per parameter dtype, model order
            by_dtype.setdefault(str(weights[name].dtype), []).append(name)
        buffer_dtypes = [found[rank][g][0] for g in sorted(found[rank])]
        if sorted(found[rank]) != list(range(len(found[rank]))) or buffer_dtypes != list(by_dtype):
            raise unfit(
                f"{which}grad buffers of {buffer_dtypes}, the model's parameters are "
                f"{list(by_dtype)}"
            )
        for g, names in zip(sorted(found[rank]), by_dtype.values()):
            dtype, per_bucket = found[rank][g]
            if sorted(per_bucket) != list(range(len(per_bucket))):
                raise unfit(f"{which}grad buffer {g}'s buckets are not numbered 0, 1, ...")
            tensors = []
            for k in sorted(per_bucket):
                entry = per_bucket[k]
                if (
                    set(entry) != {"param", "exp_avg", "exp_avg_sq"}
                    or len({t.shape for t in entry.values()}) != 1
                ):
                    raise unfit(
                        f"{which}bucket {k} of grad buffer {g} is not param, exp_avg and "
                        "exp_avg_sq of one length"
                    )
                tensors.append(entry)
            sizes = [t["param"].shape[0] for t in tensors]
            numels = {n: _numel(shards[n], weights[n]) for n in names}
            layout = buckets(names, numels, sizes=sizes)
            laid = [b.numel_unpadded for b in layout]
            if laid != sizes:
                raise unfit(
                    f"buckets of {laid} elements laid out, {which}grad buffer {g} holds {sizes}"
                )
            if not fits_one_bucket_size(layout):
                raise unfit(
                    f"{which}grad buffer {g}'s buckets close where no one bucket size closes them"
                )
            count += len(layout)
            for k, (bucket, entry) in enumerate(zip(layout, tensors)):
                _check_chunks(entry, bucket, unfit, f"{which}bucket {k}")
                for name, (start, end) in bucket.places.items():
                    shard = shards[name]
                    shape = weights[name].shape if shard is None else shard.shape
                    moments = {
                        key: _flat_range(f"{name}.{key}", shape, entry[key], start, end)
                        for key in ("param", "exp_avg", "exp_avg_sq")
                    }
                    weight = (weights[name] if shard is None else shard).read().reshape(-1)
                    for piece in moments["param"].pieces:  # each rank's part, its file
                        lo, hi = piece.offsets[0], piece.offsets[0] + piece.shape[0]
                        if not rounds_to(piece.read(), weight[lo:hi]):
                            rounded = (
                                f", rounded to {_dtypes(weights, [name])},"
                                if weight.dtype in _SIXTEEN
                                else ""
                            )
                            raise unfit(
                                f"{visible(name)}'s slice of {which}bucket {k}'s param"
                                f"{rounded} is not its weight",
                                piece.file or where,
                            )
                    parts.setdefault(name, {})[rank] = (shard, moments)
    state: dict[int, dict] = {}
    mains: dict[str, StoredTensor] = {}  # each parameter's fp32 main param, as its moments
    for name, held_by in parts.items():
        if held_by[main[name]][0] is None:  # whole: the main replica's (its chunk's writer)
            moments = dict(held_by[main[name]][1])
        else:  # one shard per tensor-parallel rank, at the model's chunk
            moments = {
                key: StoredTensor(
                    f"{name}.{key}",
                    weights[name].shape,
                    torch.float32,
                    [_assembled(shard, m[key]) for shard, m in held_by.values()],
                )
                for key in ("param", "exp_avg", "exp_avg_sq")
            }
        mains[name] = dcp_folder.renamed(moments.pop("param"), name)
        state[index[name]] = {**moments, "step": step}
    group = {**group, "params": sorted(state)}
    groups = f" over {ranks} {ranked} ranks" if ranks > 1 else ""
    held = (
        f"optimizer state for {len(state)} parameters from the distributed optimizer's "
        f"{count} dp_reshardable buckets{groups} ({prefix}optimizer.distributed.*)"
    )
    return OptimizerState([group], state, {i: order[i] for i in state}, where), held, mains


_WRITER = re.compile(r"__(\d+)_\d+\.distcp")  # DCP's file of process R: __R_K.distcp


def _holdings(order, weights, found, unfit) -> tuple[list[dict[str, Piece | None]], dict]:
    """Which parameters each model-parallel rank's buckets hold, in model order, each as
    its shard (None: the whole tensor), and which rank's copy of each is measured.

    One group holds every parameter whole. With several, each process writes its own
    chunks to its own files (``__R_K.distcp``), the model's (a replicated tensor's main
    replica alone) and its buckets' ranges: a chunk is the writing process's model-parallel
    rank's. Megatron numbers that rank with the tensor-parallel rank fastest, ``pp_rank *
    TP + tp_rank``, ``TP`` the most chunks any parameter is in: a split parameter is held
    one chunk per tensor-parallel rank of one pipeline stage, in the order of the chunks'
    offsets, and a parameter in one chunk whole by every rank of its writer's stage (a
    layer norm under tensor parallelism), measured from its writer (Megatron's main
    replica). Anything else is refused."""
    ranks = len(found)
    if ranks == 1:
        return [dict.fromkeys(order)], dict.fromkeys(order, 0)
    owner: dict[int, int] = {}  # writing process -> its model-parallel rank
    for rank, per_buffer in found.items():
        for _, per_bucket in per_buffer.values():
            for entry in per_bucket.values():
                for tensor in entry.values():
                    for piece in tensor.pieces:
                        writer = _writer(piece, unfit)
                        if owner.setdefault(writer, rank) != rank:
                            raise unfit(
                                f"{visible(piece.file.name)} holds buckets of model-parallel "
                                f"groups {owner[writer]} and {rank}"
                            )
    tp = max(len(weights[name].pieces) for name in order)
    if ranks % tp:
        raise unfit(f"{ranks} model-parallel groups, parameters in {tp} chunks")
    held: list[dict[str, Piece | None]] = [{} for _ in range(ranks)]
    main: dict[str, int] = {}
    for name in order:
        weight = weights[name]
        pieces = sorted(weight.pieces, key=lambda piece: tuple(piece.offsets))
        groups = []
        for piece in pieces:
            writer = _writer(piece, unfit)
            if writer not in owner:
                raise unfit(
                    f"{visible(name)} has a chunk in {visible(piece.file.name)}, which holds "
                    "no model-parallel group's buckets"
                )
            groups.append(owner[writer])
        stage = groups[0] // tp * tp
        if len(pieces) == 1 and not weight.flat:
            for rank in range(stage, stage + tp):
                held[rank][name] = None
        elif len(pieces) == tp and not weight.flat and groups == list(range(stage, stage + tp)):
            for rank, piece in zip(groups, pieces):
                held[rank][name] = piece
        else:
            raise unfit(
                f"{visible(name)}'s {len(pieces)} chunks are not one per tensor-parallel rank "
                f"of one pipeline stage (written by model-parallel ranks {groups})"
            )
        main[name] = groups[0]
    return held, main


def _writer(piece: Piece, unfit) -> int:
    found = _WRITER.fullmatch(piece.file.name) if piece.file is not None else None
    if found is None:
        raise unfit(f"a chunk in {visible(str(piece.file))}, not a process's __R_K.distcp")
    return int(found.group(1))


def _numel(shard: Piece | None, weight: StoredTensor) -> int:
    return weight.numel() if shard is None else shard.numel


def _assembled(shard: Piece, flat: StoredTensor) -> Piece:
    """A shard's moment (flat, in its buckets' ranges) as the piece of the full tensor at
    the shard's place."""

    def read() -> torch.Tensor:
        return torch.cat([p.read() for p in flat.pieces]).view(shard.shape)

    files = {p.file for p in flat.pieces}
    file = files.pop() if len(files) == 1 else None
    return Piece(tuple(shard.offsets), tuple(shard.shape), read, file)


def _model_order(split) -> list[str]:
    """The model's parameters in Megatron's order: the metadata's, each stacked block's
    layers in turn (layer 0's tensors, then layer 1's...), and within a layer a Mixture of
    Experts' experts in turn (``SequentialMLP``'s ``local_experts``: expert 0's
    ``linear_fc1`` and ``linear_fc2``, then expert 1's...)."""
    keys = [k for k in split if not _OPTIMIZER.match(k) and not _BUFFER.fullmatch(k)]
    first: dict[tuple[str, str], int] = {}  # a block's head -> the place of its first key
    for here, key in enumerate(keys):
        for pattern in (_LAYERS, _EXPERTS):
            if found := pattern.match(key):
                first.setdefault((pattern.pattern, found.group(0)), here)
    places = []
    for here, key in enumerate(keys):
        stacked, experts = _LAYERS.match(key), _EXPERTS.match(key)
        among = first[(_EXPERTS.pattern, experts.group(0))] if experts else here
        start = first[(_LAYERS.pattern, stacked.group(0))] if stacked else among
        for name, _ in split[key]:
            layer = _index(name, stacked.group(0)) if stacked else 0
            expert = int(_EXPERT.match(name).group(1)) if experts else 0
            places.append(((start, layer, among, expert, here), name))
    return [name for _, name in sorted(places)]


def _index(name: str, head: str) -> int:
    """The number that follows ``head`` in a split tensor's name."""
    return int(name[len(head) :].split(".", 1)[0])


def _bucket_groups(
    folder: dcp_folder.DcpFolder, ranks: int, prefix: str = ""
) -> tuple[int | float, dict]:
    """The distributed optimizer's param groups (``DistributedOptimizer.state_dict``'s, saved
    as one object per model-parallel rank): the one Adam step of every parameter, and the
    hyperparameters."""
    where = folder.metadata_file
    groups: list = []
    for rank in range(ranks):
        name = prefix + _GROUPS.format(rank)
        if name not in folder.meta.entries:
            raise InputError(
                f"{where}: holds no {name} (the distributed optimizer's param groups: "
                "its step, betas, lr and eps)"
            )
        value = folder.value(name)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # the object as Megatron's torch_dist saves it: in a list
        mine = value.get("param_groups") if isinstance(value, dict) else None
        if not isinstance(mine, list) or not mine or not all(isinstance(g, dict) for g in mine):
            raise InputError(f"{where}: {name} is not the distributed optimizer's param groups")
        groups += mine
    if not one_setting(groups):
        raise InputError(
            f"{where}: the distributed optimizer's param groups differ in lr, betas or eps, "
            "and Megatron does not save which parameters each holds"
        )
    steps = {g.get("step") for g in groups}
    step = next(iter(steps))
    if len(steps) != 1 or not is_number(step):
        raise InputError(f"{where}: the distributed optimizer's param groups give no one step")
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    return step, {k: v for k, v in groups[0].items() if k not in ("params", "step")}


def _check_chunks(entry: dict, bucket, unfit, which: str) -> None:
    """Every saved chunk lies within one parameter's range or between two (Megatron saves
    each rank's range of each parameter, and each padding, as a chunk of its own)."""
    edges = sorted({e for place in bucket.places.values() for e in place})
    for key, tensor in entry.items():
        for piece in tensor.pieces:
            lo, hi = piece.offsets[0], piece.offsets[0] + piece.shape[0]
            inside_edges = bisect.bisect_right(edges, lo) != bisect.bisect_left(edges, hi)
            if inside_edges:
                raise unfit(f"{which}'s {key} has a chunk {lo}..{hi} across a parameter's edge")


def _flat_range(name: str, shape, tensor: StoredTensor, start: int, end: int) -> StoredTensor:
    """Elements ``start..end`` of a flat stored tensor, as a tensor of ``shape``."""
    pieces = []
    for piece in tensor.pieces:
        lo = max(start, piece.offsets[0])
        hi = min(end, piece.offsets[0] + piece.shape[0])
        if lo < hi:
            cut = (lo - piece.offsets[0], hi - piece.offsets[0])
            pieces.append(Piece((lo - start,), (hi - lo,), _cut(piece.read, *cut), piece.file))
    return StoredTensor(name, shape, tensor.dtype, pieces, flat=True)


def _cut(read, lo: int, hi: int):
    return lambda: read()[lo:hi]
