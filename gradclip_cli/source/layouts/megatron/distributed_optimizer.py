"""Megatron's distributed optimizer: its grad-buffer layout, and its state read by that
layout in both checkpoint formats.

Megatron-core's ``_ParamAndGradBuffer`` (core_v0.16.1,
``megatron/core/distributed/param_and_grad_buffer.py``) lays a buffer's
parameters out in reverse model order (roughly backprop's), and with the
distributed optimizer pads each parameter's start to a multiple of 64
elements (``_pad_start_of_param_if_needed``). A bucket closes once it holds
``bucket_size`` elements (``param_end_index - bucket_start_index >=
bucket_size``; never, when ``bucket_size`` is None), and a ``shared_embedding``
parameter gets a bucket of its own (``_does_param_require_new_bucket``: the
bucket before it closes at its padded start). A bucket's end is then padded to
a multiple of ``lcm(data-parallel size, 128)``, so every bucket starts 64-aligned
and a parameter's place *within its bucket* does not depend on the
data-parallel size; ``numel_unpadded`` is a bucket's length without that end
padding.

The distributed optimizer saves that layout two ways, each read here: ``distrib_optim.pt``
(legacy format, ``distrib_optim``) holds each buffer as its buckets' unpadded lengths side
by side (``concatenated``); Megatron's ``torch_dist`` with ``dp_reshardable`` saves each
bucket as a tensor of its own, ``numel_unpadded`` long (``bucketed``). Both keep the one
Adam step of every parameter in the param groups (``one_step``), which must agree on lr,
betas and eps (``one_setting``): neither says which parameters each group holds. Both
check each parameter's ``param`` slice, its fp32 main copy, against the model's tensor
by ``master_copy.rounds_to`` before a moment is read.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files.megatron_pickle import GLOBALS
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import OptimizerState, Piece, StoredTensor, chained
from gradclip_cli.source.untrusted import is_number

from .. import dcp_folder
from ..master_copy import rounds_to
from .facts import Buckets
from .model import EXPERT, SIXTEEN, dtypes, model_order, refuse_if
from .pipeline import copy_name
from .tracker import DISTRIBUTED

ALIGN = 64  # a parameter starts at a multiple of 64 elements of its bucket (core_v0.16.1)


@dataclass(frozen=True)
class Bucket:
    """One bucket: each parameter's ``(start, end)`` from the bucket's start, and its
    length without the end padding (``numel_unpadded``)."""

    places: dict[str, tuple[int, int]]
    numel_unpadded: int


def buckets(
    names: Sequence[str],
    numels: Mapping[str, int],
    *,
    bucket_size: int | None = None,
    sizes: Sequence[int] | None = None,
    own: frozenset[str] | set[str] = frozenset(),
) -> list[Bucket]:
    """The buckets of one buffer whose parameters are ``names`` in model order.

    A bucket closes as Megatron's DDP closes it: once it holds ``bucket_size``
    elements, or, given ``sizes`` instead (the saved buckets' lengths), once it
    reaches its saved length (``fits_one_bucket_size`` then checks that one
    ``bucket_size`` closes them all so); one of ``own`` sits in a bucket alone.
    """
    out: list[Bucket] = []
    places: dict[str, tuple[int, int]] = {}
    cursor = 0

    def close(end: int) -> None:
        nonlocal places, cursor
        out.append(Bucket(places, end))
        places, cursor = {}, 0

    for name in reversed(names):
        start = -(-cursor // ALIGN) * ALIGN
        if name in own and places:  # the bucket before it closes at its padded start
            close(start)
            start = 0
        end = start + numels[name]
        places[name] = (start, end)
        if sizes is not None:
            full = len(out) < len(sizes) and end >= sizes[len(out)]
        else:
            full = bucket_size is not None and end >= bucket_size
        if full or name in own:
            close(end)
        else:
            cursor = end
    if places:
        close(cursor)
    return out


def fits_one_bucket_size(layout: Sequence[Bucket]) -> bool:
    """Whether one ``bucket_size`` closes every bucket where it closes: each parameter's end
    before its bucket's last below it, each bucket but the last reaching it."""
    below = [e for b in layout for _, e in sorted(b.places.values())[:-1]]
    reach = [b.numel_unpadded for b in layout[:-1]]
    return not below or not reach or max(below) < min(reach)


def concatenated(layout: Sequence[Bucket]) -> dict[str, tuple[int, int]]:
    """Each parameter's ``(start, end)`` in the buckets laid side by side without their end
    padding (``get_parameter_state_dp_zero``'s flat buffer)."""
    out, offset = {}, 0
    for bucket in layout:
        for name, (start, end) in bucket.places.items():
            out[name] = (offset + start, offset + end)
        offset += bucket.numel_unpadded
    return out


# What every param group of one distributed optimizer must share: its buckets (and
# distrib_optim.pt) do not say which parameters each group holds.
HYPER = ("lr", "betas", "eps", "amsgrad")


def one_setting(groups: Sequence[Mapping], keys: Sequence[str] = HYPER) -> bool:
    """Whether every param group has the first one's ``keys``: lr, betas, eps and amsgrad."""
    first = {k: groups[0].get(k) for k in keys}
    return all({k: g.get(k) for k in keys} == first for g in groups)


def one_step(groups: Sequence[Mapping]) -> int | float | None:
    """The one Adam step of every parameter, which the distributed optimizer keeps in its
    param groups (``DistributedOptimizer.state_dict``), a whole float as an int; None where
    the groups give none, or several."""
    steps = {g.get("step") for g in groups}
    step = next(iter(steps))
    if len(steps) != 1 or not is_number(step):
        return None
    return int(step) if isinstance(step, float) and step.is_integer() else step


# ----------------------------------------------------------------- torch_dist: dp_reshardable

_BUCKET = re.compile(
    r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)"
    r"\.dtype_\((torch\.\w+), (torch\.\w+)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)"
)
_GROUPS = "optimizer.distributed.dp_group_idx_{}.optimizer/shard_0_1"
_CHAINED = re.compile(r"chained_(\d+)\.optimizer\.distributed\.")


