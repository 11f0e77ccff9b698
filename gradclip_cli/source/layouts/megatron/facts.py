"""What a Megatron checkpoint was found to hold, as data, and the one function per format
that words it.

Each reader records facts (``DistCkptFacts``, ``LegacyFacts``: how many tensors, which
optimizer state and where, which fp32 copies were measured); ``wording`` and
``legacy_wording`` make the report's sentences from them: the description, the evidence
of each role, and why moments or gradients are missing. So what was found and how it is
said are tested apart, and a layout built on Megatron's folders (NeMo 2's ``weights/``)
says it under its own title.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gradclip_cli.escaping import visible

from ..draft import Wording
from .pipeline import COPY
from .tracker import COMMON, DISTRIBUTED, FILE, JSON, TRACKER

# Where the optimizer state was read from (``DistCkptFacts.state``, ``LegacyFacts.state``).
NONE = "none"  # no moments saved
PER_PARAMETER = "per parameter"  # the plain optimizer's (torch_dist: optimizer.state.*)
FULLY = "fully_reshardable"  # the distributed optimizer's, per parameter (optimizer.state.*)
BUCKETS = "dp_reshardable"  # the distributed optimizer's grad-buffer buckets, placed and checked
UNREAD = "unread"  # the distributed optimizer's, saved in a way gradclip does not read
MISSING = "missing"  # legacy: the distributed optimizer's, its distrib_optim.pt missing


@dataclass(frozen=True)
class Buckets:
    """One distributed optimizer's ``dp_reshardable`` buckets, as read."""

    whose: str  # "the distributed optimizer's", or in a chain "the experts'"...
    count: int  # buckets
    ranks: int  # model-parallel (or expert-parallel) groups holding them
    ranked: str  # "model-parallel" or "expert-parallel"
    prefix: str  # "" or a chained optimizer's "chained_N."


@dataclass(frozen=True)
class DistCkptFacts:
    """A ``torch_dist`` checkpoint's holdings (counts, kinds, names), nothing worded."""

    path: Path  # what was opened
    title: str  # what the layout calls it: "Megatron torch_dist checkpoint"
    folder: str  # the iteration folder's name
    tracked: bool  # whether the tracker named the folder
    step: int | None
    tensors: int  # model tensors (weights)
    layers: int  # stacked layers, split per layer
    state: str  # NONE, PER_PARAMETER, FULLY, BUCKETS or UNREAD
    parameters: int = 0  # parameters with moments
    chained: int = 0  # a ChainedOptimizer's optimizers (0: one optimizer)
    buckets: tuple[Buckets, ...] = ()  # BUCKETS: each optimizer's
    unread: str = ""  # UNREAD: the sharding type, shown
    sixteen: str = ""  # the model's 16-bit dtypes ("bfloat16"), "" for none
    mains: int = 0  # 16-bit tensors measured from their fp32 main params
    main_dtypes: str = ""  # those tensors' dtypes


