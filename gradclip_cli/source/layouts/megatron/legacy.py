"""Megatron legacy checkpoints: ``iter_NNNNNNN/mp_rank_XX/model_optim_rng.pt``.

Megatron-LM's ``save_checkpoint`` with ``--ckpt-format torch`` (core_v0.16.1,
``megatron/training/checkpointing.py``) has each tensor-parallel rank ``XX`` of the first
data-parallel rank ``torch.save`` one file,
``<save>/iter_0000003/mp_rank_XX/model_optim_rng.pt``, then writes the tracker
(``megatron`` follows it to either format).
The file holds ``args`` (an ``argparse.Namespace``, read as inert data:
``files/megatron_pickle``), ``iteration``, ``model`` (tensors by name; Transformer
Engine's ``*._extra_state`` entries skipped), ``optimizer`` and ``rng_state``.

``optimizer`` is the Megatron optimizer's ``state_dict()``:

* ``FP32Optimizer``: torch's own optimizer state dict, over Megatron's param
  groups (decayed weights; biases and norms without decay), ids only;
* ``Float16OptimizerWithFloat16Params`` (bf16, fp16): ``{"optimizer": <torch's>,
  "grad_scaler": ..., "fp32_from_fp16_params": [[fp32 copy, ...] per group]}``:
  each group's fp32 master copies of its 16-bit parameters, in group order.
  These masters are the weights reported (the model's own copy is rounded), each checked
  to round to the model's tensor (``master_copy.rounds_to``), else the file is refused;
* ``ChainedOptimizer`` of several: a list of the above, one per optimizer;
* the distributed optimizer (``--use-distributed-optimizer``) saves only its param
  groups there (with Adam's one ``step``), and its state in ``distrib_optim.pt`` beside
  the file (``get_parameter_state_dp_zero``, which gathers every data-parallel rank's
  share): per grad buffer of Megatron's DDP, flat fp32 ``param``, ``exp_avg`` and
  ``exp_avg_sq`` of ``numel_unpadded`` elements, the buckets side by side. Each
  parameter's slice is placed by Megatron's bucket layout (``distributed_optimizer``;
  one bucket without ``--overlap-grad-reduce`` and on every pipeline stage after the
  first, else closed at ``--ddp-bucket-size``, ``--ddp-num-buckets`` or ``max(40M, 1M x
  data-parallel size)`` elements) and checked before any moment is read: every padding
  element is 0 and each ``param`` slice rounds to the model's tensor, else the file is
  refused. The ``param`` slices are the fp32 masters, the weights reported.

Recognised by content: an ``iter_N/`` folder holding ``mp_rank_XX/model_optim_rng.pt``;
the save folder, by its tracker (``megatron``, which hands a legacy iteration here).

Parameter ids map to names by the model's order group by group
(``naming.map_names``, the contract's one interleaving that fits every shape).

Tensor parallelism (``mp_rank_00``, ``mp_rank_01``...): each rank saves its own
shards under the same names; a split parameter is measured as its shards together,
a replicated one once, from ``mp_rank_00``, as Megatron's ``get_grad_norm_fp32``
counts them: decided from Megatron's module names and checked against
``args.hidden_size``, else the norms' size (``tensor_parallel``, which DeepSpeed's
``mp_rank_XX`` files share); a name the rules do not know is refused, naming the file.

Pipeline parallelism (``mp_rank_XX_YYY``: stage YYY, when ``args.pipeline_model_parallel_size``
is above 1; ``get_checkpoint_name`` gives an expert rank the same suffix without it): each
stage numbers its own layers from 0. The global number is the stage's offset, computed from
the args as Megatron-core builds the stages (``pipeline``: an even split,
``decoder_first/last_pipeline_num_layers``, ``account_for_embedding/loss_in_pipeline_split``),
and each stage must hold exactly its count of layers; a custom layout
(``pipeline_model_parallel_layout``) and multi-token prediction are refused. Tied
(``untie_embeddings_and_output_weights`` False), the last stage's ``output_layer.weight``
is a copy of the first stage's word embeddings, marked ``shared``, which
``get_main_grads_for_grad_norm`` skips: it is left out, with its optimizer state.

A virtual (interleaved) pipeline (``virtual_pipeline_model_parallel_size`` V in the args):
each stage's file holds V model chunks, ``model0`` ... ``model{V-1}`` instead of ``model``
(``generate_state_dict``), each numbering its layers from 0; chunk v of every stage comes
before chunk v + 1 of any (4 layers, 2 stages, 2 chunks: stage 0 holds layers 0 and 2,
stage 1 layers 1 and 3), and the chunks of all stages must hold every layer once. The
file's one optimizer lists each group's parameters chunk by chunk (``_get_param_groups``),
the order read here. With the distributed optimizer, ``distrib_optim.pt`` holds one grad
buffer per chunk and dtype, only the first chunk's bucketed (``get_model``). A chunk
missing or left over, a file with both ``model`` and chunks, or chunks the args do not
say, is refused, naming the file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files.megatron_pickle import GLOBALS, NamespaceState
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import Contents, OptimizerState, StoredTensor, chained
from gradclip_cli.source.naming import Model, map_names
from gradclip_cli.source.untrusted import is_count, is_int
from gradclip_cli.source.vocabulary import step_value

from ..dcp_frameworks import refuse_key
from ..draft import Draft
from ..paths import inside
from ..tensor_parallel import hidden_size, merged, split_axis, whole_shards
from ..torch_optim import is_optimizer_state, optimizer_state
from . import facts as said
from .distributed_optimizer import distrib_optim
from .model import BUFFER, SIXTEEN, refuse_if, refuse_unrounded
from .pipeline import by_layer, global_names, stage_layers
from .tracker import DISTRIBUTED, FILE, RANK, is_legacy

KIND = "megatron-legacy"
_EXTRA = "._extra_state"


def recognises(path: Path) -> bool:
    """An ``iter_N/`` folder of the legacy format (its save folder is ``megatron``'s), one
    rank's ``mp_rank_XX/`` folder, or its ``model_optim_rng.pt``."""
    if os.path.isdir(path):
        return is_legacy(path) or _is_rank(path)
    return path.name == FILE and _is_rank(path.parent)


def _is_rank(folder: Path) -> bool:
    return RANK.fullmatch(folder.name) is not None and os.path.isfile(folder / FILE)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "a Megatron legacy checkpoint")
    if os.path.isdir(path) and is_legacy(path):
        return open_iteration(path, path, None, trust_pickle=trust_pickle, verify=verify).finish()
    rank = path if os.path.isdir(path) else path.parent  # one rank alone, said so
    return open_iteration(
        path, rank.parent, None, trust_pickle=trust_pickle, verify=verify, only=rank.name
    ).finish()