def sharding_of(folder: dcp_folder.DcpFolder, root: dict) -> str | None:
    """The distributed optimizer's ``param_state_sharding_type``, shown, where its state is
    what the folder holds (``dp_reshardable``'s buckets, ``optimizer.distributed.``), else None."""
    optim = root.get("optimizer")
    sharding = optim.get("param_state_sharding_type") if isinstance(optim, dict) else None
    if sharding is None and not any(k.startswith("optimizer.distributed.") for k in folder.tensors):
        return None
    return repr(sharding) if sharding is not None else "its buckets"


def chained_count(folder: dcp_folder.DcpFolder) -> int:
    """How many chained distributed optimizers (``chained_N.``) the folder holds buckets of."""
    found = {m.group(1) for k in folder.tensors if (m := _CHAINED.match(k))}
    return len(found)


def chained_bucketed(
    folder: dcp_folder.DcpFolder, split, weights, root: dict, common_file: Path
) -> tuple[OptimizerState, tuple[Buckets, ...], dict[str, StoredTensor]]:
    """The two chained distributed optimizers of expert parallelism, each under its
    ``chained_N.`` prefix (``ChainedOptimizer.sharded_state_dict``), read by ``bucketed``
    over its own parameters: the experts' (its param groups' ``is_expert_parallel``; its
    ``dp_group_idx_N`` the expert-parallel rank), or the rest. Another chain is refused."""
    optim = root.get("optimizer")
    parts = list(optim.values()) if isinstance(optim, dict) else []
    shardings = [p.get("param_state_sharding_type") if isinstance(p, dict) else p for p in parts]
    refuse_if(shardings != ["dp_reshardable"] * 2, common_file,
              "the optimizer is a ChainedOptimizer of distributed optimizers saved as "
              f"{quoted(shardings)[:80]}; gradclip reads the two of expert parallelism "
              "(the dense parameters' and the experts'), each dp_reshardable")
    count = chained_count(folder)
    refuse_if(count != 2, folder.metadata_file, f"holds the buckets of {count} chained "
              "distributed optimizers (chained_N.optimizer.distributed.*), where "
              f"{common_file.name} lists 2")
    experts = {name for name in weights if EXPERT.match(name)}
    flags = [
        _bucket_groups(folder, 1, f"chained_{k}.")[1].get("is_expert_parallel") for k in (0, 1)
    ]
    refuse_if(sorted(flags, key=repr) != [False, True], folder.metadata_file,
              "the chained distributed optimizers' param groups say is_expert_parallel "
              f"{quoted(flags)[:60]}, not one dense and one expert optimizer: gradclip "
              "cannot tell which parameters each holds")
    states, read, mains = [], [], {}
    for k, expert in enumerate(flags):
        state, (facts,), main = bucketed(
            folder, split, weights, f"chained_{k}.",
            experts if expert else set(weights) - experts,
            "expert-parallel" if expert else "model-parallel",
        )
        states.append(state)
        read.append(replace(facts, whose="the experts'" if expert else "the dense parameters'"))
        mains.update(main)
    optimizer, _ = chained(states, folder.metadata_file)
    return optimizer, tuple(read), mains


