"""DeepSpeed ZeRO checkpoints: a ``global_stepN/`` folder, or its parent with ``latest``.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag, a folder
name) and ``dir/<tag>/`` holding, for model-parallel rank ``mp_rank_00`` (the only
one without model parallelism):

* ``mp_rank_00_model_states.pt`` (ZeRO 1 and 2) or one
  ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per data-parallel rank
  (ZeRO 3): the module's state dict (full for 1 and 2, empty placeholders
  for 3), ``param_shapes`` (per param group, ``{name: torch.Size}`` in the
  order the parameters were flattened), ``global_steps``, ``dp_world_size``;
* ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank ``R``: the rank's
  partition of every group's flat fp32 master weights and the wrapped
  optimizer's ``state_dict()`` over those flat partitions (so ``exp_avg``
  and ``exp_avg_sq`` are flat partitions of the same layout).

How a flat partition maps back to parameters is DeepSpeed's
``utils/zero_to_fp32.py`` (``_zero2_merge_trainable_params``,
``_zero3_merge_trainable_params``), followed here exactly:

* ZeRO 1/2: per group, the ranks' partitions end to end form one flat
  vector; parameters follow in ``param_shapes`` order, each ``numel`` long,
  plus ``param_alignment_paddings`` when stored; the total, aligned to
  ``2 * world_size``, must equal the vector's, aligned alike. A parameter
  may start in one rank's partition and end in the next one's.
* ZeRO 3: every parameter is cut into ``world_size`` parts of
  ``ceil(numel / world_size)``; rank ``R`` keeps part ``R`` (zero padded) in
  its flat buffer (its groups end to end), parameters in ``param_shapes``
  order; ``offset * world_size`` must equal the buffers' total.

Each parameter becomes a ``StoredTensor`` whose pieces are its ranges in the
rank files (flat ranges when it spans ranks: ``StoredTensor(flat=True)``),
read from the memory-mapped files on demand: nothing is gathered, memory stays
bounded by the largest partition. The weights reported are these fp32
master weights; the optimizer state names each parameter (``param_names``).

The Hugging Face Trainer run with DeepSpeed writes the same ``latest`` and
``global_stepN/`` inside its ``checkpoint-N/`` (beside the model weights and
``trainer_state.json``, without ``optimizer.pt``): this layout comes first in
``LAYOUTS`` so that such a folder is read here, where the moments are. The
step reported is then the Trainer's ``global_step`` (``trainer_state.json``,
checked against the folder's name as ``hf_trainer`` does), DeepSpeed's own
count noted when it differs.

Frozen parameters (``requires_grad=False``) have weights and no optimizer
state: ZeRO 2 and 3 save them apart (``frozen_param_shapes``,
``frozen_param_fragments``; see ``zero.frozen_parameters``), ZeRO 1 only in its whole
module state dict. They are measured by ``--what weights`` and absent from the
moments, which the description says.

Model parallelism (``deepspeed.initialize(mpu=...)``, as Megatron-DeepSpeed runs
tensor parallelism): each model-parallel rank ``XX`` writes the same files with
``mp_rank_XX``, its own ZeRO checkpoint of its shards under the model's names, and
says how many ranks there are (``mp_world_size``, ``checkpoint_parallel_dimensions``,
Megatron's ``args`` in the client state). Each rank is read as above; the ranks must
be ``mp_rank_00`` on without a gap and agree on those counts, the ZeRO layout, the
step and every parameter's name and shape. A split parameter is then its shards side
by side and a replicated one counts once, from ``mp_rank_00``, decided from Megatron's
layer names as Megatron legacy checkpoints are (``layouts/tensor_parallel.py``); a name the rule
cannot place is refused, naming ``mp_rank_00``'s model state file. Without ZeRO each
rank's one ``mp_rank_XX_model_states.pt`` is read as a single rank's is, then joined
alike (``plain.read_ranks``).

Pipeline parallelism (``deepspeed.pipe.PipelineModule``) saves each layer's state dict as
``layer_II-model_states.pt`` (``II`` its global index, which names it: ``II.weight``)
beside one ``mp_rank_XX`` per stage. Under ZeRO the stages are read from their optimizer
files (``model_parallel.check_pipeline_ranks``); without ZeRO the weights are the layer files'
and the moments each stage's ``optimizer`` (``pipeline.read``). With tensor parallelism as well
(``checkpoint_parallel_dimensions``: ``pp_degree`` x ``tp_degree``, as many as the
``mp_rank_XX``), DeepSpeed's topology numbers the ranks stage by stage: ``mp_rank_XX`` is
stage ``XX // tp_degree``'s tensor-parallel rank ``XX % tp_degree``, and layer ``II``'s
shards of tensor-parallel rank ``TT`` are ``layer_II-model_TT-model_states.pt``. Each
tensor-parallel rank's stages are joined as above, then the ranks as tensor-parallel ranks
are: a split parameter its shards side by side, a replicated one once, from its stage's
tensor-parallel rank 0 (``model_parallel.tensor_parallel``). DeepSpeed's pipeline engine
takes ZeRO 1 at most.

One rank's file of a ZeRO folder given alone (an optimizer file, a ZeRO 3 model state
file, a model-parallel rank's or pipeline stage's ``mp_rank_XX_model_states.pt``) is
refused, naming the folder: it holds the parameters only with the others
(``rank_file_alone``). ZeRO 1/2's one ``mp_rank_00_model_states.pt`` holds the whole
module and is read as a file. The same file away from its folder (copied out, renamed) is
recognised by what it holds and refused alike (``rank_content_alone``).

Every file goes through the restricted reader, with DeepSpeed's own pickled
classes mapped to inert stand-ins (``files/deepspeed_pickle.py``), and the
``argparse.Namespace`` (and numpy RNG state) of Megatron's client state read as
Megatron's checkpoints are (``files/megatron_pickle.py``); DeepSpeed is never
imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.interface import Contents
from gradclip_cli.source.untrusted import is_int

from .. import hf_trainer
from ..dcp_frameworks import refuse_key
from ..torch_optim import is_optimizer_state
from . import pipeline, plain, zero
from .facts import PIPELINE, PLAIN, ZERO, worded
from .reader import (
    LAYER_STATES,
    MODEL_STATES,
    OPTIM_STATES,
    PLAIN_STATES,
    Reader,
    follow_latest,
    mp_name,
    recognises_folder,
)

KIND = "deepspeed"
LATEST = "latest"
_HOLDS = (
    "DeepSpeed rank files (mp_rank_XX_model_states.pt, with ZeRO's optimizer files beside it "
    "under ZeRO)"
)


def _folder_kind(path: Path) -> str | None:
    """``ZERO`` (model state and ZeRO optimizer rank files), ``PLAIN`` (without ZeRO:
    ``mp_rank_XX_model_states.pt`` and no ZeRO rank file at all), ``PIPELINE`` (``PLAIN``
    beside layer files), else None."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    plain_states = any(PLAIN_STATES.fullmatch(n) for n in names)
    zero3 = any(MODEL_STATES.fullmatch(n) and not PLAIN_STATES.fullmatch(n) for n in names)
    if any(OPTIM_STATES.fullmatch(n) for n in names):
        return ZERO if plain_states or zero3 else None
    if not plain_states or zero3:
        return None
    return PIPELINE if any(LAYER_STATES.fullmatch(n) for n in names) else PLAIN


