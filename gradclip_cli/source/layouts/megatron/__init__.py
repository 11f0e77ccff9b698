"""Megatron ``torch_dist`` checkpoints: ``iter_NNNNNNN/``, or the save folder with its tracker.

Megatron-LM's ``save_checkpoint`` (``ckpt_format torch_dist``) writes
``<save>/iter_0000003/`` through Megatron-core's ``dist_checkpointing.save``
and then ``<save>/latest_checkpointed_iteration.txt``, the tracker naming the
newest iteration (or ``release``). An iteration folder holds:

* ``.metadata`` and ``__R_N.distcp``: a DCP folder (Megatron's planner keeps
  every rank's save plan in the metadata, ``all_local_plans``: inert records
  here) of the *sharded* tensors: the model's by Megatron's names, and the
  optimizer's moments as ``optimizer.state.exp_avg.<name>`` and
  ``optimizer.state.exp_avg_sq.<name>``;
* ``common.pt``: what is not sharded: ``iteration``, ``args`` (an
  ``argparse.Namespace``, read as inert data: ``files/megatron_pickle``), the
  optimizer's ``param_groups`` (hyperparameters; the parameters each group
  holds are not saved) and ``state.common_step``, the step of every moment;
* ``metadata.json``: ``{"sharded_backend": "torch_dist", ...}``.

In bf16 (or fp16) mixed precision (Megatron-LM's ``--bf16``:
``Float16OptimizerWithFloat16Params``) the model's tensors are bf16 and the optimizer keeps
an fp32 main param of each, the copy Adam updates, saved as
``optimizer.state.fp32_param.<name>``; ``common.pt`` then holds torch's optimizer state one
level down (``optimizer.optimizer.``). The fp32 main params are the weights measured, each
chunk checked, as it is read, to round to the model's chunk.

Transformer layers are stacked: ``decoder.layers.mlp.linear_fc1.weight`` is
one tensor of shape ``[num_layers, ...]``, each layer a chunk of its own
(``sharded_offsets`` prepended by the layer's global number). Each layer is
split off as a tensor of its own, ``decoder.layers.3.mlp.linear_fc1.weight``,
so the report's groups name the layer. A tensor under ``layers`` whose chunks
do not each hold one layer is refused: its layers cannot be told apart.

A Mixture of Experts (``num_moe_experts``; ``SequentialMLP``) saves each layer's router,
``decoder.layers.mlp.router.weight``, as a parameter like any (its aux-loss-free
``expert_bias`` is a buffer: never a weight), and its experts stacked once more:
``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is
``[num_layers, num_experts, ...]`` (per-layer keys, ``moe_layer_freq``, have the expert
axis first). Each expert of each layer is split off too, named by its global index as
Megatron's ``singleton_local_shards`` keys name it,
``decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight``: in its layer's group
(``--group-by regex:`` makes each expert a group); a chunk holding several experts is cut
at each. Under expert parallelism
``get_megatron_optimizer`` chains the dense parameters' optimizer and the experts'
(``ChainedOptimizer``; ``common.pt``'s ``optimizer`` is ``{0: ..., 1: ...}``): plain or
distributed ``fully_reshardable``, their state is per parameter by name, as one
optimizer's, and their steps must agree, as must lr, betas and eps; distributed
``dp_reshardable``, their buckets are under ``chained_0.`` and ``chained_1.``. A chain
saved otherwise is refused.

With Megatron's distributed optimizer, saved as Megatron-LM saves it by default
(``common.pt``'s ``optimizer.param_state_sharding_type`` ``dp_reshardable``), each
grad-buffer bucket is flat tensors under ``optimizer.distributed.``, the step in its param
groups there: each parameter's moments, and its ``param`` (the weights measured under
bf16), are cut out of them by Megatron's bucket layout (``distributed_optimizer``) and
checked against the model's tensors; with tensor or pipeline parallelism, each
model-parallel rank's buckets (``dp_group_idx_N``) hold its stage's shards.
Saved ``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``), the
state is per parameter again, in the model's shape and chunks,
``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>``, and the step is only in
``common.pt``'s ``optimizer.optimizer.param_groups``: read as the plain optimizer's, the
``param`` entries as its fp32 main params. Another sharding type is refused, saying so.

A tracker naming a legacy iteration (``iter_N/mp_rank_XX/model_optim_rng.pt``) hands it
to ``megatron.legacy``.

Recognised by content, before any flat-mapping rule: ``metadata.json`` with
``sharded_backend`` beside ``common.pt`` and ``.metadata``, or a folder
whose tracker names such a folder inside it (``megatron.tracker``).

The package holds Megatron's shared rules, one module each: ``tracker`` (the tracker and
the iteration folders), ``model`` (buffers, stacked layers and experts, parameter order,
the fp32 main params' check), ``distributed_optimizer`` (the bucket layout and its state,
in both formats), ``pipeline`` (the legacy format's stages) and ``facts`` (what a
checkpoint of either format holds, and the function that words each). ``open_dist_ckpt``
reads a ``torch_dist`` folder under the calling layout's kind and title, for a layout
built on Megatron's folders.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files.megatron_pickle import GLOBALS, NamespaceState
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import Contents, OptimizerState, Piece, StoredTensor
from gradclip_cli.source.untrusted import is_int
from gradclip_cli.source.vocabulary import step_after

from .. import dcp_folder
from .. import dcp_frameworks as frameworks
from ..draft import Draft
from ..paths import inside, read_json
from . import distributed_optimizer as distributed
from . import facts as said
from . import legacy
from .model import BUFFER, MOMENT, OPTIMIZER, SIXTEEN, checked, dtypes, refuse_if, split_layers
from .tracker import COMMON, JSON, TRACKER, is_dist_ckpt, iteration_folder

KIND = "megatron"
TITLE = "Megatron torch_dist checkpoint"
_MAIN = ("fp32_param", "param")  # the fp32 main params: the plain optimizer's, fully_reshardable's


def recognises(path: Path) -> bool:
    return os.path.isdir(path) and (os.path.isfile(path / TRACKER) or is_dist_ckpt(path))


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    frameworks.refuse_key(path, key, "a Megatron checkpoint")
    folder_path, tracker = iteration_folder(path)
    if legacy.is_legacy(folder_path):  # the tracker names a legacy iteration
        return legacy.open_iteration(
            path, folder_path, tracker, trust_pickle=trust_pickle, verify=verify
        ).finish()
    return open_dist_ckpt(
        path, folder_path, tracker, kind=KIND, title=TITLE,
        trust_pickle=trust_pickle, verify=verify,
    )


def open_dist_ckpt(
    path: Path, folder_path: Path, tracker: Path | None, *, kind: str, title: str,
    trust_pickle: bool, verify: bool,
) -> Contents:
    """The ``torch_dist`` folder ``folder_path`` (``tracker``: the file that named it, or
    None) opened as ``Contents`` of ``kind``, described as a ``title``: the calling layout's
    own, so a layout built on Megatron's folders (NeMo 2's ``weights/``) reads them here."""
    stated = read_json(
        inside(folder_path, JSON, named_by=folder_path), what="Megatron checkpoint metadata"
    )
    backend = stated.get("sharded_backend") if isinstance(stated, dict) else None
    refuse_if(backend != "torch_dist", folder_path / JSON,
              f"sharded_backend is {quoted(backend)[:40]}; gradclip reads torch_dist")
    folder = dcp_folder.read_folder(folder_path, verify=verify, trust_pickle=trust_pickle)
    common_file = inside(folder_path, COMMON, named_by=folder_path)
    with allowing(GLOBALS):
        common = load_checkpoint(common_file, trust_pickle=trust_pickle, verify=verify)
    root = common.root
    refuse_if(not isinstance(root, dict), common_file, "not Megatron's common state: not a dict")
    contents = Draft(
        path=path,
        kind=kind,
        files=[*([tracker] if tracker else []), folder_path / JSON, common_file, *folder.files],
        index=folder.metadata_file,
        folder=folder_path,
        trusted_pickle=folder.trusted or common.trusted_pickle,
    )
    split = split_layers(folder)
    weights = {n: t for k, parts in split.items() if not OPTIMIZER.match(k) for n, t in parts}
    buffers = {n: t for n, t in weights.items() if BUFFER.fullmatch(n)}
    weights = {n: t for n, t in weights.items() if n not in buffers}
    contents.weights = weights or None
    contents.buffers = buffers or None
    optimizer, found = _optimizer(split, root, common_file)
    mains = _fp32_params(folder, split, weights, optimizer)
    sharding = distributed.sharding_of(folder, root) if optimizer is None else None
    chain = distributed.chained_count(folder) if optimizer is None else 0
    if chain or sharding == repr("dp_reshardable"):
        optimizer, buckets, mains = (
            distributed.chained_bucketed(folder, split, weights, root, common_file) if chain
            else distributed.bucketed(folder, split, weights)
        )
        found.update(state=said.BUCKETS, chained=len(buckets) if chain else 0, buckets=buckets)
    elif sharding is not None:
        sixteen = [n for n, t in weights.items() if t.dtype in SIXTEEN]
        found.update(state=said.UNREAD, unread=visible(sharding), sixteen=dtypes(weights, sixteen))
    # Only a 16-bit model's tensors differ from their fp32 main params (the buckets' param
    # is every parameter's fp32 copy).
    mains = {n: t for n, t in mains.items() if weights[n].dtype in SIXTEEN}
    if mains:
        contents.weights = {n: mains.get(n, t) for n, t in weights.items()}
    if optimizer is not None:
        contents.optimizers.append(optimizer)
    contents.step = _iteration(root, common_file, folder_path)
    facts = said.DistCkptFacts(
        path=path,
        title=title,
        folder=folder_path.name,
        tracked=tracker is not None,
        step=contents.step,
        tensors=len(weights),
        layers=len({n.split(".layers.")[1].split(".")[0] for n in weights if ".layers." in n}),
        parameters=len(optimizer.state) if optimizer is not None else 0,
        mains=len(mains),
        main_dtypes=dtypes(weights, mains),
        **found,
    )
    words = said.wording(facts)
    contents.say(words)
    return contents.finish()


def _optimizer(split, root: dict, common_file: Path) -> tuple[OptimizerState | None, dict]:
    """The optimizer state saved per parameter (``optimizer.state.*``), and the facts of
    where it was read from (``_chained``); None and ``facts.NONE`` where there is none."""
    moments: dict[str, dict] = {}
    for key, parts in split.items():
        found = MOMENT.fullmatch(key)
        if not found or found.group(1) in _MAIN:
            continue
        for name, tensor in parts:
            moments.setdefault(name, {})[found.group(1)] = dcp_folder.renamed(
                tensor, f"{name}.{found.group(1)}"
            )
    if not moments:
        return None, {"state": said.NONE}
    groups: list[dict] = []
    steps = []
    chain, found = _chained(root.get("optimizer"), common_file)
    for where, optim in chain:
        mine, step = _groups_and_step(optim, where, common_file)
        groups += mine
        steps.append(step)
    # Each step shown as a plain number (``common_step`` is a 0-dim tensor).
    shown = [repr(s.item() if isinstance(s, torch.Tensor) and s.numel() == 1 else s) for s in steps]
    refuse_if(len(set(shown)) != 1, common_file,
              f"the chained optimizers' steps differ ({', '.join(shown)}), "
              "and Megatron does not save which parameters each holds")
    step = steps[0]
    # The groups' members are not saved (Megatron drops their ``params``); only lr, betas and
    # eps enter the measured quantities, so any number of groups that agree on them is one.
    refuse_if(not distributed.one_setting(groups, ("lr", "betas", "eps")), common_file,
              f"the optimizer's {len(groups)} param groups differ in lr, betas or eps, and "
              "Megatron does not save which parameters each holds")
    names = list(moments)
    group = {
        **{k: v for k, v in groups[0].items() if k not in ("params", "step")},
        "params": list(range(len(names))),
    }
    return OptimizerState(
        [group],
        {i: {**moments[n], "step": step} for i, n in enumerate(names)},
        dict(enumerate(names)),
        common_file,
    ), found


def _chained(optim, common_file: Path) -> tuple[list[tuple[str, object]], dict]:
    """The optimizers of ``common.pt``'s ``optimizer``, each with where it is: the one, or a
    ``ChainedOptimizer``'s (``{0: ..., 1: ...}`` under expert parallelism), each plain or
    ``fully_reshardable``; and the facts of their state: ``facts.FULLY`` (with the chain's
    length, 0 for one optimizer) where every one says ``fully_reshardable``."""
    if isinstance(optim, list) and len(optim) == 1:
        # Lightning's list of its optimizers' states, as NeMo 2's MegatronCheckpointIO saves
        # common.pt (one MegatronOptimizerModule: one optimizer)
        return [("optimizer.0", optim[0])], {"state": said.PER_PARAMETER}
    chain = isinstance(optim, dict) and optim and all(is_int(k) for k in optim)
    kinds = [p.get("param_state_sharding_type") if isinstance(p, dict) else None
             for p in (optim.values() if chain else [optim])]
    found = {"state": said.PER_PARAMETER}
    if all(k == said.FULLY for k in kinds):
        found = {"state": said.FULLY, "chained": len(optim) if chain else 0}
    if not chain:
        return [("optimizer", optim)], found
    refuse_if(sorted(optim) != list(range(len(optim))), common_file,
              f"the chained optimizers are numbered {sorted(optim)[:8]}, not 0, 1, ...")
    refuse_if(any(k != kinds[0] for k in kinds) or kinds[0] not in (None, said.FULLY), common_file,
              f"the chained optimizers are saved as {quoted(kinds)[:80]} beside moments "
              "per parameter (optimizer.state.*); gradclip reads them plain or each "
              "fully_reshardable")
    return [(f"optimizer.{k}", optim[k]) for k in range(len(optim))], found


def _groups_and_step(optim, where: str, common_file: Path) -> tuple[list, object]:
    """One optimizer's param groups and the step of its moments, from ``common.pt``."""
    fully = isinstance(optim, dict) and optim.get("param_state_sharding_type") == said.FULLY
    if isinstance(optim, dict) and "param_groups" not in optim and "optimizer" in optim:
        # Mixed precision (Float16OptimizerWithFloat16Params.state_dict): torch's state dict
        # one level down, beside the fp32 main params (in .metadata: fp32_param entries)
        optim, where = optim["optimizer"], f"{where}.optimizer"
    state = optim.get("state") if isinstance(optim, dict) else None
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    bad = not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups)
    refuse_if(bad, common_file, f"holds no {where}.param_groups (the moments' betas, lr and eps)")
    if fully:  # the distributed optimizer's param groups hold the step, saved as they are
        step = distributed.one_step(groups)
        refuse_if(step is None, common_file, f"the distributed optimizer's {where}.param_groups "
                  "give no one step (fully_reshardable keeps the moments' step there)")
        return groups, step
    if not isinstance(state, dict) or "common_step" not in state:
        raise InputError(f"{common_file}: holds no {where}.state.common_step (the moments' step)")
    return groups, state["common_step"]