def bucketed(
    folder: dcp_folder.DcpFolder, split, weights, prefix: str = "",
    only: set[str] | None = None, ranked: str = "model-parallel",
) -> tuple[OptimizerState, tuple[Buckets], dict[str, StoredTensor]]:
    """The distributed optimizer's ``dp_reshardable`` state as per-parameter moments, and
    each parameter's ``param`` (its fp32 main copy, assembled over tensor-parallel ranks as
    the moments are).

    ``DistributedOptimizer.sharded_param_state_dp_reshardable`` (core_v0.16.1) saves each
    bucket flat,
    ``optimizer.distributed.dp_group_idx_N.gbuf_idx_G.dtype_(param, grad).bucket_idx_K.*``
    (``param``, ``exp_avg``, ``exp_avg_sq``), N the model-parallel rank (``_holdings``),
    one chunk per parameter's range (or padding's) on each data-parallel rank. The places,
    rebuilt by ``buckets`` (one buffer per parameter dtype, each bucket closing at its
    saved length), are checked before any moment is read: one bucket size closes them all,
    every chunk lies within one parameter or between two, and each ``param`` rounds to the
    model's tensor (its shard); else the checkpoint is refused, naming the file."""
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
        refuse_if(part is None, where, f"holds {quoted(key)[:120]}, not a bucket's param, "
                  "exp_avg or exp_avg_sq of Megatron's dp_reshardable distributed optimizer")
        per_buffer = found.setdefault(int(part.group(1)), {})
        dtype, entry = per_buffer.setdefault(int(part.group(2)), (part.group(3), {}))
        if dtype != part.group(3):
            raise unfit(f"grad buffer {part.group(2)} holds buckets of two dtypes")
        if tensor.dtype != torch.float32 or len(tensor.shape) != 1:
            raise unfit(f"{quoted(key)[:120]} is not a flat fp32 tensor")
        entry.setdefault(int(part.group(5)), {})[part.group(6)] = tensor
    ranks = len(found)
    if sorted(found) != list(range(ranks)):
        raise unfit(f"model-parallel groups {sorted(found)}, not numbered 0, 1, ...")
    order = [name for name in model_order(split) if only is None or name in only]
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
            raise unfit(f"{which}grad buffers of {buffer_dtypes}, the model's parameters are "
                        f"{list(by_dtype)}")
        for g, names in zip(sorted(found[rank]), by_dtype.values()):
            dtype, per_bucket = found[rank][g]
            if sorted(per_bucket) != list(range(len(per_bucket))):
                raise unfit(f"{which}grad buffer {g}'s buckets are not numbered 0, 1, ...")
            tensors = []
            for k in sorted(per_bucket):
                entry = per_bucket[k]
                complete = set(entry) == {"param", "exp_avg", "exp_avg_sq"}
                if not complete or len({t.shape for t in entry.values()}) != 1:
                    raise unfit(f"{which}bucket {k} of grad buffer {g} is not param, exp_avg "
                                "and exp_avg_sq of one length")
                tensors.append(entry)
            sizes = [t["param"].shape[0] for t in tensors]
            numels = {
                n: weights[n].numel() if shards[n] is None else shards[n].numel for n in names
            }
            layout = buckets(names, numels, sizes=sizes)
            laid = [b.numel_unpadded for b in layout]
            if laid != sizes:
                raise unfit(f"buckets of {laid} elements laid out, {which}grad buffer {g} "
                            f"holds {sizes}")
            if not fits_one_bucket_size(layout):
                raise unfit(f"{which}grad buffer {g}'s buckets close where no one bucket size "
                            "closes them")
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
                                f", rounded to {dtypes(weights, [name])},"
                                if weight.dtype in SIXTEEN
                                else ""
                            )
                            raise unfit(
                                f"{name}'s slice of {which}bucket {k}'s param"
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
                key: _assembled(f"{name}.{key}", weights[name].shape, held_by.values(), key)
                for key in ("param", "exp_avg", "exp_avg_sq")
            }
        mains[name] = dcp_folder.renamed(moments.pop("param"), name)
        state[index[name]] = {**moments, "step": step}
    group = {**group, "params": sorted(state)}
    facts = Buckets("the distributed optimizer's", count, ranks, ranked, prefix)
    return OptimizerState([group], state, {i: order[i] for i in state}, where), (facts,), mains


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
                                f"{piece.file.name} holds buckets of model-parallel "
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
                    f"{name} has a chunk in {piece.file.name}, which holds "
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
                f"{name}'s {len(pieces)} chunks are not one per tensor-parallel rank "
                f"of one pipeline stage (written by model-parallel ranks {groups})"
            )
        main[name] = groups[0]
    return held, main


