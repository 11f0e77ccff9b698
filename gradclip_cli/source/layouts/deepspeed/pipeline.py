"""DeepSpeed's pipeline stages (``deepspeed.pipe.PipelineModule``): under ZeRO 1 the
stages' checks and join, without ZeRO the layer files read; the file names and the ranks'
numbering are in the package's docstring.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import roles
from gradclip_cli.source.interface import (
    Checkpoint,
    Contents,
    OptimizerState,
    StoredTensor,
    chained,
)
from gradclip_cli.source.untrusted import is_count, is_int
from gradclip_cli.source.what import map_names

from ..dcp_hf import same_bits
from ..torch_optim import is_optimizer_state, optimizer_state
from . import model_parallel
from .model_parallel import Part
from .plain import check_saved_without_zero, note_frozen, part, with_state
from .reader import (
    LAYER_STATES,
    PLAIN_STATES,
    Reader,
    buffer_names,
    gap,
    mp_name,
    named_tensors,
    span,
)


def holds_layers(folder: Path) -> bool:
    """Whether ``folder`` holds a pipeline's layer files."""
    try:
        return any(LAYER_STATES.fullmatch(n) for n in os.listdir(folder))
    except OSError:
        return False


def check_pipeline_ranks(parts: list[Part], folder: Path) -> tuple[int, int] | None:
    """The ranks of a pipeline of several stages (``pp_degree`` stages x ``tp_degree``
    tensor-parallel ranks, as many as the rank files) are one checkpoint: each says so, and
    each tensor-parallel rank's stages hold other parameters (``check_stages``). Returns
    ``(pp_degree, tp_degree)``, or None where the ranks say of no stages: one stage (as
    Megatron-DeepSpeed's GPTModelPipe runs without pipeline parallelism) is read as any
    model-parallel set."""
    n = len(parts)
    dims = model_parallel.dimensions(parts[0].model)
    pp, tp = dims.get("pp_degree"), dims.get("tp_degree")
    if n == 1 or not is_int(pp) or pp <= 1:
        return None
    if not is_count(tp, 1) or pp * tp != n:
        raise InputError(
            f"{parts[0].model.path}: a pipeline checkpoint whose "
            f"checkpoint_parallel_dimensions are {visible(repr(dims))[:80]}, for {n} rank "
            "files: pp_degree x tp_degree should count them"
        )
    for p in parts:
        args = model_parallel.megatron_args(p.model)
        for key, size, expected in (
            ("mp_world_size", p.model.root.get("mp_world_size"), n),
            ("checkpoint_parallel_dimensions", model_parallel.dimensions(p.model), dims),
            # Megatron's args, where saved.
            ("args.tensor_model_parallel_size", args.get("tensor_model_parallel_size", tp), tp),
            ("args.pipeline_model_parallel_size",
             args.get("pipeline_model_parallel_size", pp), pp),
        ):
            if size != expected:
                raise InputError(
                    f"{p.model.path}: its {key} is {visible(repr(size))[:80]}, but "
                    f"{folder.name}/ holds {n} rank files, {pp} pipeline stages x {tp} "
                    "tensor-parallel rank(s): the ranks are not one checkpoint"
                )
    for t in range(tp):
        check_stages(parts[t::tp])
    return pp, tp


def check_stages(parts: list[Part]) -> None:
    """Pipeline stages are one checkpoint: the same ZeRO layout and step on every stage, and
    each parameter on one stage only (a layer tied across stages, whose copies the stages
    keep alike, is refused rather than counted twice or guessed once)."""
    seen: dict[str, Path] = {}
    for p in parts:
        model_parallel.refuse_other_run(p, parts[0], "stages")
        for name in p.weights:
            if name in seen:
                raise InputError(
                    f"{p.model.path}: holds {visible(name)}, which {seen[name].name} holds too "
                    "(a layer tied across pipeline stages); gradclip does not read tied stages"
                )
            seen[name] = p.model.path


def join_stages(parts: list[Part]) -> Part:
    """One tensor-parallel rank's stages as one part: their parameters side by side, in
    stage order, and their optimizer states as one (``chained``: each stage's param groups
    kept, with their hyperparameters)."""
    first = parts[0]
    optimizer, _ = chained([p.optimizer for p in parts], first.optimizer.file)
    return Part(
        first.mp,
        first.model,
        first.stage,
        first.world,
        {n: s for p in parts for n, s in p.trainable.items()},
        {n: t for p in parts for n, t in p.weights.items()},
        optimizer,
        first.held,
    )