def _is_step_folder(path: Path) -> bool:
    return _folder_kind(path) is not None


def recognises(path: Path) -> bool:
    """A folder of rank files, or one holding ``latest`` beside such a folder; or, without
    ZeRO, the one model state file of such a folder."""
    if PLAIN_STATES.fullmatch(path.name) and os.path.isfile(path):
        return _folder_kind(path.parent) in (PLAIN, PIPELINE)
    return recognises_folder(path, LATEST, _is_step_folder)


def near_miss(path: Path) -> str | None:
    """Why a folder that bears DeepSpeed's marks (``latest``, rank files) and that no layout
    recognises is not a DeepSpeed checkpoint: one line naming what is missing, instead of
    the list of every kind a folder could be; None for a folder without such marks."""
    try:
        if os.path.isfile(path / LATEST):
            follow_latest(path, LATEST, _is_step_folder, _HOLDS)
            return None
        names = os.listdir(path)
    except InputError as error:
        return str(error)
    except OSError:
        return None
    marked = sorted(
        n
        for n in names
        if MODEL_STATES.fullmatch(n) or OPTIM_STATES.fullmatch(n) or LAYER_STATES.fullmatch(n)
    )
    if not marked:
        return None
    return (
        f"{path}: holds DeepSpeed's {marked[0]}, but not a checkpoint's set of "
        "rank files (mp_rank_XX_model_states.pt, or ZeRO's model state files beside "
        "zero_pp_rank_R_mp_rank_XX_optim_states.pt)"
    )


def rank_file_alone(path: Path) -> str | None:
    """Why one rank's file of a DeepSpeed ZeRO step folder given alone cannot be measured:
    an optimizer file holds one rank's slice of the flat partitions, a ZeRO 3 model state
    file empty placeholders for the weights, a pipeline stage's file no module (its layers
    are the layer files, each read alone as its weights), a model-parallel rank's file that
    rank's shards; only the folder's files read together give the parameters. None for any
    other file, and for ZeRO 1/2's one ``mp_rank_00_model_states.pt``, which holds the whole
    module (without ZeRO such a file is read as its folder: ``recognises``)."""
    name = path.name
    if not (OPTIM_STATES.fullmatch(name) or MODEL_STATES.fullmatch(name)) \
            or not os.path.isfile(path):
        return None
    folder = path.parent
    kind = _folder_kind(folder)
    if kind != ZERO or (PLAIN_STATES.fullmatch(name) and _whole_module(folder)):
        return None
    return (f"{path}: one of the files of the DeepSpeed checkpoint {folder}, which hold the "
            "weights and optimizer state only together (split over its ranks or stages); "
            f"give the folder: {folder}")


