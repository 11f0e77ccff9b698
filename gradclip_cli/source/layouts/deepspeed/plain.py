"""DeepSpeed without ZeRO (stage 0): each model-parallel rank's one
``mp_rank_XX_model_states.pt`` holds the module and the optimizer (``read``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import Checkpoint, OptimizerState, StoredTensor
from gradclip_cli.source.naming import Model, map_names
from gradclip_cli.source.untrusted import is_int
from gradclip_cli.source.vocabulary import step_value

from ..draft import Draft
from ..master_copy import head_key, rounds_to
from ..torch_optim import is_optimizer_state, optimizer_state
from .facts import PLAIN, DeepSpeedFacts
from .model_parallel import Part, check_tensor_parallel, dimensions, tensor_parallel
from .reader import PLAIN_STATES, Reader, complete, module_state, mp_name


def read(reader: Reader, given: Path, kind: str) -> tuple[Draft, DeepSpeedFacts]:
    """The folder's model state files, one model-parallel rank each (``read_ranks`` where
    there are several): the ``module`` is the model's state dict (parameters and the
    buffers ``buffer_names`` lists), the ``optimizer`` as ``plain_optimizer`` reads it."""
    ranks = sorted(
        int(m.group(1)) for n in os.listdir(reader.folder) if (m := PLAIN_STATES.fullmatch(n))
    )
    complete(reader.folder, ranks, "model state files of {} without ZeRO", "model-parallel ranks")
    if len(ranks) > 1:
        return read_ranks(reader, given, kind, len(ranks))
    model = reader.load(f"{mp_name(0)}_model_states.pt")
    check_saved_without_zero(model)
    params, buffers = module_state(model)
    optimizer, masters = plain_optimizer(model, params, kind)
    contents = reader.contents(given, kind)
    contents.weights = {**params, **masters}
    contents.order = list(params)
    contents.buffers = buffers or None
    dp = model.root.get("dp_world_size")
    facts = DeepSpeedFacts(PLAIN, **reader.saved(model), parameters=None,
                           dp=dp if is_int(dp) else None, model_files=(model.path.name,))
    if optimizer is None:
        return contents, facts
    contents.optimizers = [optimizer]
    trained = with_state(optimizer)
    return contents, replace(
        facts, parameters=len(trained), tensors=len(params), frozen=len(params) - len(trained),
        masters=len(masters), sixteen=module_dtypes(params, masters) if masters else "",
        zero_gradient_step=bool(masters) and one_step_ahead(optimizer, trained, facts.step),
    )


def read_ranks(
    reader: Reader, given: Path, kind: str, count: int
) -> tuple[Draft, DeepSpeedFacts]:
    """Tensor-parallel ranks without ZeRO: each rank's file read as ``read`` reads one, then
    joined as ZeRO's model-parallel ranks are (``model_parallel.tensor_parallel``)."""
    parts, low = [], set()
    for mp in range(count):
        model = reader.load(f"{mp_name(mp)}_model_states.pt")
        check_saved_without_zero(model, ranks=count)
        params, _ = module_state(model)
        optimizer, masters = plain_optimizer(model, params, kind)
        if optimizer is None:
            raise InputError(
                f"{model.path}: holds no optimizer state; gradclip joins the "
                "tensor-parallel ranks of a checkpoint without ZeRO by their optimizers"
            )
        if optimizer.param_names is None:
            optimizer = replace(optimizer, param_names=named_in_order(optimizer, params,
                                                                      model.path, kind))
        low.update(module_dtypes(params, masters).split("/") if masters else ())
        parts.append(part(model, {**params, **masters}, optimizer))
    check_tensor_parallel(parts, reader.folder)
    weights, optimizer, split = tensor_parallel(parts)
    first = parts[0]
    contents = reader.contents(given, kind)
    contents.weights = weights
    contents.order = list(weights)
    contents.optimizers = [optimizer]
    trained = with_state(optimizer)
    facts = reader.saved(first.model)
    return contents, DeepSpeedFacts(
        PLAIN, **facts, parameters=len(trained), tensors=len(weights),
        frozen=len(weights) - len(trained), dp=first.world, tp=count, split=split,
        model_files=tuple(p.model.path.name for p in parts), sixteen="/".join(sorted(low)),
        zero_gradient_step=bool(low) and one_step_ahead(optimizer, trained, facts["step"]),
    )


