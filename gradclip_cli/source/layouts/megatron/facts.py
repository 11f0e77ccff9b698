"""What a Megatron ``torch_dist`` checkpoint was found to hold, as data, and the one
function that words it.

The reader records facts (``DistCkptFacts``: how many tensors, which optimizer state and
where, which fp32 main params were measured); ``wording`` makes the report's sentences
from them: the description, the evidence of each role, and why moments are missing. So
what was found and how it is said are tested apart, and a layout built on Megatron's
folders (NeMo 2's ``weights/``) says it under its own title.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tracker import COMMON, JSON, TRACKER

# Where the optimizer state was read from (``DistCkptFacts.state``).
NONE = "none"  # no moments saved
PER_PARAMETER = "per parameter"  # the plain optimizer's, optimizer.state.<moment>.<name>
FULLY = "fully_reshardable"  # the distributed optimizer's, per parameter (optimizer.state.*)
BUCKETS = "dp_reshardable"  # the distributed optimizer's grad-buffer buckets, placed and checked
UNREAD = "unread"  # the distributed optimizer's, saved in a way gradclip does not read


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


@dataclass(frozen=True)
class Wording:
    description: str
    weight_evidence: str
    optimizer_evidence: str | None
    optimizer_error: str | None


def wording(facts: DistCkptFacts) -> Wording:
    """The report's sentences of a ``torch_dist`` checkpoint, from its facts."""
    f = facts
    said = f"a torch_dist checkpoint: {JSON} sharded_backend torch_dist"
    weight, evidence, error = said, None, None
    held = f"optimizer state for {f.parameters} parameters"
    kind = "optimizer.state.param" if f.state == FULLY else "optimizer.state.fp32_param"
    optimizer = "distributed" if f.state == FULLY else "mixed-precision"
    whose = f"{optimizer} optimizer's fp32 main params ({kind} entries"
    if f.state == PER_PARAMETER:
        evidence = f"{said}, optimizer.state entries, {COMMON}'s step and betas"
    elif f.state == FULLY:
        which = (  # a ChainedOptimizer's under expert parallelism
            f"a ChainedOptimizer's {f.chained} distributed optimizers'"
            if f.chained
            else "the distributed optimizer's"
        )
        held += f" from {which} fully_reshardable state (optimizer.state.*)"
        evidence = (
            f"{said}, {which} fully_reshardable optimizer.state entries, "
            f"{COMMON}'s param groups' step and betas"
        )
    if f.mains and f.state in (NONE, PER_PARAMETER, FULLY):
        held += f" and the fp32 main params of {f.mains} ({kind})"
    if f.state == BUCKETS:
        held = _buckets(f)
        which = (
            "a ChainedOptimizer's distributed optimizers' dp_reshardable buckets "
            "(chained_N.optimizer.distributed.*)"
            if f.chained
            else "the distributed optimizer's dp_reshardable buckets (optimizer.distributed.*)"
        )
        evidence = f"{said}, {which}, their param groups' step and betas"
        if f.mains:
            held += f"; their param, the fp32 main params of {f.mains}"
            whose = "distributed optimizer's fp32 main params (its buckets' param"
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
    via = f" ({TRACKER} names {f.folder})" if f.tracked else ""
    description = (
        f"{f.title}{via} at iteration {f.step}: {model} "
        f"({f.layers} stacked layers split per layer), {held}"
    )
    return Wording(description, weight, evidence, error)


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
            f"{f.chained} distributed optimizers: {' and '.join(each)}"
            + _PLACED
        )
    return f"optimizer state for {f.parameters} parameters from {each[0]}{_PLACED}"


_PLACED = (
    ", each parameter's slice placed by Megatron's bucket layout and checked against the "
    "model's tensors"
)
