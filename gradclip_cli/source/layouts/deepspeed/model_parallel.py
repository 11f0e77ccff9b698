"""DeepSpeed's model-parallel ranks, each read as a checkpoint of its own (a ``Part``),
checked to be one checkpoint and joined (the package's docstring gives the rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.megatron_pickle import NamespaceState
from gradclip_cli.source.interface import Checkpoint, OptimizerState, StoredTensor
from gradclip_cli.source.untrusted import is_int

from ..draft import Draft
from ..tensor_parallel import hidden_size, merged, split_axis
from .reader import mp_name


@dataclass
class Part:
    """One model-parallel rank's checkpoint: its parameters (shards, under tensor
    parallelism) and their optimizer state, as one rank alone would be read."""

    mp: int
    model: Checkpoint
    stage: int  # ZeRO's; 0 without ZeRO
    world: int  # data-parallel ranks
    trainable: dict[str, tuple[int, ...]]
    weights: dict[str, StoredTensor]  # the trainable ones and the frozen ones
    optimizer: OptimizerState
    held: str  # the optimizer files, for the evidence


def megatron_args(model: Checkpoint) -> Mapping:
    """Megatron's ``args`` where Megatron-DeepSpeed saved them (its ``client_state``)."""
    args = model.root.get("args")
    return args.state if isinstance(args, NamespaceState) else {}


def dimensions(model: Checkpoint) -> Mapping:
    """``checkpoint_parallel_dimensions`` (``pp_degree``, ``tp_degree``), where recorded."""
    dims = model.root.get("checkpoint_parallel_dimensions")
    return dims if isinstance(dims, Mapping) else {}


def check_tensor_parallel(parts: list[Part], folder: Path) -> tuple[int, int]:
    """The model-parallel ranks are one checkpoint of tensor-parallel ranks: each says how
    many there are (DeepSpeed's ``mp_world_size`` and ``checkpoint_parallel_dimensions``,
    Megatron's args), none says there are pipeline stages, and they agree
    (``check_alike``). Returns ``(1, len(parts))``: one stage, so many tensor-parallel ranks."""
    n = len(parts)
    held = f"{folder.name}/ holds {n} model-parallel rank(s)"
    for part in parts:
        root, file = part.model.root, part.model.path
        dims = dimensions(part.model)
        args = megatron_args(part.model)
        for key, size in (
            ("mp_world_size", root.get("mp_world_size")),
            ("tp_degree", dims.get("tp_degree")),
            ("args.tensor_model_parallel_size", args.get("tensor_model_parallel_size")),
        ):
            if size is not None and (not is_int(size) or size != n):
                raise InputError(f"{file}: {key} is {visible(repr(size))[:40]}, but {held}")
        for key, size in (
            ("pp_degree", dims.get("pp_degree")),
            ("args.pipeline_model_parallel_size", args.get("pipeline_model_parallel_size")),
        ):
            if size is not None and size != 1:
                raise InputError(
                    f"{file}: {key} is {visible(repr(size))[:40]}; gradclip "
                    "reads DeepSpeed checkpoints of tensor-parallel ranks only"
                )
    check_alike(parts)
    return 1, n


def refuse_other_run(part: Part, first: Part, ranks: str) -> None:
    """``part`` and ``first`` (ranks, or stages: ``ranks`` says which, for the message) are
    one checkpoint: the same ZeRO layout, step and DeepSpeed version."""
    if (part.stage, part.world) != (first.stage, first.world):
        raise InputError(
            f"{part.model.path}: ZeRO stage {part.stage} over {part.world} data-parallel "
            f"ranks, {first.model.path.name} stage {first.stage} over {first.world}: the "
            f"{ranks} are not one checkpoint"
        )
    refuse_other_step(part.model, first.model, ranks)


def refuse_other_step(model: Checkpoint, first: Checkpoint, ranks: str) -> None:
    """``model`` was saved at ``first``'s step by ``first``'s DeepSpeed version."""
    for key in ("global_steps", "ds_version"):
        if model.root.get(key) != first.root.get(key):
            raise InputError(
                f"{model.path}: its {key} differs from {first.path.name}'s: the {ranks} are "
                "not one checkpoint"
            )


