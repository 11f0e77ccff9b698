"""Megatron legacy checkpoints: ``iter_NNNNNNN/mp_rank_XX/model_optim_rng.pt``.

Megatron-LM's ``save_checkpoint`` with ``--ckpt-format torch`` (core_v0.16.1,
``megatron/training/checkpointing.py``) has each tensor-parallel rank ``XX``
of the first data-parallel rank ``torch.save`` one file,
``<save>/iter_0000003/mp_rank_XX/model_optim_rng.pt``, then writes the tracker
``<save>/latest_checkpointed_iteration.txt`` (``megatron.py`` follows it to
either format). The file holds ``args`` (an ``argparse.Namespace``, read as
inert data: ``files/megatron_pickle``), ``iteration``, ``checkpoint_version``,
``model`` (the module's ``state_dict_for_save_checkpoint``: tensors by name,
with ``*._extra_state`` entries for Transformer Engine's state, skipped here),
``optimizer``, ``opt_param_scheduler`` and ``rng_state``.

``optimizer`` is the Megatron optimizer's ``state_dict()``:

* ``FP32Optimizer``: torch's own optimizer state dict, over Megatron's param
  groups (decayed weights; biases and norms without decay), ids only;
* ``Float16OptimizerWithFloat16Params`` (bf16, fp16): ``{"optimizer": <torch's>,
  "grad_scaler": ..., "fp32_from_fp16_params": [[fp32 copy, ...] per group]}``:
  each group's fp32 master copies of its 16-bit parameters, in group order.
  These masters are the weights reported (the model's own copy is rounded);
* ``ChainedOptimizer`` of several: a list of the above, one per optimizer;
* the distributed optimizer keeps its state in ``distrib_optim.pt`` beside the
  file, which is not read: the moments are then not measured, and the
  description says so.

Recognised by content: an ``iter_N/`` folder holding ``mp_rank_XX/model_optim_rng.pt``;
the save folder, by its tracker (``megatron.py``, which hands a legacy iteration here).

Parameter ids map to names by the model's order group by group
(``what.map_names``, the contract's one interleaving that fits every shape).

Tensor parallelism (``mp_rank_00``, ``mp_rank_01``...): each rank saves its own
shards under the same names, and a norm needs no merge: a split parameter's
norm is the norm of its shards, so it becomes one tensor of its full shape whose
pieces are the ranks' shards; a replicated one (norms, the row-parallel layers'
biases, learned position embeddings) counts once, from ``mp_rank_00``, as
Megatron's ``get_grad_norm_fp32`` counts a parameter only where
``param_is_not_tensor_parallel_duplicate`` (its ``tensor_model_parallel``
attribute, set by the parallel layers and saved nowhere). So replication is
decided from Megatron-core's module names (``_split_axis``) and checked against
``args.hidden_size``; a name the rules do not know is refused, naming the file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files.megatron_pickle import GLOBALS, NamespaceState
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import Contents, OptimizerState, Piece, StoredTensor
from gradclip_cli.source.what import map_names

from .dcp_frameworks import refuse_key
from .paths import inside
from .torch_optim import is_optimizer_state, optimizer_state

KIND = "megatron-legacy"
FILE = "model_optim_rng.pt"
DISTRIBUTED = "distrib_optim.pt"
_RANK = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){1,2})?")
_EXTRA = "._extra_state"

# Megatron-core's tensor-parallel layers (core_v0.16.1 ``tensor_parallel/layers.py``) by the
# names its GPT, BERT and T5 specs give them: column-parallel layers split their output rows
# (weight and bias along axis 0), row-parallel ones their input columns (weight along axis 1;
# the bias is added after the all-reduce, replicated); the vocabulary-parallel embedding
# splits its rows.
_COLUMN = ("linear_qkv", "linear_q", "linear_kv", "linear_fc1", "output_layer", "word_embeddings")
_ROW = ("linear_proj", "linear_fc2")
# Replicated: the norms (``*layernorm``, Transformer Engine's fused ``layer_norm_*``) and the
# learned position embeddings (a plain ``torch.nn.Embedding``).
_REPLICATED = re.compile(
    r"(^|\.)((\w*layernorm|\w*_norm)\.(weight|bias)|layer_norm_(weight|bias)"
    r"|position_embeddings\.weight)$"
)


def recognises(path: Path) -> bool:
    """An ``iter_N/`` folder of the legacy format (its save folder is ``megatron``'s), one
    rank's ``mp_rank_XX/`` folder, or its ``model_optim_rng.pt``."""
    if os.path.isdir(path):
        return is_iteration(path) or _is_rank(path)
    return path.name == FILE and _is_rank(path.parent)


def _is_rank(folder: Path) -> bool:
    return _RANK.fullmatch(folder.name) is not None and os.path.isfile(folder / FILE)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "a Megatron legacy checkpoint")
    if os.path.isdir(path) and is_iteration(path):
        return open_iteration(path, path, None, trust_pickle=trust_pickle, verify=verify)
    return _open_rank(
        path, path if os.path.isdir(path) else path.parent, trust_pickle=trust_pickle, verify=verify
    )