def part(model: Checkpoint, weights: dict[str, StoredTensor], optimizer: OptimizerState) -> Part:
    """One model-parallel rank without ZeRO as a ``Part``: its trained parameters are those
    whose optimizer state is not empty."""
    named = optimizer.param_names or {}
    trainable = {named[p]: tuple(weights[named[p]].shape) for p in with_state(optimizer)}
    dp = model.root.get("dp_world_size")
    return Part(model, 0, dp if is_int(dp) else 1, trainable, weights, optimizer)


def named_in_order(
    optimizer: OptimizerState, weights: dict[str, StoredTensor], file: Path, kind: str
) -> dict[int, str]:
    """The names of ``optimizer``'s parameters, from the order of the module's ``weights``
    (``naming.map_names``, the contract's one interleaving that fits every shape)."""
    return map_names(optimizer, Model(weights, list(weights)))


def with_state(optimizer: OptimizerState) -> list:
    """The parameters of torch's optimizer state dict that hold state, in group order."""
    return [p for g in optimizer.param_groups for p in g["params"] if optimizer.state.get(p)]


def module_dtypes(params: dict[str, StoredTensor], names) -> str:
    """The module's dtypes of ``names``, as words (``bfloat16``)."""
    return "/".join(sorted({str(params[n].dtype).removeprefix("torch.") for n in names}))


def one_step_ahead(optimizer: OptimizerState, trained: list, step: int | None) -> bool:
    """Whether Adam's step is one past ``global_steps`` (``step``): under fp16/bf16 without
    ZeRO, ``FP16_UnfusedOptimizer.initialize_optimizer_states`` steps once with zero
    gradients."""
    steps = {step_value(optimizer.state[p].get("step")) for p in trained}
    return step is not None and steps == {step + 1}