def _writer(piece: Piece, unfit) -> int:
    found = _WRITER.fullmatch(piece.file.name) if piece.file is not None else None
    if found is None:
        raise unfit(f"a chunk in {piece.file}, not a process's __R_K.distcp")
    return int(found.group(1))


def _bucket_groups(
    folder: dcp_folder.DcpFolder, ranks: int, prefix: str = ""
) -> tuple[int | float, dict]:
    """The one Adam step and the hyperparameters of the distributed optimizer's param groups
    (one object per model-parallel rank)."""
    where = folder.metadata_file
    groups: list = []
    for rank in range(ranks):
        name = prefix + _GROUPS.format(rank)
        refuse_if(name not in folder.meta.entries, where, f"holds no {name} (the distributed "
                  "optimizer's param groups: its step, betas, lr and eps)")
        value = folder.value(name)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # the object as Megatron's torch_dist saves it: in a list
        mine = value.get("param_groups") if isinstance(value, dict) else None
        if not isinstance(mine, list) or not mine or not all(isinstance(g, dict) for g in mine):
            raise InputError(f"{where}: {name} is not the distributed optimizer's param groups")
        groups += mine
    refuse_if(not one_setting(groups), where, "the distributed optimizer's param groups differ "
              "in lr, betas or eps, and Megatron does not save which parameters each holds")
    step = one_step(groups)
    refuse_if(step is None, where, "the distributed optimizer's param groups give no one step")
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


def _assembled(name: str, shape, shards, key: str) -> StoredTensor:
    """A split parameter's ``key`` (a moment, or its fp32 main param) as one fp32 tensor of
    the model's ``shape``: each tensor-parallel rank's, flat in its buckets' ranges, the
    piece at its shard's place."""
    return StoredTensor(name, shape, torch.float32, [_placed(s, m[key]) for s, m in shards])


def _placed(shard: Piece, flat: StoredTensor) -> Piece:
    def read() -> torch.Tensor:
        return torch.cat([p.read() for p in flat.pieces]).view(shard.shape)

    files = {p.file for p in flat.pieces}
    file = files.pop() if len(files) == 1 else None
    return Piece(tuple(shard.offsets), tuple(shard.shape), read, file)