def open_iteration(
    path: Path, folder: Path, tracker: Path | None, *, trust_pickle: bool, verify: bool,
    only: str | None = None,
) -> Draft:
    stages = _read_stages(folder, trust_pickle=trust_pickle, verify=verify, only=only)
    every = [r for stage in stages for r in stage]
    first = every[0]
    step = _same(every, "iteration", lambda r: r.iteration)
    layers = stage_layers(stages) if first.stage is not None else None
    names: list[str] = []
    weights: dict[str, StoredTensor] = {}
    kinds: dict[str, int | None] = {}
    groups: list[tuple[dict, dict[str, dict]]] = []  # param groups, their state by global name
    why: tuple[str, str] | None = None  # why there is no optimizer state (the first stage's)
    tied: list[str] = []
    for ranks in stages:
        local, local_kinds = _split_axes(ranks)
        files = [r.file for r in ranks]
        rename, copies = global_names(ranks[0], local, layers) if layers else ({}, [])
        tied += [rename.get(n, n) for n in copies]
        stage_why = next((w for w in [_rank_optimizer(r) for r in ranks] if w), None)
        why = why or stage_why
        if stage_why is None:
            for group, state in _joined_state(ranks, local_kinds):
                kept = {rename.get(n, n): e for n, e in state.items() if n not in copies}
                groups.append((group, kept))  # a tied copy's state left out, as the copy is
        masters = stage_why is None and ranks[0].masters  # the float16 optimizer's fp32
        for n in local:
            if n in copies:
                continue
            g = rename.get(n, n)
            refuse_if(g in weights, ranks[0].file, f"holds {g}, which an earlier "
                      "pipeline stage or chunk holds too: the stages are not one model")
            names.append(g)
            kinds[g] = local_kinds[n]
            shards = [(r.masters if masters else r.weights)[n] for r in ranks]
            weights[g] = merged(g, whole_shards(g, shards, files), local_kinds[n])
    if layers:  # the model's order: an interleaved pipeline's stages hold its layers apart
        names = by_layer(names)
        weights = {n: weights[n] for n in names}
    optimizer = None
    if why is None:  # one optimizer by the model's order
        order = {n: i for i, n in enumerate(names)}
        optimizer = OptimizerState(
            [{**group, "params": [order[n] for n in held]} for group, held in groups],
            {order[n]: entry for _, held in groups for n, entry in held.items()},
            {order[n]: n for _, held in groups for n in held},
            first.file,
        )
    contents = Draft(
        path=path,
        kind=KIND,
        files=([tracker] if tracker else []) + [
            f for r in every for f in (r.file, r.file.parent / DISTRIBUTED)
            if r.distributed or f == r.file
        ],
        folder=folder,
        trusted_pickle=any(r.trusted for r in every),
    )
    contents.weights = weights or None
    contents.order = list(names)
    buffers = {}
    for ranks in stages:  # integer tensors: never weights (replicated or not, rank 0's)
        rename = global_names(ranks[0], list(ranks[0].buffers), layers)[0] if layers else {}
        for n, t in ranks[0].buffers.items():
            buffers[rename.get(n, n)] = StoredTensor.whole(rename.get(n, n), t, ranks[0].file)
    contents.buffers = buffers or None
    if optimizer is not None:
        contents.optimizers.append(optimizer)
    contents.step = step
    state, lacking = why or (said.BUCKETS if first.distributed else said.PER_PARAMETER, "")
    facts = said.LegacyFacts(
        path=path,
        folder=folder.name,
        tracked=tracker is not None,
        step=step,
        ranks=tuple(r.file.parent.name for r in every),
        tensors=len(names),
        skipped=len(first.skipped),
        state=state,
        masters=optimizer is not None and bool(first.masters),
        lacking=lacking,
        split=sum(1 for k in kinds.values() if k is not None),
        stages=tuple(
            said.Stage(r[0].file.parent.name, r[0].stage, tuple(
                (key, *span) for key, span in zip(r[0].chunks, layers["spans"][r[0].stage])
            ))
            for r in (stages if layers else [])
        ),
        tied=bool(tied),
        siblings=sum(1 for n in os.listdir(folder) if RANK.fullmatch(n)) if only else 0,
        tensor_rank=first.tensor_rank or 0,
    )
    contents.say(said.legacy_wording(facts))
    return contents