def read(reader: Reader, given: Path, kind: str) -> Contents:
    """A pipeline without ZeRO: each stage's ``mp_rank_XX_model_states.pt`` holds no
    ``module`` and its ``optimizer`` is torch's state dict over the stage's parameters,
    whose weights are the layer files'. Each tensor-parallel rank is read as a pipeline of
    its own (``read_rank``), then the ranks are joined as without stages: a split parameter
    its shards side by side, a replicated one once (``model_parallel.tensor_parallel``), the
    ranks checked alike (``model_parallel.check_alike``)."""
    names = os.listdir(reader.folder)
    stages = sorted(int(m.group(1)) for n in names if (m := PLAIN_STATES.fullmatch(n)))
    if (missing := gap(stages)) is not None:
        raise InputError(
            f"{reader.folder}: holds pipeline stages {', '.join(mp_name(r) for r in stages)} "
            f"but no {mp_name(missing)}: the stages are incomplete"
        )
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
        parts = [part(t, models[t], weights, own, "") for t, (weights, _, own) in enumerate(ranks)]
        model_parallel.check_alike(parts)
        # A name is its layer file's (tensor-parallel rank 0's named).
        where = {n: t.pieces[0].file for n, t in params.items()}
        params, optimizer, split = model_parallel.tensor_parallel(parts, where)
    contents = reader.contents(given, kind)
    contents.weights = params
    contents.model_order_names = list(params)
    contents.buffers = buffers or None
    contents.optimizers = [optimizer]
    every = sorted(n for rank in layers for n in rank.values())
    files = span(every)
    held = span([f"{m.path.name}'s 'optimizer'" for m in models])
    ranks_said = model_parallel.ranks_of(len(models) // tp, tp)
    of = f" of {ranks_said}" if len(models) > 1 else ""
    contents.evidence[roles.WEIGHT] = (
        f"a DeepSpeed pipeline checkpoint without ZeRO{of}: the layer files ({files})"
    )
    contents.evidence[roles.OPTIMIZER_STATE] = (
        f"a DeepSpeed pipeline checkpoint without ZeRO{of}: {held}"
    )
    version = reader.header(
        contents, first.root, given, "DeepSpeed pipeline checkpoint without ZeRO (stage 0)"
    )
    dp = first.root.get("dp_world_size")
    dp_note = f" x {dp} data-parallel rank(s)" if is_int(dp) else ""
    trained = with_state(optimizer)
    ranks_said = f"{len(models)} pipeline stage(s)" if tp == 1 else ranks_said
    contents.description.append(
        f"{ranks_said} ({span([mp_name(s) for s in stages])}){dp_note}{version}: weights of "
        f"{len(params)} parameters in {len(every)} layer files ({files}), Adam moments "
        f"of {len(trained)}"
    )
    if tp > 1:
        model_parallel.note_split(contents, split, len(params), len(models) // tp)
    note_frozen(contents, len(params) - len(trained))
    return contents


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
    names by shape within them (``what.map_names``); one stage's optimizer may hold fewer
    (parameters left out of it, frozen). Counts or shapes that disagree are refused. A
    layer tied across layers (``TiedLayerSpec``) is saved by each layer that uses it:
    two layer files holding equal weight matrices are refused rather than counted twice.
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
        stage_weights = {n: params[n] for n in own}
        optimizer.param_names = map_names(
            Contents(path=file, kind=kind, weights=stage_weights, model_order_names=list(own)),
            optimizer,
        )
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

    Copies of one tensor are identical bits (``dcp_hf.same_bits``), a NaN included: a tied
    layer that diverged saves the same NaN in each copy and is refused as any tied layer,
    where ``torch.equal`` (a NaN unequal to itself) would count it twice."""
    seen: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, stored in params.items():
        if len(stored.shape) < 2:
            continue
        value = stored.read()
        head = value.reshape(-1)[:64].contiguous().view(torch.uint8)
        key = (tuple(value.shape), value.dtype, tuple(head.tolist()))
        for other, earlier in seen.get(key, ()):
            if same_bits(value, earlier):
                raise InputError(
                    f"{stored.pieces[0].file}: holds {visible(name)}, equal to "
                    f"{visible(other)} (a layer tied across layers, saved by each); "
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