def wording(facts: DistCkptFacts) -> Wording:
    """The report's sentences of a ``torch_dist`` checkpoint, from its facts."""
    f = facts
    said = f"a torch_dist checkpoint: {JSON} sharded_backend torch_dist"
    fully = f.state == FULLY
    kind = "optimizer.state.param" if fully else "optimizer.state.fp32_param"
    optimizer = "distributed" if fully else "mixed-precision"
    whose = f"{optimizer} optimizer's fp32 main params ({kind} entries"  # those measured
    weight, evidence, error = said, None, None
    if f.state == BUCKETS:
        held = _buckets(f)
        if f.mains:
            held += f"; their param, the fp32 main params of {f.mains}"
        whose = "distributed optimizer's fp32 main params (its buckets' param"
        which = _CHAINED_BUCKETS if f.chained else _BUCKETS
        evidence = f"{said}, {which}, their param groups' step and betas"
    elif f.state == UNREAD:
        held = (
            "the optimizer state is Megatron's distributed optimizer's "
            f"({f.unread}: flat grad-buffer buckets, optimizer.distributed.*), "
            "which gradclip does not read: moments not measured"
        )
        error = held.replace("the optimizer state is", "its optimizer state is")
        if f.sixteen:
            # The fp32 main params are in that unread state: the weights measured are the
            # model's 16-bit tensors (their rounding), and the report says so.
            held += (f"; the weights measured are the model's {f.sixteen} tensors, its fp32 "
                     "main params being in that state")
            weight = (
                f"{said}, the model's {f.sixteen} tensors (the fp32 main params Adam updates "
                "are in the distributed optimizer's state, not read)"
            )
    else:  # NONE, PER_PARAMETER or FULLY: the state per parameter, if any
        which = (  # a ChainedOptimizer's under expert parallelism
            f"a ChainedOptimizer's {f.chained} distributed optimizers'"
            if f.chained
            else "the distributed optimizer's"
        )
        held = f"optimizer state for {f.parameters} parameters"
        if fully:
            held += f" from {which} fully_reshardable state (optimizer.state.*)"
            evidence = (
                f"{said}, {which} fully_reshardable optimizer.state entries, "
                f"{COMMON}'s param groups' step and betas"
            )
        elif f.state == PER_PARAMETER:
            evidence = f"{said}, optimizer.state entries, {COMMON}'s step and betas"
        if f.mains:
            held += f" and the fp32 main params of {f.mains} ({kind})"
    model = f"{f.tensors} model tensors"
    if f.mains:
        model = (
            f"{f.tensors} {f.main_dtypes} model tensors"
            if f.mains == f.tensors
            else f"{f.tensors} model tensors, {f.mains} of them {f.main_dtypes},"
        )
        held += ", the weights measured"
        weight = (
            f"{said}, the {whose}: the weights Adam updates; the model's {f.main_dtypes} "
            "tensors are them rounded, checked)"
        )
    description = (
        f"{f.title}{_via(f)} at iteration {f.step}: {model} "
        f"({f.layers} stacked layers split per layer), {held}"
    )
    return Wording((description,), weight, evidence, error, _no_gradients(f.path, f.title, COMMON))


_BUCKETS = "the distributed optimizer's dp_reshardable buckets (optimizer.distributed.*)"
_CHAINED_BUCKETS = (
    "a ChainedOptimizer's distributed optimizers' dp_reshardable buckets "
    "(chained_N.optimizer.distributed.*)"
)


def _via(f: DistCkptFacts | LegacyFacts) -> str:
    return f" ({TRACKER} names {f.folder})" if f.tracked else ""


def _no_gradients(path: Path, title: str, held: str) -> str:
    return f"{path}: a {title} saves no gradients (model, optimizer state, {held})"


def _buckets(f: DistCkptFacts) -> str:
    each = [
        f"{b.whose} {b.count} dp_reshardable buckets"
        + (f" over {b.ranks} {b.ranked} ranks" if b.ranks > 1 else "")
        + f" ({b.prefix}optimizer.distributed.*)"
        for b in f.buckets
    ]
    if f.chained:
        return (
            f"optimizer state for {f.parameters} parameters from a ChainedOptimizer's "
            f"{f.chained} distributed optimizers: {' and '.join(each)}{_PLACED}"
        )
    return f"optimizer state for {f.parameters} parameters from {each[0]}{_PLACED}"


_PLACED = (
    ", each parameter's slice placed by Megatron's bucket layout and checked against the "
    "model's tensors"
)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a legacy checkpoint, as its first rank holds it."""

    folder: str  # its first rank's folder, mp_rank_00_YYY
    number: int  # YYY
    chunks: tuple[tuple[str, int, int], ...]  # (model chunk's key, first global layer, count)


@dataclass(frozen=True)
class LegacyFacts:
    """A legacy checkpoint's holdings (``iter_N/mp_rank_XX/``), nothing worded."""

    path: Path  # what was opened
    folder: str  # the iteration folder's name
    tracked: bool  # whether the tracker named the folder
    step: int | None
    ranks: tuple[str, ...]  # the rank folders read, stage by stage
    tensors: int  # model tensors
    skipped: int  # _extra_state entries skipped per rank
    state: str  # NONE, PER_PARAMETER, BUCKETS (distrib_optim.pt) or MISSING
    masters: bool = False  # the weights measured are the optimizer's fp32 copies
    lacking: str = ""  # MISSING: the rank folder without its distrib_optim.pt
    split: int = 0  # tensors split across the tensor-parallel ranks
    stages: tuple[Stage, ...] = ()  # pipeline stages (none: not pipelined)
    tied: bool = False  # the last stage's copy of the tied embedding, left out
    siblings: int = 0  # one rank read alone: its iteration's rank folders (0: all read)
    tensor_rank: int = 0  # one rank of a pipeline stage read alone: its tensor-parallel rank