def is_iteration(path: Path) -> bool:
    """A folder of ``mp_rank_XX/model_optim_rng.pt`` (cheap: names only)."""
    try:
        return any(_RANK.fullmatch(n) and os.path.isfile(path / n / FILE) for n in os.listdir(path))
    except OSError:
        return False


def _open_rank(path: Path, rank_folder: Path, *, trust_pickle: bool, verify: bool) -> Contents:
    """One tensor-parallel rank alone: its own shards, said to cover that rank only."""
    contents = open_iteration(
        path,
        rank_folder.parent,
        None,
        trust_pickle=trust_pickle,
        verify=verify,
        only=rank_folder.name,
    )
    siblings = [n for n in os.listdir(rank_folder.parent) if _RANK.fullmatch(n)]
    if len(siblings) > 1:
        contents.description.append(
            f"covers {rank_folder.name} only, one of {len(siblings)} tensor-parallel ranks: "
            f"its shards alone; {visible(rank_folder.parent.name)}/ holds the whole model"
        )
    return contents


def open_iteration(
    path: Path,
    folder: Path,
    tracker: Path | None,
    *,
    trust_pickle: bool,
    verify: bool,
    only: str | None = None,
) -> Contents:
    ranks = _read_ranks(folder, trust_pickle=trust_pickle, verify=verify, only=only)
    first = ranks[0]
    step = _same(ranks, "iteration", lambda r: r.iteration)
    names, kinds = _tensor_parallel(ranks)
    files = [r.file for r in ranks]
    weights = {n: _merged(n, [r.weights[n] for r in ranks], kinds[n], files) for n in names}
    optimizer, note = _optimizer(ranks, names, kinds)
    contents = Contents(
        path=path,
        kind=KIND,
        files=([tracker] if tracker else []) + [r.file for r in ranks],
        folder=folder,
        trusted_pickle=any(r.trusted for r in ranks),
    )
    if optimizer is not None and ranks[0].masters:  # the float16 optimizer's fp32 masters
        weights = {n: _merged(n, [r.masters[n] for r in ranks], kinds[n], files) for n in names}
        note = (note or "") + (
            "the weights are the optimizer's fp32 masters "
            "(fp32_from_fp16_params); the model holds them rounded"
        )
    contents.weights = weights or None
    contents.model_order_names = list(names)
    if first.buffers:  # integer tensors: never weights (replicated or not, rank 0's)
        contents.buffers = {
            n: StoredTensor.whole(n, t, first.file) for n, t in first.buffers.items()
        }
    if optimizer is not None:
        contents.optimizers.append(optimizer)
    contents.step = step
    contents.gradient_error = (
        f"{path}: a Megatron legacy checkpoint saves no gradients (model, optimizer state, {FILE})"
    )
    via = f" ({tracker.name} names {folder.name})" if tracker is not None else ""
    at = f" at iteration {step}" if step is not None else ""
    rank_names = ", ".join(r.file.parent.name for r in ranks)
    contents.description.append(
        f"Megatron legacy checkpoint{via}{at}: "
        + (
            f"{len(ranks)} tensor-parallel rank(s) ({rank_names})"
            if only is None
            else f"tensor-parallel rank {rank_names}"
        )
        + f", {len(names)} model tensors ({len(first.skipped)} _extra_state entries skipped "
        "per rank)"
    )
    if len(ranks) > 1:
        split = sum(1 for k in kinds.values() if k is not None)
        contents.description.append(
            f"{split} tensors split across the ranks (measured as their shards together), "
            f"{len(names) - split} replicated (counted once, from mp_rank_00, as Megatron's "
            "get_grad_norm_fp32 does)"
        )
    if note:
        contents.description.append(note)
    return contents