class _Rank:
    """One ``mp_rank_XX/model_optim_rng.pt``: its model tensors and optimizer state, loaded."""

    def __init__(self, file: Path, root: dict, trusted: bool, reading: dict[str, bool]):
        self.file = file
        self.root = root
        self.trusted = trusted
        self.args = root.get("args").state if isinstance(root.get("args"), NamespaceState) else {}
        self.iteration = _iteration(root, self.args, file)
        self.weights: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.skipped: list[str] = []
        self.chunks = _chunks(root, self.args, file)
        for key in self.chunks:
            self._read_model(key, root[key])
        self.masters: dict[str, torch.Tensor] = {}
        self.optimizer: OptimizerState | None = None
        self.names: dict[int, str] = {}
        self.distributed = False
        self.reading = reading  # how distrib_optim.pt beside it is read
        self.stage: int | None = None  # the pipeline stage of an mp_rank_XX_YYY folder
        self.tensor_rank: int | None = None

    def _read_model(self, key: str, model: Mapping) -> None:
        """One model's (one chunk's) tensors, a chunk's names under its key (``model1.``...),
        in its order: the order Megatron's optimizer lists them in, chunk by chunk."""
        file = self.file
        prefix = f"{key}." if len(self.chunks) > 1 else ""
        for name, value in model.items():
            refuse_if(not isinstance(name, str), file,
                      f"its {key} is keyed by {quoted(name)[:40]}, not by names")
            name = prefix + name
            if name.endswith(_EXTRA):
                self.skipped.append(name)  # Transformer Engine's state (None without it)
            elif (isinstance(value, torch.Tensor) and value.dtype.is_floating_point
                  and not BUFFER.fullmatch(name)):
                self.weights[name] = value
            elif isinstance(value, torch.Tensor):
                self.buffers[name] = value
            else:
                raise InputError(
                    f"{file}: its model entry {name} is a "
                    f"{type(value).__name__}, not a tensor"
                )