def legacy_wording(facts: LegacyFacts) -> Wording:
    """The report's sentences of a legacy checkpoint, from its facts."""
    f = facts
    pattern = "mp_rank_XX_YYY" if f.stages else "mp_rank_XX"
    names = ", ".join(f.ranks)
    if not f.stages:
        held = (
            f"tensor-parallel rank {names}"
            if f.siblings
            else f"{len(f.ranks)} tensor-parallel rank(s) ({names})"
        )
    elif f.siblings:
        held = f"pipeline stage {f.stages[0].number}'s tensor-parallel rank {f.tensor_rank}"
        held += f" ({names})"
    else:
        held = (
            f"{len(f.stages)} pipeline stages of {len(f.ranks) // len(f.stages)} "
            f"tensor-parallel rank(s) ({names})"
        )
    at = f" at iteration {f.step}" if f.step is not None else ""
    lines = [
        f"Megatron legacy checkpoint{_via(f)}{at}: {held}, {f.tensors} model tensors "
        f"({f.skipped} _extra_state entries skipped per rank)"
    ]
    if f.stages:
        lines.append(_pipeline(f))
    if len(f.ranks) > max(len(f.stages), 1):  # several tensor-parallel ranks a stage
        lines.append(
            f"{f.split} tensors split across the ranks (measured as their shards together), "
            f"{f.tensors - f.split} replicated (counted once, from "
            + ("each stage's mp_rank_00_YYY" if f.stages else "mp_rank_00")
            + ", as Megatron's get_grad_norm_fp32 does)"
        )
    error = {
        NONE: "no optimizer state saved (--no-save-optim)",
        MISSING: f"{f.lacking}/: its optimizer is Megatron's distributed optimizer, whose state "
        f"save_checkpoint writes to {DISTRIBUTED} beside {FILE}, and there is none: moments "
        "not measured",
    }.get(f.state)
    said = f"a Megatron legacy checkpoint: {pattern}/{FILE}"
    weight, evidence = f"{said}'s model", None
    if f.state in (PER_PARAMETER, BUCKETS):
        evidence = (
            f"a Megatron legacy checkpoint: {pattern}/{DISTRIBUTED}"
            if f.state == BUCKETS
            else f"{said}'s optimizer"
        )
    if f.masters and f.state == BUCKETS:
        weight = f"{evidence}'s param"
        lines.append(
            f"the optimizer state and the weights (its fp32 params) are {DISTRIBUTED}'s: "
            f"the distributed optimizer's flat grad buffers{_PLACED}"
        )
    elif f.masters:
        weight = f"{said}'s optimizer fp32_from_fp16_params"
        lines.append(
            "the weights are the optimizer's fp32 masters (fp32_from_fp16_params); the model "
            "holds them rounded"
        )
    if error is not None:
        lines.append(error)
    if f.siblings > 1:
        lines.append(
            f"covers {f.ranks[0]} only, one of {f.siblings} "
            + (
                "ranks of the pipeline stages: its layers and shards"
                if f.stages
                else "tensor-parallel ranks: its shards"
            )
            + f" alone; {visible(f.folder)}/ holds the whole model"
        )
    return Wording(
        tuple(lines), weight, evidence, error,
        _no_gradients(f.path, "Megatron legacy checkpoint", FILE),
    )


def _pipeline(f: LegacyFacts) -> str:
    """Which global layers each stage (each model chunk of it) holds."""
    virtual = len(f.stages[0].chunks)
    held = ("; " if virtual > 1 else ", ").join(
        ", ".join(
            _span(offset, count) + (f" ({key})" if virtual > 1 else "")
            for key, offset, count in stage.chunks
        )
        + f" in {stage.folder}"
        for stage in f.stages
    )
    line = (
        (
            f"decoder layers {held}: each virtual pipeline chunk numbers its own from 0, "
            "named here by the global layer (the args' num_layers, pipeline split and "
            f"virtual_pipeline_model_parallel_size {virtual})"
        )
        if virtual > 1
        else f"decoder layers {held}: each stage numbers its own from 0, named here by the "
        "global layer (the args' num_layers and pipeline split)"
    )
    if f.tied:
        line += (
            f"; the last stage's {COPY} is its copy of embedding.word_embeddings.weight "
            "(tied): not counted, as Megatron's grad norm skips the shared copy"
        )
    return line


def _span(offset: int, count: int) -> str:
    if count == 0:
        return "none"
    return str(offset) if count == 1 else f"{offset}-{offset + count - 1}"