def rank_content_alone(path: Path, root: object) -> str | None:
    """Why a file that holds one rank's part of a DeepSpeed checkpoint, given away from its
    folder's other files (copied out, renamed), cannot be measured: recognised by what it
    holds (``ds_version`` beside an optimizer partition, ZeRO 3's placeholders for the
    weights, or ``mp_world_size`` above 1), as ``rank_file_alone`` recognises it by its
    name and its folder. None for any other content, and for a file that holds the whole
    module (ZeRO 1/2's, or one rank's without ZeRO)."""
    if not isinstance(root, Mapping) or not isinstance(root.get("ds_version"), str):
        return None
    holds = None
    optimizer = root.get("optimizer_state_dict")
    module, shapes = root.get("module"), root.get("param_shapes")
    ranks = root.get("mp_world_size")
    if isinstance(optimizer, Mapping) and any(k in optimizer for k in _PARTITION_KEYS):
        holds = "one rank's ZeRO optimizer partition"
    elif is_int(ranks) and ranks > 1:
        holds = f"one of {ranks} model-parallel ranks' shards, by its mp_world_size"
    elif isinstance(module, Mapping) and isinstance(shapes, list) and any(
            isinstance(group, Mapping) and name in module
            and getattr(module[name], "shape", shape) != shape
            for group in shapes for name, shape in group.items()):
        holds = "ZeRO 3's empty placeholders for the weights"
    if holds is None:
        return None
    return (f"{path}: one rank's file of a DeepSpeed checkpoint, holding {holds}: the "
            "weights and optimizer state are only in its folder's rank files together; give "
            "that folder (global_stepN/)")


def optimizer_alone(root: object) -> str | None:
    """Why the optimizer state in DeepSpeed's model state file saved without ZeRO under
    fp16/bf16, read as a file away from its folder (renamed), is not measured: what its
    ``optimizer`` holds (a wrapper around torch's state dict, which only the folder's reader
    reads: ``plain.plain_optimizer``), and where the unfused one is read. None for any other
    content."""
    if not isinstance(root, Mapping) or not isinstance(root.get("ds_version"), str):
        return None
    value = root.get("optimizer")
    if not isinstance(value, Mapping) or not is_optimizer_state(value.get("optimizer_state_dict")):
        return None
    if "fp32_groups_flat" in value:
        return ("its 'optimizer' is DeepSpeed's fused FP16_Optimizer state (the moments in "
                "optimizer_state_dict, the fp32 master weights in fp32_groups_flat, one flat "
                "buffer per param group), which gradclip does not read")
    return ("its 'optimizer' is DeepSpeed's fp16/bf16 FP16_UnfusedOptimizer state (the "
            "moments in optimizer_state_dict, the fp32 master weights in fp32_groups), which "
            "gradclip reads in a DeepSpeed checkpoint only: give the file as "
            f"{mp_name(0)}_model_states.pt in a folder of its own")


# What a ZeRO optimizer rank file's ``optimizer_state_dict`` holds beside the wrapped
# optimizer's state: its rank's slice of the flat partitions (stages 1/2, and 3).
_PARTITION_KEYS = ("zero_stage", "partition_count", "single_partition_of_fp32_groups",
                   "fp32_flat_groups")


def _whole_module(folder: Path) -> bool:
    """Whether the folder's one ``mp_rank_XX_model_states.pt`` holds the whole module: one
    model-parallel rank, no pipeline layer files."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return (sum(1 for n in names if PLAIN_STATES.fullmatch(n)) == 1
            and not any(LAYER_STATES.fullmatch(n) for n in names))


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "a DeepSpeed checkpoint")
    folder, named_by = path, ""
    if os.path.isfile(path):
        folder = path.parent
    elif not _is_step_folder(path):
        folder, named_by = follow_latest(path, LATEST, _is_step_folder, _HOLDS), LATEST
    reader = Reader(folder, trust_pickle=trust_pickle, verify=verify)
    kind = _folder_kind(folder)
    read = zero.read if kind == ZERO else pipeline.read if kind == PIPELINE else plain.read
    contents, facts = read(reader, path, KIND)
    # A Hugging Face Trainer's checkpoint-N/ around the DeepSpeed folder: its global_step
    # (trainer_state.json, checked against the folder's name) is the checkpoint's step.
    trainer = hf_trainer.global_step(path) if folder != path else None
    return worded(contents, replace(facts, named_by=named_by, trainer_step=trainer))