def _chunks(root: Mapping, args: Mapping, file: Path) -> list[str]:
    """The keys of the file's models: ``model``, or with a virtual pipeline one a chunk,
    ``model0``, ``model1``... (``generate_state_dict``), as many as the args'
    ``virtual_pipeline_model_parallel_size``; else refused, naming the file."""
    found = sorted(
        (k for k in root if isinstance(k, str) and re.fullmatch(r"model\d+", k)),
        key=lambda k: int(k[len("model") :]),
    )
    virtual = args.get("virtual_pipeline_model_parallel_size")
    if "model" in root and not found and virtual is None:
        refuse_if(not isinstance(root["model"], Mapping), file, "its model is not a state dict")
        return ["model"]
    refuse_if(not found and "model" not in root, file, "holds no 'model' state dict")
    held = (f"{len(found)} virtual pipeline chunk(s) ({', '.join(found)})" if found
            else "one model, no virtual pipeline chunks (model0, model1...)")
    refuse_if("model" in root and found, file,
              f"holds both a model and {held}: gradclip cannot tell which")
    refuse_if(virtual is None, file,
              f"holds {held}, but its args set no virtual_pipeline_model_parallel_size")
    refuse_if(not is_int(virtual) or found != [f"model{i}" for i in range(virtual)], file,
              f"holds {held}, but its args set virtual_pipeline_model_parallel_size "
              f"{quoted(virtual)[:40]}" + (": the chunks are incomplete" if found else ""))
    bad = next((k for k in found if not isinstance(root[k], Mapping)), None)
    refuse_if(bad is not None, file, f"its {bad} is not a state dict")
    return found