# ----------------------------------------------------------------- legacy: distrib_optim.pt


def distrib_optim(rank) -> None:
    """The distributed optimizer's state: ``distrib_optim.pt``'s flat buffers, each
    parameter's slice found by Megatron's grad-buffer layout and checked (module doc)."""
    file = rank.file.parent / DISTRIBUTED
    value = rank.root.get("optimizer")
    inner = value.get("optimizer") if isinstance(value, Mapping) else None
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    bad = not isinstance(groups, list) or not groups
    refuse_if(bad or not all(isinstance(g, Mapping) for g in groups), rank.file,
              f"beside {DISTRIBUTED}, its optimizer is not one distributed optimizer's param "
              "groups (several optimizers, or none): gradclip reads one")
    refuse_if(not one_setting(groups), rank.file, "its param groups differ in lr, betas or eps, "
              f"and {DISTRIBUTED} does not say which parameter is in which group")
    step = one_step(groups)
    refuse_if(step is None, rank.file, "its param groups give no one Adam step (the distributed "
              f"optimizer saves it there; {DISTRIBUTED} holds none)")
    buffers = _buffers(rank, file)
    order = {name: pid for pid, name in enumerate(rank.weights)}
    by_buffer: dict[tuple[str, torch.dtype], list[str]] = {}
    for name in order:  # Megatron's DDP: one grad buffer per chunk and dtype, model order
        by_buffer.setdefault((_chunk_of(rank, name), rank.weights[name].dtype), []).append(name)
    chunks = f" of {len(rank.chunks)} model chunks" if len(rank.chunks) > 1 else ""
    refuse_if([d for d, _ in buffers] != [d for _, d in by_buffer], file,
              f"holds grad buffers of {[str(d) for d, _ in buffers]}, the model's parameters"
              f"{chunks} are {[str(d) for _, d in by_buffer]}: gradclip cannot tell which "
              "elements are whose")
    own = _own_bucket(rank)
    state: dict[int, dict] = {}
    for (dtype, tensors), ((chunk, _), names) in zip(buffers, by_buffer.items()):
        # get_model's DDP buckets a virtual pipeline's first chunk only (disable_bucketing)
        bucket = _bucket_size(rank, file) if chunk == rank.chunks[0] else None
        numels = {n: rank.weights[n].numel() for n in names}
        places = concatenated(buckets(names, numels, bucket_size=bucket, own=own))
        _check_layout(file, dtype, tensors, places, rank.weights)
        for name, (start, end) in places.items():
            shape = rank.weights[name].shape
            pid = order[name]
            state[pid] = {
                key: StoredTensor.whole(f"{name}.{key}", tensors[key][start:end].view(shape), file)
                for key in ("exp_avg", "exp_avg_sq")
            }
            state[pid]["step"] = step
            rank.masters[name] = tensors["param"][start:end].view(shape)
            rank.names[pid] = name
    group = {**{k: v for k, v in groups[0].items() if k != "params"}, "params": sorted(state)}
    rank.optimizer = OptimizerState([group], state, None, rank.file)
    rank.distributed = True


