"""ZeRO's partitions: each data-parallel rank's flat fp32 master weights and Adam moments,
cut back into parameters as DeepSpeed's ``utils/zero_to_fp32.py`` does (the package's
docstring states the rule for ZeRO 1/2, ``zero2_places``, and ZeRO 3, ``zero3_places``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import Checkpoint, OptimizerState, Piece, StoredTensor
from gradclip_cli.source.untrusted import is_count, is_int

from ..draft import Draft
from . import model_parallel
from .facts import ZERO, DeepSpeedFacts
from .model_parallel import Part, check_pipeline_ranks, join_stages
from .reader import (
    LAYER_STATES,
    MODEL_STATES,
    OPTIM_STATES,
    Reader,
    Shapes,
    complete,
    mp_name,
    param_shapes,
    shape_group,
)

_MAX_RANKS = 1 << 16
_MOMENTS = ("exp_avg", "exp_avg_sq")


def read(reader: Reader, given: Path, kind: str) -> tuple[Draft, DeepSpeedFacts]:
    """The folder's ZeRO checkpoint: each model-parallel rank read as one of its own
    (``read_part``), then its pipeline stages and tensor-parallel ranks joined."""
    folder = reader.folder
    names = os.listdir(folder)
    found = [m for n in names if (m := MODEL_STATES.fullmatch(n) or OPTIM_STATES.fullmatch(n))]
    mp_ranks = sorted({int(m.group(m.lastindex)) for m in found})
    prefixes = sorted({m.group(1) or "" for n in names if (m := OPTIM_STATES.fullmatch(n))})
    if len(prefixes) > 1:
        raise InputError(
            f"{folder}: holds both bf16_zero_pp_rank_* and zero_pp_rank_* "
            "optimizer files; which set belongs to this checkpoint is unclear"
        )
    complete(folder, mp_ranks, "model-parallel ranks {}", "model-parallel ranks")
    parts = [read_part(reader, mp, prefixes[0]) for mp in mp_ranks]
    first = parts[0]
    pipeline = any(LAYER_STATES.fullmatch(n) for n in names)
    layout = check_pipeline_ranks(parts, folder) if pipeline else None
    stages, tp = layout or model_parallel.check_tensor_parallel(parts, folder)
    contents = reader.contents(given, kind)
    # Each tensor-parallel rank's stages joined, then the ranks as without stages.
    ranks = [join_stages(parts[t::tp]) for t in range(tp)] if stages > 1 else parts
    if len(ranks) == 1:
        weights, optimizer, split = ranks[0].weights, ranks[0].optimizer, 0
    else:
        # A name is in its stage's param_shapes (tensor-parallel rank 0's named).
        where = {n: p.model.path for p in parts[::tp] for n in p.weights}
        weights, optimizer, split = model_parallel.tensor_parallel(ranks, where)
    # param_shapes lists parameters group by group; the module's state dict
    # (placeholders under ZeRO 3) keeps the model's order, which the report follows.
    module = first.model.root.get("module")
    order = [k for k in module if k in weights] if isinstance(module, Mapping) else []
    if len(order) == len(weights):
        weights = {n: weights[n] for n in order}
        contents.order = order
    else:
        contents.weights_sorted = True
    contents.weights = weights
    contents.optimizers = [optimizer]
    return contents, DeepSpeedFacts(
        # Each stage's parameters once (from its tensor-parallel rank 0).
        ZERO, **reader.saved(first.model), parameters=len(ranks[0].trainable),
        tensors=len(weights), frozen=len(first.weights) - len(first.trainable),
        stage=first.stage, dp=first.world, stages=stages, tp=tp, split=split,
        model_files=tuple(p.model.path.name for p in parts),
        optimizer_files=tuple(p.optimizer.file.name for p in parts),
        # ZeRO 1 records frozen parameters only in the module's state dict, which a
        # PipelineModule saves in its layer files instead.
        layers_unread=pipeline and not isinstance(module, Mapping) and first.stage <= 1,
    )


def read_part(reader: Reader, mp: int, prefix: str) -> Part:
    """One model-parallel rank's files: its model states and every data-parallel rank's
    optimizer partition, read as one ZeRO checkpoint of its own."""

    def optim_name(rank: int) -> str:
        return f"{prefix}zero_pp_rank_{rank}_{mp_name(mp)}_optim_states.pt"

    optim_ranks = sorted(
        int(m.group(2))
        for n in os.listdir(reader.folder)
        if (m := OPTIM_STATES.fullmatch(n)) and int(m.group(3)) == mp
    )
    first = reader.load(optim_name(0))
    stage, world = stage_and_world(first)
    beyond = [r for r in optim_ranks if r >= world]
    if beyond:
        raise InputError(
            f"{reader.folder / optim_name(beyond[0])}: a rank beyond the "
            f"{world} that {first.path.name} names (partition_count)"
        )
    model = reader.load(
        f"{mp_name(mp)}_model_states.pt"
        if stage <= 2
        else f"zero_pp_rank_0_{mp_name(mp)}_model_states.pt"
    )
    shapes = param_shapes(model)
    optims = [first] + [reader.load(optim_name(r)) for r in range(1, world)]
    for ckpt in optims[1:]:
        other_stage, other_world = stage_and_world(ckpt)
        if (other_stage, other_world) != (stage, world):
            raise InputError(
                f"{ckpt.path}: ZeRO stage {other_stage} over {other_world} "
                f"ranks, but {first.path.name} says stage {stage} over {world}"
            )
    dp = model.root.get("dp_world_size")
    if isinstance(dp, int) and dp != world:
        raise InputError(
            f"{model.path}: dp_world_size {dp}, but the optimizer states are "
            f"partitioned over {world} ranks"
        )
    flats = [flat_groups(c, stage, len(shapes)) for c in optims]
    states = [base_state(c, stage) for c in optims]
    files = [c.path for c in optims]
    padded = check_partition_sizes(optims, flats, stage)
    if stage <= 2:
        places = zero2_places(shapes, flats, world, first)
    else:
        places = zero3_places(shapes, flats, world, first)
    flat_shapes = {n: s for group in shapes for n, s in group.items()}
    weights = {n: stored(n, flat_shapes[n], places[n], flats, files) for n in flat_shapes}
    weights.update(frozen_parameters(reader, model, stage, world, flat_shapes, mp))
    optimizer = moments(shapes, places, flats, padded, states, optims)
    return Part(model, stage, world, flat_shapes, weights, optimizer)


def frozen_parameters(
    reader: Reader, model: Checkpoint, stage: int, world: int, trainable: Shapes, mp: int
) -> dict[str, StoredTensor]:
    """Frozen parameters: weights without optimizer state, as ``zero_to_fp32`` reads them.

    ZeRO 2 and 3 save ``frozen_param_shapes`` and ``frozen_param_fragments`` in the model
    state files: under ZeRO 2 each parameter whole (in the module's dtype), under ZeRO 3
    each rank's flat part of it (``ceil(numel / world)`` elements, the last zero padded).
    ZeRO 1 (and DeepSpeed before it saved them apart) saves neither, but its module state
    dict is whole: the frozen parameters are the entries neither in ``param_shapes`` nor
    buffers (``buffer_names``) nor tied names (``shared_params``).
    """
    raw = model.root.get("frozen_param_shapes")
    if raw is None and stage <= 2:
        return _frozen_in_module(model, trainable)
    if raw is None or (isinstance(raw, Mapping) and not raw):
        return {}
    shapes = shape_group(raw, model, "frozen_param_shapes", set(trainable))
    models = [model]
    if stage == 3:
        models += [
            reader.load(f"zero_pp_rank_{r}_{mp_name(mp)}_model_states.pt") for r in range(1, world)
        ]
    fragments = []
    for ckpt in models:
        held = ckpt.root.get("frozen_param_fragments")
        if not isinstance(held, Mapping):
            raise InputError(
                f"{ckpt.path}: frozen_param_shapes names {len(shapes)} "
                "parameter(s), but there are no frozen_param_fragments"
            )
        row = []
        for name in shapes:
            tensor = held.get(name)
            if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
                raise InputError(
                    f"{ckpt.path}: frozen_param_fragments holds no "
                    f"floating-point tensor for {name}"
                )
            row.append(tensor)
        fragments.append(row)
    files = [c.path for c in models]
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        if stage <= 2:
            tensor = fragments[0][i]
            if tensor.numel() != numel:
                raise InputError(
                    f"{files[0]}: frozen_param_fragments gives {name} "
                    f"{tensor.numel()} elements, its shape {list(shape)}"
                )
            out[name] = StoredTensor.whole(name, tensor.reshape(shape), files[0])
            continue
        part = math.ceil(numel / world)
        place = []
        for r in range(world):
            tensor = fragments[r][i]
            if tensor.dim() != 1 or tensor.numel() != part:
                raise InputError(
                    f"{files[r]}: frozen_param_fragments gives {name} "
                    f"{tensor.numel()} elements, not a flat part of {part} "
                    f"({numel} over {world} ranks)"
                )
            keep = max(0, min(part, numel - r * part))  # the last parts are padding
            if keep:
                place.append((r, i, 0, keep, r * part))
        out[name] = stored(name, shape, place, fragments, files)
    return out


def _frozen_in_module(model: Checkpoint, trainable: Shapes) -> dict[str, StoredTensor]:
    module = model.root.get("module")
    buffers = model.root.get("buffer_names")
    shared = model.root.get("shared_params")
    if not (
        isinstance(module, Mapping)
        and isinstance(buffers, (list, tuple))
        and isinstance(shared, Mapping)
    ):
        return {}  # what is a parameter cannot be told: none is taken for one
    others = (
        set(trainable)
        | {b for b in buffers if isinstance(b, str)}
        | {n for n in shared if isinstance(n, str)}
    )
    return {
        name: StoredTensor.whole(name, value, model.path)
        for name, value in module.items()
        if isinstance(name, str)
        and name not in others
        and isinstance(value, torch.Tensor)
        and value.dtype.is_floating_point
    }


def _osd(ckpt: Checkpoint) -> Mapping:
    osd = ckpt.root.get("optimizer_state_dict")
    if not isinstance(osd, Mapping):
        raise InputError(f"{ckpt.path}: not a DeepSpeed optimizer state: no 'optimizer_state_dict'")
    return osd


def stage_and_world(ckpt: Checkpoint) -> tuple[int, int]:
    """A ZeRO optimizer file's stage (``zero_stage``) and data-parallel world size
    (``partition_count``)."""
    osd = _osd(ckpt)
    stage = osd.get("zero_stage")
    if not is_int(stage) or not 1 <= stage <= 3:
        raise InputError(
            f"{ckpt.path}: not a ZeRO optimizer state: zero_stage is {quoted(stage)}"
        )
    count = osd.get("partition_count")
    # ZeRO 1/2 store one count per group (expert groups may differ); zero_to_fp32 takes
    # the largest as the data-parallel world size.
    counts = list(count) if isinstance(count, (list, tuple)) and count else [count]
    if not all(is_count(c, 1) and c <= _MAX_RANKS for c in counts):
        raise InputError(
            f"{ckpt.path}: partition_count is {quoted(count)}, not a number of ranks"
        )
    return stage, max(counts)


def _flat_tensor(value: Any, ckpt: Checkpoint, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.dtype.is_floating_point:
        raise InputError(f"{ckpt.path}: {what} is not a flat floating-point tensor")
    return value


def flat_groups(ckpt: Checkpoint, stage: int, groups: int) -> list[torch.Tensor]:
    """A rank's flat fp32 partitions, one per param group (ZeRO 3: its flat buffers)."""
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    flats = _osd(ckpt).get(key)
    if isinstance(flats, torch.Tensor):
        flats = [flats]
    if not isinstance(flats, (list, tuple)) or (stage <= 2 and len(flats) != groups):
        raise InputError(
            f"{ckpt.path}: {key} should list one flat partition per param group ({groups})"
        )
    return [_flat_tensor(f, ckpt, f"{key}[{i}]") for i, f in enumerate(flats)]


def base_state(ckpt: Checkpoint, stage: int) -> tuple[list[dict], list[dict]]:
    """The wrapped optimizer's ``(param_groups, per-group state)``, one entry per flat group."""
    osd = _osd(ckpt)
    key = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    base = osd.get(key)
    if not (
        isinstance(base, Mapping)
        and isinstance(base.get("state"), Mapping)
        and isinstance(base.get("param_groups"), (list, tuple))
    ):
        raise InputError(f"{ckpt.path}: {key} is not an optimizer state dict")
    param_groups = list(base["param_groups"])
    states = []
    for g, group in enumerate(param_groups):
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, (list, tuple)) or len(params) != 1:
            raise InputError(f"{ckpt.path}: {key} param group {g} should hold one flat parameter")
        entry = base["state"].get(params[0], {})
        if not isinstance(entry, Mapping):
            raise InputError(f"{ckpt.path}: {key} state of group {g} is not a mapping")
        states.append(dict(entry))
    return param_groups, states