def _read_stages(
    folder: Path, *, trust_pickle: bool, verify: bool, only: str | None = None
) -> list[list[_Rank]]:
    """The ranks by pipeline stage, each stage's by tensor-parallel rank: ``mp_rank_XX``
    folders are one stage; ``mp_rank_XX_YYY`` ones are stage YYY's, when the args say
    pipeline parallelism (``get_checkpoint_name``: without it, ``_YYY`` is an expert rank)."""
    found = sorted(n for n in os.listdir(folder) if RANK.fullmatch(n))
    if only is not None:
        found = [only]
    suffixed = [n for n in found if RANK.fullmatch(n).group(2)]
    if not suffixed:
        return [_read_ranks(folder, found, only=only, trust_pickle=trust_pickle, verify=verify)]
    plain = next((n for n in found if n not in suffixed), None)
    refuse_if(plain is not None, folder,
              f"holds both {plain} and {suffixed[0]}: not one checkpoint's ranks")
    expert = next((n for n in found if RANK.fullmatch(n).group(2).count("_") != 1), None)
    if expert is not None:
        raise InputError(
            f"{folder / expert}: an expert-parallel rank (mp_rank_XX_YYY_ZZZ); gradclip reads "
            "Megatron legacy checkpoints of tensor- and pipeline-parallel ranks only"
        )
    ranks = [_load_rank(folder, n, trust_pickle=trust_pickle, verify=verify) for n in found]
    sizes = {}
    for rank in ranks:
        match = RANK.fullmatch(rank.file.parent.name)
        rank.tensor_rank, rank.stage = int(match.group(1)), int(match.group(2)[1:])
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            refuse_if(not is_count(rank.args.get(key), 1), rank.file, f"its args give no {key}, "
                      "so its folder's _YYY cannot be told a pipeline stage")
        expert_size = rank.args.get("expert_model_parallel_size")
        pipeline = rank.args["pipeline_model_parallel_size"]
        tensor = rank.args["tensor_model_parallel_size"]
        refuse_if(pipeline == 1 or expert_size not in (None, 1), rank.file,
                  f"its args say pipeline_model_parallel_size {pipeline}, "
                  f"expert_model_parallel_size {expert_size}: an expert-parallel rank; "
                  "gradclip reads tensor- and pipeline-parallel ranks only")
        refuse_if(rank.stage >= pipeline or rank.tensor_rank >= tensor, rank.file,
                  f"its folder names stage {rank.stage}, tensor-parallel rank {rank.tensor_rank}, "
                  f"but its args say pipeline_model_parallel_size {pipeline}, "
                  f"tensor_model_parallel_size {tensor}")
        sizes.setdefault((tensor, pipeline), rank)
    if len(sizes) > 1:
        (a, first), (b, other) = list(sizes.items())[:2]
        raise InputError(
            f"{other.file}: its args say {b[0]} tensor- x {b[1]} pipeline-parallel ranks, "
            f"{first.file.parent.name}'s {a[0]} x {a[1]}: the ranks are not one checkpoint"
        )
    ((tensor, pipeline),) = sizes
    if only is not None:
        return [ranks]
    expected = [f"mp_rank_{t:02d}_{s:03d}" for s in range(pipeline) for t in range(tensor)]
    missing = next((e for e in expected if e not in found), None)
    refuse_if(sorted(expected) != found, folder, f"holds {', '.join(found)}"
              + (f" but no {missing}" if missing else "")
              + f": its args say {tensor} tensor- x {pipeline} pipeline-parallel ranks; "
              "the ranks are incomplete")
    by_name = {r.file.parent.name: r for r in ranks}
    return [[by_name[f"mp_rank_{t:02d}_{s:03d}"] for t in range(tensor)] for s in range(pipeline)]


def _load_rank(folder: Path, name: str, *, trust_pickle: bool, verify: bool) -> _Rank:
    file = inside(folder, f"{name}/{FILE}", named_by=folder)
    refuse_if(not os.path.isfile(file), file, f"missing (its rank folder {name}/ has no {FILE})")
    with allowing(GLOBALS):
        ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
    refuse_if(not isinstance(ckpt.root, Mapping), file, "not a Megatron checkpoint: not a dict")
    reading = {"trust_pickle": trust_pickle, "verify": verify}
    return _Rank(file, dict(ckpt.root), ckpt.trusted_pickle, reading)


def _read_ranks(
    folder: Path, found: list[str], *, only: str | None, trust_pickle: bool, verify: bool
) -> list[_Rank]:
    """One stage's tensor-parallel ranks, ``mp_rank_00``, ``mp_rank_01``..."""
    expected = [f"mp_rank_{r:02d}" for r in range(len(found))]
    missing = next((e for e in expected if e not in found), None)
    refuse_if(only is None and found != expected, folder, f"holds {', '.join(found)} but no "
              f"{missing}: the tensor-parallel ranks are incomplete")
    ranks = [_load_rank(folder, n, trust_pickle=trust_pickle, verify=verify) for n in found]
    for rank in ranks:
        size = rank.args.get("tensor_model_parallel_size")
        refuse_if(only is None and isinstance(size, int) and size != len(ranks), rank.file,
                  f"its args say tensor_model_parallel_size {size}, but {folder.name}/ holds "
                  f"{len(ranks)} mp_rank folder(s)")
        pipeline = rank.args.get("pipeline_model_parallel_size")
        refuse_if(isinstance(pipeline, int) and pipeline != 1, rank.file,
                  f"its args say pipeline_model_parallel_size {pipeline}, but its folder's name "
                  "gives no pipeline stage (mp_rank_XX_YYY)")
    return ranks


