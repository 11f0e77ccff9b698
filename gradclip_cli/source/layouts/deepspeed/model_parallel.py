"""DeepSpeed's model-parallel ranks, tensor-parallel ranks or ZeRO's pipeline stages, each
read as a checkpoint of its own (a ``Part``), checked to be one checkpoint and joined (the
package's docstring gives the rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.megatron_pickle import NamespaceState
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import Checkpoint, OptimizerState, StoredTensor, chained
from gradclip_cli.source.untrusted import is_count, is_int

from ..tensor_parallel import hidden_size, merged, split_axis


@dataclass
class Part:
    """One model-parallel rank's checkpoint: its parameters (shards, under tensor
    parallelism) and their optimizer state, as one rank alone would be read."""

    model: Checkpoint
    stage: int  # ZeRO's; 0 without ZeRO
    world: int  # data-parallel ranks
    trainable: dict[str, tuple[int, ...]]
    weights: dict[str, StoredTensor]  # the trainable ones and the frozen ones
    optimizer: OptimizerState


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
    Megatron's args) and none says there are pipeline stages (``tensor_parallel`` checks
    that they agree). Returns ``(1, len(parts))``: one stage, so many tensor-parallel ranks."""
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
                raise InputError(f"{file}: {key} is {quoted(size)[:40]}, but {held}")
        for key, size in (
            ("pp_degree", dims.get("pp_degree")),
            ("args.pipeline_model_parallel_size", args.get("pipeline_model_parallel_size")),
        ):
            if size is not None and size != 1:
                raise InputError(
                    f"{file}: {key} is {quoted(size)[:40]}; gradclip "
                    "reads DeepSpeed checkpoints of tensor-parallel ranks only"
                )
    return 1, n


def check_pipeline_ranks(parts: list[Part], folder: Path) -> tuple[int, int] | None:
    """The ranks of a pipeline of several stages (``pp_degree`` stages x ``tp_degree``
    tensor-parallel ranks, as many as the rank files) are one checkpoint: each says so, and
    each tensor-parallel rank's stages hold other parameters. Returns
    ``(pp_degree, tp_degree)``, or None where the ranks say of no stages: one stage (as
    Megatron-DeepSpeed's GPTModelPipe runs without pipeline parallelism) is read as any
    model-parallel set."""
    n = len(parts)
    dims = dimensions(parts[0].model)
    pp, tp = dims.get("pp_degree"), dims.get("tp_degree")
    if n == 1 or not is_int(pp) or pp <= 1:
        return None
    if not is_count(tp, 1) or pp * tp != n:
        raise InputError(
            f"{parts[0].model.path}: a pipeline checkpoint whose "
            f"checkpoint_parallel_dimensions are {quoted(dims)[:80]}, for {n} rank "
            "files: pp_degree x tp_degree should count them"
        )
    for p in parts:
        args = megatron_args(p.model)
        for key, size, expected in (
            ("mp_world_size", p.model.root.get("mp_world_size"), n),
            ("checkpoint_parallel_dimensions", dimensions(p.model), dims),
            # Megatron's args, where saved.
            ("args.tensor_model_parallel_size", args.get("tensor_model_parallel_size", tp), tp),
            ("args.pipeline_model_parallel_size",
             args.get("pipeline_model_parallel_size", pp), pp),
        ):
            if size != expected:
                raise InputError(
                    f"{p.model.path}: its {key} is {quoted(size)[:80]}, but "
                    f"{folder.name}/ holds {n} rank files, {pp} pipeline stages x {tp} "
                    "tensor-parallel rank(s): the ranks are not one checkpoint"
                )
    for t in range(tp):
        # Each tensor-parallel rank's stages: one ZeRO layout and step, and each parameter
        # on one stage only (a layer tied across stages, whose copies the stages keep alike,
        # is refused rather than counted twice or guessed once).
        stages, seen = parts[t::tp], {}
        for p in stages:
            refuse_other_run(p, stages[0], "stages")
            for name in p.weights:
                if name in seen:
                    raise InputError(
                        f"{p.model.path}: holds {name}, which {seen[name].name} holds "
                        "too (a layer tied across pipeline stages); gradclip does not read tied "
                        "stages"
                    )
                seen[name] = p.model.path
    return pp, tp


def join_stages(parts: list[Part]) -> Part:
    """One tensor-parallel rank's stages as one part: their parameters side by side, in
    stage order, and their optimizer states as one (``chained``: each stage's param groups
    kept, with their hyperparameters)."""
    optimizer, _ = chained([p.optimizer for p in parts], parts[0].optimizer.file)
    return replace(
        parts[0],
        trainable={n: s for p in parts for n, s in p.trainable.items()},
        weights={n: t for p in parts for n, t in p.weights.items()},
        optimizer=optimizer,
    )


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
            which = f" ({other})" if other is not None else ""
            raise InputError(
                f"{part.model.path}: its parameters differ from {first.model.path.name}'s"
                f"{which}: the ranks are not one model"
            )


# The hyperparameters the moments are read with: the same on every model-parallel rank.
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def tensor_parallel(
    parts: list[Part], where: Mapping[str, Path] | None = None
) -> tuple[dict[str, StoredTensor], OptimizerState, int]:
    """The model-parallel ranks, checked alike, their shards as whole parameters and their
    moments alike: split or replicated as Megatron's layer names say (``tensor_parallel``);
    and how many are split. A name the rule cannot place is refused naming the file it was
    read from (``where``; else the first rank's model state file, whose ``param_shapes`` name
    it)."""
    check_alike(parts)
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
                    f"{held_in(part.optimizer, pid)}: Adam's step of {name} differs "
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