def check_alike(parts: list[Part]) -> None:
    """Tensor-parallel ranks are one checkpoint: the same ZeRO layout, step, DeepSpeed version,
    and every parameter's name and shape (their shards'), trained ones in the same order."""
    first = parts[0]
    for part in parts[1:]:
        refuse_other_run(part, first, "ranks")
        mine = {n: tuple(t.shape) for n, t in part.weights.items()}
        theirs = {n: tuple(t.shape) for n, t in first.weights.items()}
        if mine != theirs or list(part.trainable) != list(first.trainable):
            other = next((n for n in mine.keys() ^ theirs.keys()), None) or next(
                (n for n in mine if mine[n] != theirs.get(n)), None
            )
            which = f" ({visible(other)})" if other is not None else ""
            raise InputError(
                f"{part.model.path}: its parameters differ from {first.model.path.name}'s"
                f"{which}: the ranks are not one model"
            )


# The hyperparameters the moments are read with: the same on every model-parallel rank.
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def tensor_parallel(
    parts: list[Part], where: Mapping[str, Path] | None = None
) -> tuple[dict[str, StoredTensor], OptimizerState, int]:
    """The model-parallel ranks' shards as whole parameters, and their moments alike: split
    or replicated as Megatron's layer names say (``tensor_parallel``); and how many are
    split. A name the rule cannot place is refused naming the file it was read from
    (``where``; else the first rank's model state file, whose ``param_shapes`` name it)."""
    first = parts[0]
    shapes = {n: tuple(t.shape) for n, t in first.weights.items()}
    hidden = hidden_size(megatron_args(first.model), shapes)
    where = where or {}
    axes = {
        n: split_axis(n, s, hidden, where.get(n, first.model.path)) for n, s in shapes.items()
    }
    weights = {n: merged(n, [p.weights[n] for p in parts], axes[n]) for n in shapes}
    names = first.optimizer.param_names or {}

    def hyper(part: Part) -> list[tuple]:
        return [tuple(g.get(k) for k in HYPERPARAMETERS) for g in part.optimizer.param_groups]

    for part in parts[1:]:
        if hyper(part) != hyper(first):
            # The first group that differs names the file (a pipeline's groups are its
            # stages' files').
            g = next((g for g, (a, b) in enumerate(zip(hyper(part), hyper(first))) if a != b), 0)
            pid = next(iter(part.optimizer.param_groups[g]["params"]), None)
            raise InputError(
                f"{held_in(part.optimizer, pid)}: its param groups' "
                f"{', '.join(HYPERPARAMETERS)} differ from "
                f"{held_in(first.optimizer, pid).name}'s: the ranks are not one checkpoint"
            )
    state = {}
    for pid, entry in first.optimizer.state.items():
        name = names[pid]
        entry = dict(entry)
        for part in parts[1:]:
            if part.optimizer.state[pid].get("step") != entry.get("step"):
                raise InputError(
                    f"{held_in(part.optimizer, pid)}: Adam's step of {visible(name)} differs "
                    f"from {held_in(first.optimizer, pid).name}'s: the ranks are not one "
                    "checkpoint"
                )
        for key, value in entry.items():
            if isinstance(value, StoredTensor):
                shards = [p.optimizer.state[pid][key] for p in parts]
                entry[key] = merged(value.name, shards, axes[name])
        state[pid] = entry
    optimizer = OptimizerState(first.optimizer.param_groups, state, names, first.optimizer.file)
    return weights, optimizer, sum(axis is not None for axis in axes.values())


def held_in(optimizer: OptimizerState, pid: int | None) -> Path:
    """The file that holds parameter ``pid``'s moments (a pipeline's state spans its stages'
    files), else the optimizer's."""
    moment = optimizer.state.get(pid, {}).get("exp_avg") if pid is not None else None
    if isinstance(moment, StoredTensor) and moment.pieces and moment.pieces[0].file is not None:
        return moment.pieces[0].file
    return optimizer.file


def ranks_of(stages: int, tp: int) -> str:
    """The model-parallel ranks, in words: ``2 pipeline stages x 2 tensor-parallel ranks``."""
    if stages == 1:
        return f"{tp} model-parallel ranks"
    if tp == 1:
        return f"{stages} pipeline stages"
    return f"{stages} pipeline stages x {tp} tensor-parallel ranks"


def note_split(contents: Draft, split: int, count: int, stages: int = 1) -> None:
    """How many of ``count`` tensors the model-parallel ranks split, and how many they copy
    (each stage's tensor-parallel rank 0 keeping the copy counted, under pipeline stages)."""
    ranks = "model-parallel ranks" if stages == 1 else "tensor-parallel ranks"
    once = mp_name(0) if stages == 1 else "each stage's tensor-parallel rank 0"
    contents.description.append(
        f"{split} tensors split across the {ranks} (measured as their shards together), "
        f"{count - split} replicated (counted once, from {once}, as Megatron's "
        "get_grad_norm_fp32 does), by Megatron's layer names"
    )