def _iteration(root: Mapping, args: Mapping, file: Path) -> int | None:
    value = root.get("iteration", args.get("iteration"))
    if value is None:
        return None
    step = step_value(value)
    refuse_if(step is None, file, f"iteration is {quoted(value)[:40]}, not a step")
    return step


def _same(ranks: list[_Rank], what: str, get) -> Any:
    value = get(ranks[0])
    for rank in ranks[1:]:
        refuse_if(get(rank) != value, rank.file, f"{what} {get(rank)}, but "
                  f"{ranks[0].file.parent.name}'s is {value}: the ranks are not one checkpoint")
    return value


# ----------------------------------------------------------------- optimizer


def _torch_states(rank: _Rank) -> list[tuple[Any, list | None, str]] | tuple[str, str]:
    """``[(torch state dict, fp32 masters per group or None, where)]``, or why there are none
    (``facts.NONE``, or ``facts.MISSING`` and the rank's folder)."""
    value = rank.root.get("optimizer")
    if value is None:
        return said.NONE, ""
    chained = value if isinstance(value, list) else [value]
    out = []
    for i, one in enumerate(chained):
        where = f"optimizer[{i}]" if isinstance(value, list) else "optimizer"
        inner = one.get("optimizer") if isinstance(one, Mapping) else None
        if is_optimizer_state(one):
            out.append((one, None, where))
        elif is_optimizer_state(inner):
            masters = one.get("fp32_from_fp16_params")
            groups = isinstance(masters, list) and all(isinstance(g, list) for g in masters)
            refuse_if(masters is not None and not groups, rank.file,
                      f"{where}.fp32_from_fp16_params is not a list of groups")
            out.append((inner, masters, f"{where}.optimizer"))
        elif isinstance(inner, Mapping) and "state" not in inner:
            # The distributed optimizer's state_dict(): param groups without their params.
            return said.MISSING, rank.file.parent.name
        else:
            raise InputError(f"{rank.file}: {where} is not a Megatron optimizer state dict")
    return out


def _rank_optimizer(rank: _Rank) -> tuple[str, str] | None:
    """Fill ``rank.optimizer`` (ids renumbered across a chain), ``names`` and ``masters``;
    or why there is no optimizer state (``_torch_states``)."""
    if os.path.isfile(rank.file.parent / DISTRIBUTED):
        distrib_optim(rank)
        return None
    found = _torch_states(rank)
    if isinstance(found, tuple):
        return found
    states = [optimizer_state(value, rank.file, where) for value, _, where in found]
    merged, renumbered = chained(states, rank.file)
    merged = replace(merged, param_names=None)  # Megatron's ids map through the model's order
    group_masters: list[tuple[list[int], list, str]] = []
    for opt, renumber, (_, masters, where) in zip(states, renumbered, found):
        if masters is None:
            continue
        refuse_if(len(masters) != len(opt.param_groups), rank.file, f"{where} has "
                  f"{len(opt.param_groups)} param groups but fp32_from_fp16_params {len(masters)}")
        for g, group in enumerate(opt.param_groups):
            members = [renumber[p] for p in group["params"]]
            group_masters.append((members, masters[g], f"{where}: fp32_from_fp16_params[{g}]"))
    weights = {n: StoredTensor.whole(n, t, rank.file) for n, t in rank.weights.items()}
    rank.names = map_names(merged, Model(weights, list(weights)))
    rank.optimizer = merged
    for members, masters, where in group_masters:
        # The float16 optimizer keeps an fp32 master of each 16-bit parameter of a group, in
        # the group's order; an fp32 parameter is its own master.
        sixteen = [
            rank.names[p]
            for p in members
            if p in rank.names and rank.weights[rank.names[p]].dtype in SIXTEEN
        ]
        refuse_if(len(sixteen) != len(masters), rank.file, f"{where} holds {len(masters)} "
                  f"tensors for the group's {len(sixteen)} 16-bit parameters")
        for name, master in zip(sixteen, masters):
            fits = isinstance(master, torch.Tensor) and master.shape == rank.weights[name].shape
            refuse_if(not fits or not master.dtype.is_floating_point, rank.file,
                      f"{where} holds no fp32 tensor of {name}'s shape")
            # Copied into the model, rounded, after each step: else the two disagree.
            refuse_unrounded(rank.file, name, "fp32_from_fp16_params", master, rank.weights[name])
            rank.masters[name] = master
    for name, weight in rank.weights.items():
        if rank.masters and name not in rank.masters:
            rank.masters[name] = weight  # an fp32 parameter, or one without optimizer state
    return None