class _Rank:
    """One ``mp_rank_XX/model_optim_rng.pt``: its model tensors and optimizer state, loaded."""

    def __init__(self, file: Path, root: dict, trusted: bool):
        self.file = file
        self.root = root
        self.trusted = trusted
        self.args = root.get("args").state if isinstance(root.get("args"), NamespaceState) else {}
        self.iteration = _iteration(root, self.args, file)
        self.weights: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.skipped: list[str] = []
        model = root.get("model")
        if not isinstance(model, Mapping):
            chunks = sorted(k for k in root if isinstance(k, str) and re.fullmatch(r"model\d+", k))
            why = (
                (
                    f"holds {len(chunks)} virtual pipeline chunks ({', '.join(chunks)}); "
                    "gradclip reads one model"
                )
                if chunks
                else "holds no 'model' state dict"
            )
            raise InputError(f"{file}: {why}")
        for name, value in model.items():
            if not isinstance(name, str):
                raise InputError(
                    f"{file}: its model is keyed by {visible(repr(name))[:40]}, not by names"
                )
            if name.endswith(_EXTRA):
                self.skipped.append(name)  # Transformer Engine's state (None without it)
            elif isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
                self.weights[name] = value
            elif isinstance(value, torch.Tensor):
                self.buffers[name] = value
            else:
                raise InputError(
                    f"{file}: its model entry {visible(name)} is a "
                    f"{type(value).__name__}, not a tensor"
                )
        self.masters: dict[str, torch.Tensor] = {}
        self.optimizer: OptimizerState | None = None
        self.names: dict[int, str] = {}


def _read_ranks(
    folder: Path, *, trust_pickle: bool, verify: bool, only: str | None = None
) -> list[_Rank]:
    found = sorted(n for n in os.listdir(folder) if _RANK.fullmatch(n))
    if only is not None:
        found = [only]
    extra = [n for n in found if _RANK.fullmatch(n).group(2)]
    if extra:
        raise InputError(
            f"{folder / extra[0]}: a pipeline- or expert-parallel rank; gradclip "
            "reads Megatron legacy checkpoints of tensor-parallel ranks only"
        )
    expected = [f"mp_rank_{r:02d}" for r in range(len(found))]
    if only is None and found != expected:
        missing = next(e for e in expected if e not in found)
        raise InputError(
            f"{folder}: holds {', '.join(found)} but no {missing}: the "
            "tensor-parallel ranks are incomplete"
        )
    ranks = []
    for name in found:
        file = inside(folder, f"{name}/{FILE}", named_by=folder)
        if not os.path.isfile(file):
            raise InputError(f"{file}: missing (its rank folder {name}/ has no {FILE})")
        with allowing(GLOBALS):
            ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
        if not isinstance(ckpt.root, Mapping):
            raise InputError(f"{file}: not a Megatron checkpoint: not a dict")
        ranks.append(_Rank(file, dict(ckpt.root), ckpt.trusted_pickle))
    for rank in ranks:
        size = rank.args.get("tensor_model_parallel_size")
        if only is None and isinstance(size, int) and size != len(ranks):
            raise InputError(
                f"{rank.file}: its args say tensor_model_parallel_size {size}, "
                f"but {folder.name}/ holds {len(ranks)} mp_rank folder(s)"
            )
        pipeline = rank.args.get("pipeline_model_parallel_size")
        if isinstance(pipeline, int) and pipeline != 1:
            raise InputError(
                f"{rank.file}: its args say pipeline_model_parallel_size "
                f"{pipeline}; gradclip reads tensor-parallel ranks only"
            )
    return ranks


def _iteration(root: Mapping, args: Mapping, file: Path) -> int | None:
    value = root.get("iteration", args.get("iteration"))
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{file}: iteration is {visible(repr(value))[:40]}, not a step")
    return value


def _same(ranks: list[_Rank], what: str, get) -> Any:
    value = get(ranks[0])
    for rank in ranks[1:]:
        if get(rank) != value:
            raise InputError(
                f"{rank.file}: {what} {get(rank)}, but "
                f"{ranks[0].file.parent.name}'s is {value}: the ranks are not "
                "one checkpoint"
            )
    return value


# ----------------------------------------------------------------- tensor parallelism