def check_partition_sizes(optims: list[Checkpoint], flats, stage: int) -> list[int]:
    """Each group's partition size, padding included, checked to be the same on every rank.

    DeepSpeed cuts each group into equal partitions; ZeRO 1/2 files leave out the
    padding at the end of the fp32 partition (``group_paddings``) but keep it in the
    optimizer's moments, which are over the padded partition.
    """

    def sizes(r: int) -> list[int]:
        stored = [t.numel() for t in flats[r]]
        if stage <= 2:
            pads = _osd(optims[r]).get("group_paddings")
            if not _counts(pads, len(stored)):
                raise InputError(
                    f"{optims[r].path}: group_paddings is "
                    f"{quoted(pads)}, not one padding per group"
                )
            stored = [n + p for n, p in zip(stored, pads)]
        return stored

    expected = sizes(0)
    for r in range(1, len(optims)):
        if sizes(r) != expected:
            raise InputError(
                f"{optims[r].path}: its flat partitions (with padding) hold "
                f"{sizes(r)} elements, rank 0's {expected}; DeepSpeed "
                "partitions every group equally"
            )
    return expected


def _counts(value, n: int) -> bool:
    """Whether ``value`` is a list of ``n`` whole numbers >= 0 (DeepSpeed's paddings)."""
    return (isinstance(value, (list, tuple)) and len(value) == n
            and all(is_count(p) for p in value))