def _buffers(rank, file: Path) -> list[tuple[torch.dtype, dict]]:
    """``[(param dtype, {"param", "exp_avg", "exp_avg_sq": flat tensor, "numel_unpadded"})]``
    by buffer index, as get_parameter_state_dp_zero saves them."""
    with allowing(GLOBALS):
        root = load_checkpoint(file, **rank.reading).root
    refuse_if(not isinstance(root, Mapping) or root.get("buckets_coalesced") is not True, file,
              "not a distributed optimizer's parameter state of coalesced buckets "
              "(get_parameter_state_dp_zero, core_v0.16.1)")
    indices = sorted(k for k in root if k != "buckets_coalesced")
    bad = indices != list(range(len(indices))) or not indices
    refuse_if(bad, file, "its grad buffers are not numbered 0, 1, ...")
    out = []
    for index in indices:
        entry = root[index]
        bad = not isinstance(entry, Mapping) or len(entry) != 1
        refuse_if(bad, file, f"grad buffer {index} is not one (param, grad) dtype's")
        ((dtypes, tensors),) = entry.items()
        n = tensors.get("numel_unpadded") if isinstance(tensors, Mapping) else None
        if (
            not isinstance(dtypes, tuple)
            or len(dtypes) != 2
            or not all(isinstance(d, torch.dtype) for d in dtypes)
            or not isinstance(n, int)
            or not all(
                isinstance(tensors.get(k), torch.Tensor)
                and tensors[k].dtype == torch.float32
                and tuple(tensors[k].shape) == (n,)
                for k in ("param", "exp_avg", "exp_avg_sq")
            )
        ):
            raise InputError(
                f"{file}: grad buffer {index} is not flat fp32 param, exp_avg and "
                "exp_avg_sq of numel_unpadded elements"
            )
        out.append((dtypes[0], tensors))
    return out


def _bucket_size(rank, file: Path) -> int | None:
    """When a bucket closes, as Megatron-LM's ``get_model`` and Megatron's DDP decide it."""
    args = rank.args
    if not args.get("overlap_grad_reduce") or rank.stage:
        return None  # one bucket; Megatron's DDP never buckets a stage after the first
    if args.get("ddp_num_buckets") is not None:
        total = sum(t.numel() for t in rank.weights.values())
        return total // args["ddp_num_buckets"]
    if args.get("ddp_bucket_size") is not None:
        return args["ddp_bucket_size"]
    dp = args.get("data_parallel_size")
    if not isinstance(dp, int):
        raise InputError(f"{rank.file}: its args give no data_parallel_size for {file.name}")
    return max(40000000, 1000000 * dp)


def _own_bucket(rank) -> set[str]:
    """The parameters that Megatron's DDP puts in a bucket of their own: with pipeline stages
    and a tied output layer, the first stage's word embeddings and the last stage's copy
    (``shared_embedding``: ``LanguageModule.setup_embeddings_and_output_layer``,
    ``_ParamAndGradBuffer``'s ``_does_param_require_new_bucket``)."""
    size = rank.args.get("pipeline_model_parallel_size")
    untied = rank.args.get("untie_embeddings_and_output_weights") is not False
    if rank.stage is None or not isinstance(size, int) or size < 2 or untied:
        return set()
    if rank.stage == 0:  # in the first chunk
        prefix = f"{rank.chunks[0]}." if len(rank.chunks) > 1 else ""
        return {f"{prefix}embedding.word_embeddings.weight"}
    return {copy_name(rank)} if rank.stage == size - 1 else set()


def _chunk_of(rank, name: str) -> str:
    """The key of the model chunk that holds ``name`` (``model`` without a virtual pipeline)."""
    return name.partition(".")[0] if len(rank.chunks) > 1 else rank.chunks[0]


def _check_layout(file: Path, dtype, tensors: dict, places: dict, weights: dict) -> None:
    def unfit(why: str) -> InputError:
        return InputError(
            f"{file}: its {dtype} grad buffer does not fit Megatron's layout of the model's "
            f"parameters ({why}): gradclip cannot tell which elements are whose"
        )

    n = tensors["numel_unpadded"]
    end = max(e for _, e in places.values())
    if end != n:
        raise unfit(f"{end} elements laid out, numel_unpadded {n}")
    cursor = 0  # the padding is the gaps between the parameters, in buffer order
    for name, (start, stop) in sorted(places.items(), key=lambda item: item[1]):
        for key in ("param", "exp_avg", "exp_avg_sq"):
            if torch.count_nonzero(tensors[key][cursor:start]):
                raise unfit(f"a padding element of {key} is not 0")
        if not rounds_to(tensors["param"][start:stop], weights[name].reshape(-1).to(dtype)):
            raise unfit(f"{name}'s slice of param is not the model's tensor")
        cursor = stop