def _fp32_params(folder, split, weights: dict[str, StoredTensor],
                 optimizer: OptimizerState | None) -> dict[str, StoredTensor]:
    """The optimizer's fp32 main params by model name, where it saves them per parameter
    (``optimizer.state.fp32_param.<key>``, or ``fully_reshardable``'s
    ``optimizer.state.param.<key>``) chunked as the model's tensor is; ``{}`` for none. Each
    chunk, when read, must round to the model's (``refuse_unrounded``); a 16-bit parameter
    with moments in ``optimizer`` but no fp32 copy, where others have one, is refused too."""
    where = folder.metadata_file
    out: dict[str, StoredTensor] = {}
    moments = set(optimizer.param_names.values()) if optimizer is not None else set()
    kinds: set[str] = set()
    for key, parts in split.items():
        found = MOMENT.fullmatch(key)
        if not found or found.group(1) not in _MAIN:
            continue
        kind = f"optimizer.state.{found.group(1)}"
        kinds.add(kind)
        for name, main in parts:
            model = weights.get(name)
            refuse_if(model is None, where, f"holds {quoted(key)[:120]}, the fp32 main "
                      f"param of {name}, which the model does not hold")
            chunks = [sorted((p.offsets, p.shape) for p in t.pieces) for t in (main, model)]
            fp32 = main.dtype == torch.float32 and main.shape == model.shape
            refuse_if(not fp32 or chunks[0] != chunks[1], where,
                      f"{quoted(key)[:120]} is not an fp32 tensor chunked as the model's "
                      f"{name} ({model.dtype}, shape {list(model.shape)}): not its "
                      "fp32 main param")
            by_place = {(p.offsets, p.shape): p for p in model.pieces}
            pieces = [
                Piece(p.offsets, p.shape, checked(name, kind, p, by_place[(p.offsets, p.shape)]),
                      p.file)
                for p in main.pieces
            ]
            out[name] = StoredTensor(name, main.shape, torch.float32, pieces)
    refuse_if(len(kinds) > 1, where, f"holds both {' and '.join(sorted(kinds))} entries")
    # In the model's order, so the parameter named is the same on every run.
    missing = [n for n in weights if n in moments and n not in out and weights[n].dtype in SIXTEEN]
    if out and missing:
        raise InputError(
            f"{where}: holds no {kinds.pop()} of {missing[0]} "
            f"({weights[missing[0]].dtype}, with moments), where the other 16-bit parameters "
            "have their fp32 main params: the mixed-precision state is incomplete"
        )
    return out


def _iteration(root: dict, common_file: Path, folder: Path) -> int | None:
    value = root.get("iteration")
    if value is None:  # Lightning's optimizer steps, as NeMo 2's common.pt holds them
        value = root.get("global_step")
    if value is None:
        args = root.get("args")
        value = args.state.get("iteration") if isinstance(args, NamespaceState) else None
    if value is None:
        return step_after(folder.name, "iter_")
    return frameworks.int_value(value, common_file, "iteration")
