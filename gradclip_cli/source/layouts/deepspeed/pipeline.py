"""DeepSpeed's pipeline stages (``deepspeed.pipe.PipelineModule``) without ZeRO: the layer
files and each stage's optimizer read (under ZeRO 1 the stages are ``model_parallel``'s);
the file names and the ranks' numbering are in the package's docstring.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.interface import (
    Checkpoint,
    OptimizerState,
    StoredTensor,
    chained,
)
from gradclip_cli.source.untrusted import is_int

from ..draft import Draft
from ..master_copy import head_key, same_bits
from ..torch_optim import is_optimizer_state, optimizer_state
from . import model_parallel
from .facts import PIPELINE, DeepSpeedFacts
from .plain import check_saved_without_zero, named_in_order, part, with_state
from .reader import (
    LAYER_STATES,
    PLAIN_STATES,
    Reader,
    buffer_names,
    complete,
    gap,
    mp_name,
    named_tensors,
)


def read(reader: Reader, given: Path, kind: str) -> tuple[Draft, DeepSpeedFacts]:
    """A pipeline without ZeRO: each stage's ``mp_rank_XX_model_states.pt`` holds no
    ``module`` and its ``optimizer`` is torch's state dict over the stage's parameters,
    whose weights are the layer files'. Each tensor-parallel rank is read as a pipeline of
    its own (``read_rank``), then the ranks are joined as without stages."""
    names = os.listdir(reader.folder)
    stages = sorted(int(m.group(1)) for n in names if (m := PLAIN_STATES.fullmatch(n)))
    complete(reader.folder, stages, "pipeline stages {}", "stages")
    layers = layer_files(reader.folder, names)
    tp = len(layers)
    models = [reader.load(f"{mp_name(s)}_model_states.pt") for s in stages]
    first = models[0]
    for model in models:
        check_saved_without_zero(model, pipeline_files=len(stages), tp=tp)
        model_parallel.refuse_other_step(model, first, "stages")
    buffers = set().union(*(buffer_names(model, "layers'") for model in models))
    ranks = [read_rank(reader, models[t::tp], layers[t], buffers, kind) for t in range(tp)]
    params, buffers, optimizer = ranks[0]
    split = 0
    if tp > 1:
        parts = [part(models[t], weights, own) for t, (weights, _, own) in enumerate(ranks)]
        # A name is its layer file's (tensor-parallel rank 0's named).
        where = {n: t.pieces[0].file for n, t in params.items()}
        params, optimizer, split = model_parallel.tensor_parallel(parts, where)
    contents = reader.contents(given, kind)
    contents.weights = params
    contents.order = list(params)
    contents.buffers = buffers or None
    contents.optimizers = [optimizer]
    dp = first.root.get("dp_world_size")
    trained = len(with_state(optimizer))
    return contents, DeepSpeedFacts(
        PIPELINE, **reader.saved(first), parameters=trained, tensors=len(params),
        frozen=len(params) - trained, dp=dp if is_int(dp) else None, stages=len(models) // tp,
        tp=tp, split=split, model_files=tuple(m.path.name for m in models),
        layer_files=tuple(sorted(n for rank in layers for n in rank.values())),
    )


def read_rank(
    reader: Reader, models: list[Checkpoint], layers: dict[int, str], listed: set[str],
    kind: str,
) -> tuple[dict[str, StoredTensor], dict[str, StoredTensor], OptimizerState]:
    """One tensor-parallel rank of a pipeline without ZeRO (the only one without tensor
    parallelism): its stages' model state files ``models`` and its layer files
    ``layers`` (by global index), read as ``(parameters, buffers, optimizer state)``.

    Stages hold consecutive layers in order, and DeepSpeed hands each stage's optimizer
    that stage's parameters: with several stages, stage ``XX``'s optimizer holds the next
    as many parameters of the layers in index order as its param groups list, mapped to
    names by shape within them (``naming.map_names``); one stage's optimizer may hold fewer
    (parameters left out of it, frozen). Counts or shapes that disagree are refused, and
    tied layers (``refuse_tied_layers``).
    """
    params: dict[str, StoredTensor] = {}
    buffers: dict[str, StoredTensor] = {}
    for index in sorted(layers):
        layer = reader.load(layers[index])
        own, held = named_tensors(
            layer.root, listed, layer.path,
            "holds {}, which is not a named tensor of the layer's state dict", f"{index}.",
        )
        params.update(own)
        buffers.update(held)
    refuse_tied_layers(params)
    order = list(params)
    optimizers = []
    taken = 0
    for model in models:
        value, file = model.root.get("optimizer"), model.path
        if not is_optimizer_state(value):
            raise InputError(
                f"{file}: 'optimizer' is not torch's optimizer state dict "
                f"({type(value).__name__}); gradclip reads DeepSpeed pipeline stages "
                "without ZeRO trained in fp32"
            )
        optimizer = optimizer_state(value, file, "'optimizer'")
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        own = order if len(models) == 1 else order[taken : taken + count]
        taken += count
        if count > len(own):
            raise InputError(
                f"{file}: the optimizer lists {count} parameters, but the layer files "
                f"hold {len(own)} for this stage: the layer files and the optimizer "
                "disagree (a layer file missing?)"
            )
        optimizer = replace(optimizer, param_names=named_in_order(
            optimizer, {n: params[n] for n in own}, file, kind))
        optimizers.append(optimizer)
    if len(models) > 1 and taken != len(order):
        raise InputError(
            f"{models[-1].path}: the stages' optimizers list {taken} parameters, but the "
            f"layer files hold {len(order)}: the layer files and the optimizers disagree"
        )
    optimizer, _ = chained(optimizers, models[0].path)
    return params, buffers, optimizer


def refuse_tied_layers(params: dict[str, StoredTensor]) -> None:
    """Two layers' identical weight matrices (2 dimensions or more): one module tied across
    layers (``TiedLayerSpec``), saved by each; refused rather than counted twice.

    Copies of one tensor are identical bits (``master_copy.same_bits``), a NaN included: a tied
    layer that diverged saves the same NaN in each copy and is refused as any tied layer,
    where ``torch.equal`` (a NaN unequal to itself) would count it twice."""
    seen: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, stored in params.items():
        if len(stored.shape) < 2:
            continue
        value = stored.read()
        key = head_key(value, value.dtype)  # where identical copies meet, NaN keyed by place
        for other, earlier in seen.get(key, ()):
            if same_bits(value, earlier):
                raise InputError(
                    f"{stored.pieces[0].file}: holds {name}, equal to "
                    f"{other} (a layer tied across layers, saved by each); "
                    "gradclip does not read tied pipeline layers"
                )
        seen.setdefault(key, []).append((name, value))


def layer_files(folder: Path, names: list[str]) -> list[dict[int, str]]:
    """A pipeline's layer files, ``{global layer index: file name}`` per tensor-parallel rank
    (``layer_II-model_TT-model_states.pt``; one rank where the names carry none): the ranks
    ``00`` on without a gap, each with the same layers."""
    ranks: dict[int | None, dict[int, str]] = {}
    for n in sorted(names):
        m = LAYER_STATES.fullmatch(n)
        if m is None:
            continue
        index = int(m.group(1))
        held = ranks.setdefault(None if m.group(2) is None else int(m.group(2)), {})
        if index in held:
            raise InputError(f"{folder / n}: layer {index} is also saved as {held[index]}")
        held[index] = n
    if None in ranks:
        if len(ranks) > 1:
            raise InputError(
                f"{folder}: holds layer files of tensor-parallel ranks (layer_II-model_TT-"
                "model_states.pt) and without one (layer_II-model_states.pt): which belong to "
                "this checkpoint is unclear"
            )
        return [ranks[None]]
    tps = sorted(ranks)
    if (missing := gap(tps)) is not None:
        raise InputError(
            f"{folder}: holds layer files of tensor-parallel ranks "
            f"{', '.join(f'model_{t:02d}' for t in tps)} but none of model_{missing:02d}: the "
            "tensor-parallel ranks are incomplete"
        )
    every = sorted(set().union(*ranks.values()))
    for t in tps:
        for index in every:
            if index not in ranks[t]:
                other = next(ranks[o][index] for o in tps if index in ranks[o])
                raise InputError(
                    f"{folder / f'layer_{index:02d}-model_{t:02d}-model_states.pt'}: missing "
                    f"(the other tensor-parallel ranks' layer files, {other} among them, "
                    "expect it)"
                )
    return [ranks[t] for t in tps]