def _split_axis(name: str, shape: tuple[int, ...], hidden: int | None, file: Path) -> int | None:
    """The axis Megatron splits ``name`` along across tensor-parallel ranks; None:
    replicated. Decided by the module's name, checked against the hidden size."""

    def unfit(why: str) -> InputError:
        return InputError(
            f"{file}: {visible(name)} (shape {list(shape)}) {why}; "
            "gradclip cannot tell how it is split across tensor-parallel ranks"
        )

    module, _, kind = name.rpartition(".")
    layer = module.rpartition(".")[2]
    if _REPLICATED.search(name):
        return None
    if hidden is None:
        raise unfit("is not a norm, and the args give no hidden_size to check a split by")
    if layer in _COLUMN and kind in ("weight", "bias"):
        if kind == "weight" and (len(shape) != 2 or shape[1] != hidden):
            raise unfit(f"is not a column-parallel weight of input size {hidden}")
        if kind == "bias" and len(shape) != 1:
            raise unfit("is not a column-parallel bias")
        return 0
    if layer in _ROW and kind == "weight":
        if len(shape) != 2 or shape[0] != hidden:
            raise unfit(f"is not a row-parallel weight of output size {hidden}")
        return 1
    if layer in _ROW and kind == "bias":
        if shape != (hidden,):
            raise unfit(f"is not a row-parallel bias of size {hidden}")
        return None
    raise unfit("is not a layer Megatron-core's naming says how to split")


def _tensor_parallel(ranks: list[_Rank]) -> tuple[list[str], dict[str, int | None]]:
    """The model's names (rank 0's order), and each one's split axis (None: replicated)."""
    first = ranks[0]
    names = list(first.weights)
    for rank in ranks[1:]:
        if list(rank.weights) != names:
            other = next(iter(set(rank.weights) ^ set(names)), None)
            which = f" ({visible(other)} is in one only)" if other is not None else ""
            raise InputError(
                f"{rank.file}: its model tensors differ from "
                f"{first.file.parent.name}'s{which}: the ranks are not one model"
            )
        for n in names:
            a, b = first.weights[n], rank.weights[n]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise InputError(
                    f"{rank.file}: {visible(n)} is {list(b.shape)} {b.dtype}, "
                    f"{list(a.shape)} {a.dtype} in {first.file.parent.name}: the "
                    "ranks are not one model"
                )
    if len(ranks) == 1:
        return names, dict.fromkeys(names)
    hidden = first.args.get("hidden_size")
    hidden = hidden if isinstance(hidden, int) and not isinstance(hidden, bool) else None
    return names, {
        n: _split_axis(n, tuple(first.weights[n].shape), hidden, first.file) for n in names
    }


def _merged(name: str, shards: list[torch.Tensor], axis: int | None, files=None) -> StoredTensor:
    """One rank's tensor (replicated), or the ranks' shards as one tensor split on ``axis``."""
    if axis is None or len(shards) == 1:
        return StoredTensor.whole(name, shards[0], files[0] if files else None)
    shape = list(shards[0].shape)
    pieces = []
    for r, shard in enumerate(shards):
        offsets = [0] * len(shape)
        offsets[axis] = r * shape[axis]
        pieces.append(
            Piece(
                tuple(offsets),
                tuple(shard.shape),
                (lambda t=shard: t),
                files[r] if files else None,
                shard,
            )
        )
    full = list(shape)
    full[axis] *= len(shards)
    return StoredTensor(name, full, shards[0].dtype, pieces)


# ----------------------------------------------------------------- optimizer


_DISTRIBUTED_NOTE = (
    f"the optimizer state is in {DISTRIBUTED} (Megatron's distributed optimizer: "
    "flat buffers of the ranks' grad-buffer shards), which gradclip does not read: "
    "moments not measured"
)


def _torch_states(rank: _Rank) -> list[tuple[Any, list | None, str]] | str:
    """``[(torch state dict, fp32 masters per group or None, where)]``, or why there are none."""
    value = rank.root.get("optimizer")
    if os.path.isfile(rank.file.parent / DISTRIBUTED):
        return _DISTRIBUTED_NOTE
    if value is None:
        return "no optimizer state saved (--no-save-optim)"
    chained = value if isinstance(value, list) else [value]
    out = []
    for i, one in enumerate(chained):
        where = f"optimizer[{i}]" if isinstance(value, list) else "optimizer"
        inner = one.get("optimizer") if isinstance(one, Mapping) else None
        if is_optimizer_state(one):
            out.append((one, None, where))
        elif is_optimizer_state(inner):
            masters = one.get("fp32_from_fp16_params")
            if masters is not None and not (
                isinstance(masters, list) and all(isinstance(g, list) for g in masters)
            ):
                raise InputError(
                    f"{rank.file}: {where}.fp32_from_fp16_params is not a list of groups"
                )
            out.append((inner, masters, f"{where}.optimizer"))
        elif isinstance(inner, Mapping) and "state" not in inner:
            # The distributed optimizer's state_dict(): param groups without their params.
            return _DISTRIBUTED_NOTE.replace("is in", "was saved apart, in", 1)
        else:
            raise InputError(f"{rank.file}: {where} is not a Megatron optimizer state dict")
    return out