# A place: where one parameter's elements lie, as (rank, group, start, length, at) runs:
# ``length`` elements of rank ``rank``'s flat group ``group`` from ``start``, which are
# the parameter's flattened elements from ``at``.
Place = list[tuple[int, int, int, int, int]]


def _runs(sizes: list[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """``[start, start + length)`` of segments of ``sizes`` laid end to end: (segment, from, n)."""
    out = []
    base = 0
    for i, size in enumerate(sizes):
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            out.append((i, lo - base, hi - lo))
        base += size
    return out


def zero2_places(shapes: list[Shapes], flats, world: int, first: Checkpoint) -> dict[str, Place]:
    """Where each parameter lies in ZeRO 1/2's partitions (the module's docstring)."""
    places: dict[str, Place] = {}
    paddings = _osd(first).get("param_alignment_paddings")
    for g, group in enumerate(shapes):
        sizes = [flats[r][g].numel() for r in range(world)]
        pads = None
        if isinstance(paddings, (list, tuple)) and g < len(paddings):
            pads = paddings[g]
            if not _counts(pads, len(group)):
                raise InputError(
                    f"{first.path}: param_alignment_paddings of group {g} do not "
                    f"match its {len(group)} parameters"
                )
        offset = 0
        avail = sum(sizes)
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > avail:
                raise InputError(
                    f"{first.path}: the partitions of group {g} hold {avail} elements over "
                    f"{world} ranks, fewer than param_shapes needs ({name} ends at "
                    f"{offset + numel})"
                )
            at = 0
            place = []
            for r, start, n in _runs(sizes, offset, numel):
                place.append((r, g, start, n, at))
                at += n
            places[name] = place
            offset += numel + (pads[i] if pads is not None else 0)
        align = 2 * world
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise InputError(
                f"{first.path}: the partitions of group {g} hold {avail} elements over {world} "
                f"ranks, but param_shapes accounts for {offset}"
            )
    return places


def zero3_places(shapes: list[Shapes], flats, world: int, first: Checkpoint) -> dict[str, Place]:
    """Where each parameter lies in ZeRO 3's flat buffers (the module's docstring)."""
    places: dict[str, Place] = {}
    sizes = [[t.numel() for t in rank] for rank in flats]
    avail = sum(sizes[0])
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if offset + part > avail:
                raise InputError(
                    f"{first.path}: the flat buffers hold {avail} elements per rank, "
                    f"fewer than param_shapes needs ({name} ends at "
                    f"{offset + part})"
                )
            place = []
            for r in range(world):
                at = r * part
                keep = max(0, min(part, numel - at))  # the last parts are padding
                for g, start, n in _runs(sizes[r], offset, keep):
                    place.append((r, g, start, n, at))
                    at += n
            places[name] = place
            offset += part
    if offset != avail:
        raise InputError(
            f"{first.path}: the flat buffers hold {avail} elements per rank, but "
            f"param_shapes accounts for {offset}"
        )
    return places


def stored(name: str, shape: tuple[int, ...], place: Place, tensors, files) -> StoredTensor:
    """``name`` as pieces of the flat tensors ``tensors[rank][group]`` (from ``files[rank]``)."""
    if not place:  # an empty parameter
        return StoredTensor.whole(name, torch.empty(shape, dtype=torch.float32))
    if len(place) == 1:
        r, g, start, n, _ = place[0]
        return StoredTensor.whole(name, tensors[r][g][start : start + n].view(shape), files[r])
    pieces = []
    for r, g, start, n, at in place:
        part = tensors[r][g][start : start + n]
        pieces.append(Piece((at,), (n,), (lambda part=part: part), files[r]))
    dtype = tensors[place[0][0]][place[0][1]].dtype
    return StoredTensor(name, shape, dtype, pieces, flat=True)


def moments(shapes: list[Shapes], places, flats, padded, states, optims) -> OptimizerState:
    """The Adam state of every parameter, cut from the flat moment partitions."""
    files = [c.path for c in optims]
    flat = {key: [_flat_moments(c, states[r][1], flats[r], padded, key)
                  for r, c in enumerate(optims)] for key in _MOMENTS}
    groups0, states0 = states[0]
    param_groups: list[dict[str, Any]] = []
    state: dict[int, dict[str, Any]] = {}
    names: dict[int, str] = {}
    # ZeRO 3 merges all groups' parameters into one flat buffer per rank; the
    # hyperparameters then come from the group each parameter's first run lies in.
    for g, group in enumerate(shapes):
        ids = []
        for name, shape in group.items():
            place = places[name]
            home = place[0][1] if place else min(g, len(groups0) - 1)
            hyper = groups0[home] if home < len(groups0) else groups0[-1]
            step = states0[home].get("step") if home < len(states0) else None
            if step is None and isinstance(hyper, Mapping):
                step = hyper.get("step")
            pid = len(names)
            state[pid] = {"step": step, **{
                key: stored(f"{name}.{key}", shape, place, flat[key], files) for key in _MOMENTS}}
            names[pid] = name
            ids.append(pid)
        hyper = groups0[g] if g < len(groups0) else groups0[-1]
        param_groups.append(
            {**{str(k): v for k, v in hyper.items() if k != "params"}, "params": ids}
        )
    return OptimizerState(param_groups, state, names, optims[0].path)


def _flat_moments(
    ckpt: Checkpoint, group_states: list[dict], flats: list[torch.Tensor], padded: list[int],
    key: str,
) -> list[torch.Tensor]:
    """One rank's flat partitions of the moment ``key``, one per group, each as long as the
    group's fp32 partition, with or without its padding."""
    if len(group_states) != len(flats):
        raise InputError(
            f"{ckpt.path}: {len(group_states)} optimizer param groups for {len(flats)} flat "
            "groups"
        )
    out = []
    for g, entry in enumerate(group_states):
        value = entry.get(key)
        if value is None:
            raise InputError(
                f"{ckpt.path}: group {g} has no {key}; gradclip reads Adam's state from "
                "DeepSpeed checkpoints"
            )
        value = _flat_tensor(value, ckpt, f"group {g} {key}")
        if value.numel() not in (flats[g].numel(), padded[g]):
            raise InputError(
                f"{ckpt.path}: group {g} {key} holds {value.numel()} elements, its fp32 "
                f"partition {flats[g].numel()} ({padded[g]} with padding)"
            )
        out.append(value)
    return out