def _split_axes(ranks: list[_Rank]) -> tuple[list[str], dict[str, int | None]]:
    """The model's names (rank 0's order), and each one's split axis (None: replicated)."""
    first = ranks[0]
    names = list(first.weights)
    for rank in ranks[1:]:
        if list(rank.weights) != names:
            other = next(iter(set(rank.weights) ^ set(names)), None)
            which = f" ({other} is in one only)" if other is not None else ""
            raise InputError(
                f"{rank.file}: its model tensors differ from "
                f"{first.file.parent.name}'s{which}: the ranks are not one model"
            )
        for n in names:
            a, b = first.weights[n], rank.weights[n]
            refuse_if(a.shape != b.shape or a.dtype != b.dtype, rank.file,
                      f"{n} is {list(b.shape)} {b.dtype}, {list(a.shape)} {a.dtype} in "
                      f"{first.file.parent.name}: the ranks are not one model")
    if len(ranks) == 1:
        return names, dict.fromkeys(names)
    shapes = {n: tuple(t.shape) for n, t in first.weights.items()}
    hidden = hidden_size(first.args, shapes)
    return names, {n: split_axis(n, shapes[n], hidden, first.file) for n in names}


def _joined_state(
    ranks: list[_Rank], kinds: dict[str, int | None]
) -> list[tuple[dict, dict[str, dict]]]:
    """Each param group of the ranks' optimizer with its parameters' state by name, a split
    parameter's tensors joined as its weights are."""
    first = ranks[0]
    by_name = [{n: pid for pid, n in r.names.items()} for r in ranks]
    out = []
    for group in first.optimizer.param_groups:
        members = [first.names[p] for p in group["params"] if p in first.names]
        state = {}
        for name in members:
            entries = [r.optimizer.state.get(by_name[i].get(name)) for i, r in enumerate(ranks)]
            if any(e is None for e in entries):
                missing = ranks[next(i for i, e in enumerate(entries) if e is None)]
                raise InputError(
                    f"{missing.file}: holds no optimizer state for "
                    f"{name}, which {first.file.parent.name} has: the "
                    "ranks are not one checkpoint"
                )
            entry = {}
            for key, value in entries[0].items():
                if isinstance(value, StoredTensor):
                    shards = [e.get(key) for e in entries]
                    same = all(isinstance(s, StoredTensor) and s.shape == value.shape
                               for s in shards)
                    refuse_if(not same, ranks[-1].file,
                              f"its {key} of {name} differs in shape from mp_rank_00's")
                    read = [s.read() for s in shards]
                    whole = whole_shards(f"{name}.{key}", read, [r.file for r in ranks])
                    entry[key] = merged(f"{name}.{key}", whole, kinds[name])
                else:
                    entry[key] = value
            state[name] = entry
        out.append((group, state))
    return out