def check_saved_without_zero(
    model: Checkpoint, pipeline_files: int = 0, ranks: int = 1, tp: int = 1
) -> None:
    """A ZeRO checkpoint whose optimizer files are gone is not one saved without ZeRO; and
    its counts say one model-parallel rank, or ``pipeline_files`` model state files beside
    the layer files of ``tp`` tensor-parallel ranks (several ``ranks``: checked by
    ``model_parallel.check_tensor_parallel``)."""
    config = model.root.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    stage = zero.get("stage") if isinstance(zero, Mapping) else 0
    if model.root.get("param_shapes") is not None or stage not in (0, None, False):
        raise InputError(
            f"{model.path}: saved by ZeRO (stage {quoted(stage)[:20]}, or param_shapes "
            "recorded), but the folder holds no zero_pp_rank_*_optim_states.pt: the "
            "optimizer's files are missing"
        )
    dims = dimensions(model)
    if pipeline_files:
        files = pipeline_files
        held = (
            f"{files} pipeline stage file(s) (mp_rank_XX_model_states.pt) beside its layer files"
            if tp == 1
            else f"{files} model state files (mp_rank_XX_model_states.pt) beside the layer "
            f"files of {tp} tensor-parallel ranks"
        )
        for key, size, expected in (
            ("mp_world_size", model.root.get("mp_world_size"), files),
            ("pp_degree", dims.get("pp_degree"), files // tp if files % tp == 0 else None),
            ("tp_degree", dims.get("tp_degree"), tp),
        ):
            if not is_int(size) or size != expected:
                raise InputError(
                    f"{model.path}: {key} is {quoted(size)[:40]}, but the folder holds "
                    f"{held}; gradclip reads DeepSpeed pipeline stages without ZeRO, all of them"
                )
        return
    if ranks > 1:
        return
    for key, size in (
        ("mp_world_size", model.root.get("mp_world_size")),
        ("pp_degree", dims.get("pp_degree")),
        ("tp_degree", dims.get("tp_degree")),
    ):
        if size is not None and size != 1:
            raise InputError(
                f"{model.path}: {key} is {quoted(size)[:40]}, but the folder holds "
                f"{mp_name(0)} alone: the other ranks' model state files are missing"
            )


def plain_optimizer(
    model: Checkpoint, params: dict[str, StoredTensor], kind: str
) -> tuple[OptimizerState | None, dict[str, StoredTensor]]:
    """The ``optimizer`` entry of a checkpoint without ZeRO: torch's optimizer state dict,
    or, under fp16/bf16 mixed precision, DeepSpeed's ``FP16_UnfusedOptimizer`` state (that
    state dict as ``optimizer_state_dict``, and ``fp32_groups``: the fp32 master weights,
    one list per param group), with the master weights by name."""
    value, file = model.root.get("optimizer"), model.path
    if value is None:
        return None, {}
    if is_optimizer_state(value):
        return optimizer_state(value, file, "'optimizer'"), {}
    if not isinstance(value, Mapping) or not is_optimizer_state(value.get("optimizer_state_dict")):
        raise InputError(
            f"{file}: 'optimizer' is neither torch's optimizer state dict nor DeepSpeed's "
            "fp16/bf16 optimizer state around one (optimizer_state_dict)"
        )
    if "fp32_groups_flat" in value:
        # FP16_Optimizer (DeepSpeed's fused fp16 optimizer) steps flat buffers, one per group,
        # whose cut into parameters no file records.
        raise InputError(
            f"{file}: 'optimizer' is DeepSpeed's fused FP16_Optimizer state (fp32_groups_flat, "
            "one flat buffer per param group); gradclip does not read it"
        )
    where = "'optimizer'.optimizer_state_dict"
    optimizer = optimizer_state(value["optimizer_state_dict"], file, where)
    groups = value.get("fp32_groups")
    if not isinstance(groups, (list, tuple)) or len(groups) != len(optimizer.param_groups):
        raise InputError(
            f"{file}: 'optimizer'.fp32_groups should list the fp32 master weights of each of "
            f"the {len(optimizer.param_groups)} param groups"
        )
    for g, (group, held) in enumerate(zip(optimizer.param_groups, groups)):
        if (
            not isinstance(held, (list, tuple))
            or len(held) != len(group["params"])
            or not all(isinstance(m, torch.Tensor) and m.dtype == torch.float32 for m in held)
        ):
            raise InputError(
                f"{file}: 'optimizer'.fp32_groups[{g}] does not hold one fp32 master weight "
                f"per parameter of param group {g} ({len(group['params'])})"
            )
    # The groups hold the trained parameters only (FP16_UnfusedOptimizer leaves out the
    # frozen ones), and after every step DeepSpeed copies each master into its 16-bit
    # parameter: a parameter that no master rounds to is frozen. That evidence, beside the
    # shapes, tells apart a frozen parameter from a trained one of the same shape.
    trained = rounded_from(params, [m for held in groups for m in held])
    probe = {n: t for n, t in params.items() if n in trained}
    count = sum(len(held) for held in groups)
    if len(probe) < count:
        raise InputError(
            f"{file}: 'optimizer'.fp32_groups holds {count} fp32 master weights, but only "
            f"{len(probe)} of the module's parameters are a master rounded to their dtype: "
            "the masters and the module disagree"
        )
    names = map_names(optimizer, Model(probe, list(probe)))
    optimizer = replace(optimizer, param_names=names)
    masters = {}
    for g, (group, held) in enumerate(zip(optimizer.param_groups, groups)):
        for pid, master in zip(group["params"], held):
            # Every master is an fp32 tensor (checked above); its name must be a parameter's
            # of its shape.
            name = names.get(pid)
            if name is None or tuple(master.shape) != tuple(params[name].shape):
                shown = name if name is not None else f"parameter {pid}"
                raise InputError(
                    f"{file}: 'optimizer'.fp32_groups[{g}] holds no fp32 tensor of {shown}'s shape"
                )
            masters[name] = StoredTensor.whole(name, master, file)
    return optimizer, masters


def rounded_from(params: dict[str, StoredTensor], masters: list[torch.Tensor]) -> set[str]:
    """The parameters that some fp32 master, rounded to the parameter's dtype, equals
    (``master_copy.rounds_to``). Candidates are found by shape and the first elements, then
    compared whole, one rounded master at a time."""
    dtypes = {p.dtype for p in params.values()}
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for master in masters:
        for dtype in dtypes:
            by_key.setdefault(head_key(master, dtype), []).append(master)
    found = set()
    for name, stored in params.items():
        value = stored.read()
        candidates = by_key.get(head_key(value, value.dtype), ())
        if any(rounds_to(m, value) for m in candidates):
            found.add(name)
    return found