def _rank_optimizer(rank: _Rank) -> str | None:
    """Fill ``rank.optimizer`` (ids renumbered across a chain), ``names`` and ``masters``."""
    found = _torch_states(rank)
    if isinstance(found, str):
        return found
    groups: list[dict] = []
    state: dict[int, dict] = {}
    group_masters: list[tuple[list[int], list, str]] = []
    offset = 0
    for value, masters, where in found:
        opt = optimizer_state(value, rank.file, where)
        ids = sorted({p for g in opt.param_groups for p in g["params"]})
        renumber = {p: offset + i for i, p in enumerate(ids)}
        offset += len(ids)
        if masters is not None and len(masters) != len(opt.param_groups):
            raise InputError(
                f"{rank.file}: {where} has {len(opt.param_groups)} param groups "
                f"but fp32_from_fp16_params {len(masters)}"
            )
        for g, group in enumerate(opt.param_groups):
            members = [renumber[p] for p in group["params"]]
            groups.append({**group, "params": members})
            if masters is not None:
                group_masters.append((members, masters[g], f"{where}: fp32_from_fp16_params[{g}]"))
        for p, entry in opt.state.items():
            state[renumber[p]] = entry
    merged = OptimizerState(groups, state, None, rank.file)
    probe = Contents(path=rank.file, kind=KIND, weights=_stored_weights(rank))
    rank.names = map_names(probe, merged)
    rank.optimizer = merged
    for members, masters, where in group_masters:
        # The float16 optimizer keeps an fp32 master of each 16-bit parameter of a group, in
        # the group's order; an fp32 parameter is its own master.
        sixteen = [
            rank.names[p]
            for p in members
            if p in rank.names
            and rank.weights[rank.names[p]].dtype in (torch.float16, torch.bfloat16)
        ]
        if len(sixteen) != len(masters):
            raise InputError(
                f"{rank.file}: {where} holds {len(masters)} tensors for the "
                f"group's {len(sixteen)} 16-bit parameters"
            )
        for name, master in zip(sixteen, masters):
            if (
                not isinstance(master, torch.Tensor)
                or master.shape != rank.weights[name].shape
                or not master.dtype.is_floating_point
            ):
                raise InputError(
                    f"{rank.file}: {where} holds no fp32 tensor of {visible(name)}'s shape"
                )
            rank.masters[name] = master
    for name, weight in rank.weights.items():
        if rank.masters and name not in rank.masters:
            rank.masters[name] = weight  # an fp32 parameter, or one without optimizer state
    return None


def _stored_weights(rank: _Rank) -> dict[str, StoredTensor]:
    return {n: StoredTensor.whole(n, t, rank.file) for n, t in rank.weights.items()}


def _optimizer(
    ranks: list[_Rank], names: list[str], kinds: dict[str, int | None]
) -> tuple[OptimizerState | None, str | None]:
    notes = {_rank_optimizer(r) for r in ranks}
    if notes != {None}:
        return None, next(n for n in notes if n is not None)
    first = ranks[0]
    by_name = [{n: pid for pid, n in r.names.items()} for r in ranks]
    groups = []
    state: dict[int, dict] = {}
    param_names: dict[int, str] = {}
    order = {n: i for i, n in enumerate(names)}
    for group in first.optimizer.param_groups:
        members = [first.names[p] for p in group["params"] if p in first.names]
        for name in members:
            entries = [r.optimizer.state.get(by_name[i].get(name)) for i, r in enumerate(ranks)]
            if any(e is None for e in entries):
                missing = ranks[next(i for i, e in enumerate(entries) if e is None)]
                raise InputError(
                    f"{missing.file}: holds no optimizer state for "
                    f"{visible(name)}, which {first.file.parent.name} has: the "
                    "ranks are not one checkpoint"
                )
            entry = {}
            for key, value in entries[0].items():
                if isinstance(value, StoredTensor):
                    shards = [e.get(key) for e in entries]
                    if not all(
                        isinstance(s, StoredTensor) and s.shape == value.shape for s in shards
                    ):
                        raise InputError(
                            f"{ranks[-1].file}: its {key} of {visible(name)} "
                            "differs in shape from mp_rank_00's"
                        )
                    entry[key] = _merged(
                        f"{name}.{key}",
                        [s.read() for s in shards],
                        kinds[name],
                        [r.file for r in ranks],
                    )
                else:
                    entry[key] = value
            state[order[name]] = entry
            param_names[order[name]] = name
        groups.append({**group, "params": [order[n] for n in members]})
    return OptimizerState(groups, state, param_names, first.file), None
