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
``frozen_param_fragments``; see ``_Reader.frozen``), ZeRO 1 only in its whole
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
layer names as Megatron legacy checkpoints are (``tensor_parallel``); a name the rule
cannot place is refused, naming ``mp_rank_00``'s model state file. Without ZeRO each
rank's one ``mp_rank_XX_model_states.pt`` is read as a single rank's is, then joined
alike (``_Reader.plain_ranks``).

Pipeline parallelism (``deepspeed.pipe.PipelineModule``) saves each layer's state dict as
``layer_II-model_states.pt`` (``II`` its global index, which names it: ``II.weight``)
beside one ``mp_rank_XX`` per stage. Under ZeRO the stages are read from their optimizer
files (``_check_stages``); without ZeRO the weights are the layer files' and the moments
each stage's ``optimizer`` (``_Reader.pipeline``). With tensor parallelism as well
(``checkpoint_parallel_dimensions``: ``pp_degree`` x ``tp_degree``, as many as the
``mp_rank_XX``), DeepSpeed's topology numbers the ranks stage by stage: ``mp_rank_XX`` is
stage ``XX // tp_degree``'s tensor-parallel rank ``XX % tp_degree``, and layer ``II``'s
shards of tensor-parallel rank ``TT`` are ``layer_II-model_TT-model_states.pt``. Each
tensor-parallel rank's stages are joined as above, then the ranks as tensor-parallel ranks
are: a split parameter its shards side by side, a replicated one once, from its stage's
tensor-parallel rank 0 (``_tensor_parallel``). DeepSpeed's pipeline engine takes ZeRO 1
at most.

Every file goes through the restricted reader, with DeepSpeed's own pickled
classes mapped to inert stand-ins (``files/deepspeed_pickle.py``), and the
``argparse.Namespace`` (and numpy RNG state) of Megatron's client state read as
Megatron's checkpoints are (``files/megatron_pickle.py``); DeepSpeed is never
imported.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files import megatron_pickle
from gradclip_cli.source.files.deepspeed_pickle import GLOBALS
from gradclip_cli.source.files.megatron_pickle import NamespaceState
from gradclip_cli.source.files.small_file import excerpt
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import (
    Checkpoint,
    Contents,
    OptimizerState,
    Piece,
    StoredTensor,
    chained,
)
from gradclip_cli.source.untrusted import is_count, is_int, is_number
from gradclip_cli.source.what import map_names

from . import hf_trainer
from .dcp_frameworks import refuse_key
from .master_copy import head_key, rounds_to
from .paths import inside, tagged_folder
from .tensor_parallel import hidden_size, merged, split_axis
from .torch_optim import is_optimizer_state, optimizer_state

KIND = "deepspeed"
LATEST = "latest"
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
# bf16 mixed precision (DeepSpeed's BF16_Optimizer) names its rank files bf16_zero_pp_rank_*,
# with the same content.
_OPTIM = re.compile(r"(?:(bf16_))?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
# Without ZeRO (stage 0) a model-parallel rank's one file holds the module and the optimizer.
_PLAIN = re.compile(r"mp_rank_(\d+)_model_states\.pt")
# Pipeline parallelism (deepspeed.pipe.PipelineModule) saves each layer's weights apart.
_PIPELINE_LAYER = re.compile(r"layer_\d+(?:-model_\d+)?-model_states\.pt")
# Its layer index (global, as the module names the layer) and the tensor-parallel rank
# (``-model_XX``, DeepSpeed's topology's rank name) where there is one.
_LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
# Megatron-DeepSpeed passes Megatron's client state (``args``, an ``argparse.Namespace``;
# numpy RNG state) to ``save_checkpoint``, which keeps it in the model state files: read as
# inert data, as Megatron's own checkpoints are.
_PICKLED = {**megatron_pickle.GLOBALS, **GLOBALS}
_MAX_RANKS = 1 << 16


# --------------------------------------------------------------------- recognition


ZERO, PLAIN = "zero", "plain"


def _folder_kind(names) -> str | None:
    """``ZERO`` (model state and ZeRO optimizer rank files), ``PLAIN`` (without ZeRO:
    ``mp_rank_XX_model_states.pt`` and no ZeRO rank file at all), else None."""
    names = list(names)
    plain = any(_PLAIN.fullmatch(n) for n in names)
    zero_model = any(_MODEL.fullmatch(n) and not _PLAIN.fullmatch(n) for n in names)  # ZeRO 3
    if any(_OPTIM.fullmatch(n) for n in names):
        return ZERO if plain or zero_model else None
    return PLAIN if plain and not zero_model else None


def _kind_of(path: Path) -> str | None:
    try:
        return _folder_kind(os.listdir(path))
    except OSError:
        return None


def _is_step_folder(path: Path) -> bool:
    return _kind_of(path) is not None


def recognises(path: Path) -> bool:
    """A folder of rank files, or one holding ``latest`` beside such a folder; or, without
    ZeRO, the one model state file of such a folder."""
    if _PLAIN.fullmatch(path.name) and os.path.isfile(path):
        return _kind_of(path.parent) == PLAIN
    if not os.path.isdir(path):
        return False
    if _is_step_folder(path):
        return True
    try:
        if not os.path.isfile(path / LATEST):
            return False
        with os.scandir(path) as entries:
            return any(e.is_dir() and _is_step_folder(Path(e.path)) for e in entries)
    except OSError:
        return False


def near_miss(path: Path) -> str | None:
    """Why a folder that bears DeepSpeed's marks (``latest``, rank files) and that no layout
    recognises is not a DeepSpeed checkpoint: one line naming what is missing, instead of
    the list of every kind a folder could be; None for a folder without such marks."""
    try:
        if os.path.isfile(path / LATEST):
            _follow_latest(path)
            return None
        names = os.listdir(path)
    except InputError as error:
        return str(error)
    except OSError:
        return None
    marked = sorted(
        n
        for n in names
        if _MODEL.fullmatch(n) or _OPTIM.fullmatch(n) or _PIPELINE_LAYER.fullmatch(n)
    )
    if not marked:
        return None
    return (
        f"{path}: holds DeepSpeed's {visible(marked[0])}, but not a checkpoint's set of "
        "rank files (mp_rank_XX_model_states.pt, or ZeRO's model state files beside "
        "zero_pp_rank_R_mp_rank_XX_optim_states.pt)"
    )


# --------------------------------------------------------------------- opening


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    refuse_key(path, key, "a DeepSpeed checkpoint")
    tag_note = ""
    folder = path
    if os.path.isfile(path):
        folder = path.parent
    elif not _is_step_folder(path):
        folder = _follow_latest(path)
        tag_note = f" (named by {LATEST})"
    reader = _Reader(folder, trust_pickle=trust_pickle, verify=verify)
    if _kind_of(folder) == PLAIN and _layer_files(folder):
        contents = reader.pipeline(path)
    elif _kind_of(folder) == PLAIN:
        contents = reader.plain(path)
    else:
        contents = reader.contents(path)
    contents.description[0] += tag_note
    if folder != path:
        _trainer_step(contents, path)
    return contents


def _trainer_step(contents: Contents, path: Path) -> None:
    """A Hugging Face Trainer's ``checkpoint-N/`` around the DeepSpeed folder: its
    ``global_step`` (``trainer_state.json``, checked against the folder's name) is the
    checkpoint's step, as for a Trainer checkpoint without DeepSpeed."""
    step = hf_trainer.global_step(path)
    if step is None:
        return
    contents.description.insert(
        0,
        f"Hugging Face Trainer checkpoint at global_step {step} ({hf_trainer.STATE}), "
        "with DeepSpeed",
    )
    if contents.step is not None and contents.step != step:
        contents.description.append(
            f"DeepSpeed counts {contents.step} steps (global_steps), the Trainer {step}: "
            "the Trainer's global_step is the step reported"
        )
    contents.step = step


def _follow_latest(parent: Path) -> Path:
    """The folder ``parent/latest`` names; its content is data, checked like any name."""
    latest = parent / LATEST
    tag, folder = tagged_folder(parent, LATEST)
    if not os.path.isdir(folder):
        raise InputError(f"{latest}: names {excerpt(tag)}, which is not a folder here")
    if not _is_step_folder(folder):
        raise InputError(
            f"{latest}: names {excerpt(tag)}, which holds no DeepSpeed rank files "
            "(mp_rank_XX_model_states.pt, with ZeRO's optimizer files beside it under ZeRO)"
        )
    return folder


class _Reader:
    """One ``global_stepN/`` folder: its files, loaded (mapped) and checked."""

    def __init__(self, folder: Path, *, trust_pickle: bool, verify: bool):
        self.folder = folder
        self.trust_pickle = trust_pickle
        self.verify = verify
        self.files: list[Path] = []
        self.trusted = False

    def load(self, name: str) -> Checkpoint:
        file = inside(self.folder, name, named_by=self.folder)
        if not os.path.exists(file):
            raise InputError(f"{file}: missing (the checkpoint's other files expect it)")
        with allowing(_PICKLED):
            ckpt = load_checkpoint(file, trust_pickle=self.trust_pickle, verify=self.verify)
        if not isinstance(ckpt.root, Mapping):
            raise InputError(f"{file}: not a DeepSpeed state file: not a dict")
        self.files.append(file)
        self.trusted |= ckpt.trusted_pickle
        return ckpt

    def header(self, contents: Contents, root: Mapping, given: Path, kind: str) -> str:
        """The step (``global_steps``), the gradients' refusal and the first line of the
        description, ``kind`` at the step in this folder; returns the version note."""
        step = root.get("global_steps")
        if is_count(step):
            contents.step = step
        contents.gradient_error = f"{given}: a DeepSpeed checkpoint holds no gradients"
        at = f" at global step {contents.step}" if contents.step is not None else ""
        contents.description.append(f"{kind}{at}: {visible(self.folder.name)}/")
        version = root.get("ds_version")
        return f", DeepSpeed {visible(version)}" if isinstance(version, str) else ""

    def contents(self, given: Path) -> Contents:
        names = os.listdir(self.folder)
        found = [m for n in names if (m := _MODEL.fullmatch(n) or _OPTIM.fullmatch(n))]
        mp_ranks = sorted({int(m.group(m.lastindex)) for m in found})
        optim = [m for n in names if (m := _OPTIM.fullmatch(n))]
        prefixes = sorted({m.group(1) or "" for m in optim})
        if len(prefixes) > 1:
            raise InputError(
                f"{self.folder}: holds both bf16_zero_pp_rank_* and zero_pp_rank_* "
                "optimizer files; which set belongs to this checkpoint is unclear"
            )
        if (missing := _gap(mp_ranks)) is not None:
            raise InputError(
                f"{self.folder}: holds model-parallel ranks "
                f"{', '.join(_mp(r) for r in mp_ranks)} but no {_mp(missing)}: "
                "the model-parallel ranks are incomplete"
            )
        parts = [self.part(mp, prefixes[0]) for mp in mp_ranks]
        first = parts[0]
        pipeline = any(_PIPELINE_LAYER.fullmatch(n) for n in names)
        stages, tp = _check_model_parallel(parts, self.folder, pipeline)
        contents = Contents(
            path=given, kind=KIND, files=list(self.files), trusted_pickle=self.trusted
        )
        split = 0
        if len(parts) == 1:
            weights, optimizer = first.weights, first.optimizer
        elif stages > 1 and tp == 1:
            joined = _pipeline_stages(parts)
            weights, optimizer = joined.weights, joined.optimizer
        elif stages > 1:
            # Each tensor-parallel rank's stages joined, then the ranks as without stages.
            ranks = [_pipeline_stages(parts[t::tp]) for t in range(tp)]
            _check_alike(ranks)
            # A name is in its stage's param_shapes (tensor-parallel rank 0's named).
            where = {n: p.model.path for p in parts[::tp] for n in p.weights}
            weights, optimizer, split = _tensor_parallel(ranks, where)
        else:
            weights, optimizer, split = _tensor_parallel(parts)
        # param_shapes lists parameters group by group; the module's state dict
        # (placeholders under ZeRO 3) keeps the model's order, which the report follows.
        module = first.model.root.get("module")
        order = [k for k in module if k in weights] if isinstance(module, Mapping) else []
        if len(order) == len(weights):
            weights = {n: weights[n] for n in order}
            contents.model_order_names = order
        else:
            contents.model_order = False
        contents.weights = weights
        contents.optimizers = [optimizer]
        models = _span([p.model.path.name for p in parts])
        held = _span([p.held for p in parts])
        ranks_of = _ranks_of(stages, tp)
        ranks = f" of {ranks_of}" if len(parts) > 1 else ""
        contents.evidence[roles.WEIGHT] = (
            f"a DeepSpeed checkpoint{ranks}: {models}, fp32 master weights in {held}"
        )
        contents.evidence[roles.OPTIMIZER_STATE] = f"a DeepSpeed checkpoint{ranks}: {held}"
        version = self.header(
            contents, first.model.root, given, f"DeepSpeed ZeRO stage {first.stage} checkpoint"
        )
        mp = f"{ranks_of} ({_span([_mp(r) for r in mp_ranks])}) x " if len(parts) > 1 else ""
        # Each stage's parameters once (from its tensor-parallel rank 0).
        trainable = sum(len(p.trainable) for p in parts[::tp]) if stages > 1 else len(
            first.trainable
        )
        contents.description.append(
            f"{mp}{first.world} data-parallel rank(s){version}: fp32 master weights and Adam "
            f"moments of {trainable} parameters"
        )
        if pipeline and not isinstance(module, Mapping) and first.stage <= 1:
            # ZeRO 1 records frozen parameters only in the module's state dict, which a
            # PipelineModule saves in its layer files instead.
            contents.description.append(
                "a PipelineModule checkpoint: its layer_XX-model_states.pt files are not read, "
                "so parameters without optimizer state (frozen), if any, are left out"
            )
        if len(parts) > 1 and tp > 1:
            _note_split(contents, split, len(weights), stages)
        if first.frozen:
            contents.description.append(
                f"{len(first.frozen)} frozen parameter(s): weights without Adam moments "
                "(measured by --what weights)"
            )
        return contents

    def part(self, mp: int, prefix: str) -> _Part:
        """One model-parallel rank's files: its model states and every data-parallel rank's
        optimizer partition, read as one ZeRO checkpoint of its own."""

        def optim_name(rank: int) -> str:
            return f"{prefix}zero_pp_rank_{rank}_{_mp(mp)}_optim_states.pt"

        listed = os.listdir(self.folder)
        optim_ranks = sorted(
            int(m.group(2)) for n in listed if (m := _OPTIM.fullmatch(n)) and int(m.group(3)) == mp
        )
        first = self.load(optim_name(0))
        stage, world = _stage_and_world(first)
        beyond = [r for r in optim_ranks if r >= world]
        if beyond:
            raise InputError(
                f"{self.folder / optim_name(beyond[0])}: a rank beyond the "
                f"{world} that {first.path.name} names (partition_count)"
            )
        model = self.load(
            f"{_mp(mp)}_model_states.pt"
            if stage <= 2
            else f"zero_pp_rank_0_{_mp(mp)}_model_states.pt"
        )
        shapes = _param_shapes(model)
        optims = [first] + [self.load(optim_name(r)) for r in range(1, world)]
        for ckpt in optims[1:]:
            other_stage, other_world = _stage_and_world(ckpt)
            if (other_stage, other_world) != (stage, world):
                raise InputError(
                    f"{ckpt.path}: ZeRO stage {other_stage} over {other_world} "
                    f"ranks, but {first.path.name} says stage {stage} over {world}"
                )
        dp = model.root.get("dp_world_size")
        if isinstance(dp, int) and dp != world:
            raise InputError(
                f"{model.path}: dp_world_size {dp}, but the optimizer states are "
                f"partitioned over {world} ranks"
            )
        flats = [_flat_groups(c, stage, len(shapes)) for c in optims]
        states = [_base_state(c, stage) for c in optims]
        files = [c.path for c in optims]
        padded = _check_partition_sizes(optims, flats, stage)
        if stage <= 2:
            places = _zero2_places(shapes, flats, world, first)
        else:
            places = _zero3_places(shapes, flats, world, first)
        flat_shapes = shapes_flat(shapes)
        weights = {n: _stored(n, flat_shapes[n], places[n], flats, files) for n in flat_shapes}
        frozen = self.frozen(model, stage, world, flat_shapes, mp)
        weights.update(frozen)
        optimizer = _optimizer(shapes, places, flats, padded, states, optims)
        held = (
            first.path.name
            if world == 1
            else f"{optim_name(0).replace('rank_0_', 'rank_*_', 1)} ({world} ranks)"
        )
        return _Part(mp, model, stage, world, flat_shapes, weights, frozen, optimizer, held)

    def frozen(
        self, model: Checkpoint, stage: int, world: int, trainable: Mapping, mp: int
    ) -> dict[str, StoredTensor]:
        """Frozen parameters: weights without optimizer state, as ``zero_to_fp32`` reads them.

        ZeRO 2 and 3 save ``frozen_param_shapes`` and ``frozen_param_fragments`` in
        the model state files: under ZeRO 2 each parameter whole (in the module's
        dtype); under ZeRO 3 each rank's file holds its flat part of every frozen
        parameter, ``ceil(numel / world)`` elements, the last part zero padded.
        ZeRO 1 saves neither (nor do DeepSpeed versions before frozen parameters were
        saved apart), but a ZeRO 1/2 module state dict is whole: there the frozen
        parameters are its entries that are neither in ``param_shapes`` nor buffers
        (``buffer_names``) nor tied names (``shared_params``).
        """
        raw = model.root.get("frozen_param_shapes")
        if raw is None and stage <= 2:
            return _frozen_in_module(model, trainable)
        if raw is None or (isinstance(raw, Mapping) and not raw):
            return {}
        shapes = _shape_group(raw, model, "frozen_param_shapes", set(trainable))
        models = [model]
        if stage == 3:
            models += [
                self.load(f"zero_pp_rank_{r}_{_mp(mp)}_model_states.pt") for r in range(1, world)
            ]
        fragments = []
        for ckpt in models:
            held = ckpt.root.get("frozen_param_fragments")
            if not isinstance(held, Mapping):
                raise InputError(
                    f"{ckpt.path}: frozen_param_shapes names {len(shapes)} "
                    "parameter(s), but there are no frozen_param_fragments"
                )
            row = []
            for name in shapes:
                tensor = held.get(name)
                if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
                    raise InputError(
                        f"{ckpt.path}: frozen_param_fragments holds no "
                        f"floating-point tensor for {visible(name)}"
                    )
                row.append(tensor)
            fragments.append(row)
        files = [c.path for c in models]
        out = {}
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            if stage <= 2:
                tensor = fragments[0][i]
                if tensor.numel() != numel:
                    raise InputError(
                        f"{files[0]}: frozen_param_fragments gives {visible(name)} "
                        f"{tensor.numel()} elements, its shape {list(shape)}"
                    )
                out[name] = StoredTensor.whole(name, tensor.reshape(shape), files[0])
                continue
            part = math.ceil(numel / world)
            place = []
            for r in range(world):
                tensor = fragments[r][i]
                if tensor.dim() != 1 or tensor.numel() != part:
                    raise InputError(
                        f"{files[r]}: frozen_param_fragments gives {visible(name)} "
                        f"{tensor.numel()} elements, not a flat part of {part} "
                        f"({numel} over {world} ranks)"
                    )
                keep = max(0, min(part, numel - r * part))  # the last parts are padding
                if keep:
                    place.append((r, i, 0, keep, r * part))
            out[name] = _stored(name, shape, place, fragments, files)
        return out

    def plain(self, given: Path) -> Contents:
        """Without ZeRO (stage 0): ``mp_rank_00_model_states.pt`` alone, its ``module`` the
        model's state dict (parameters and the buffers ``buffer_names`` lists) and its
        ``optimizer`` torch's optimizer state dict, or, under fp16/bf16 mixed precision,
        DeepSpeed's ``FP16_UnfusedOptimizer`` state: that state dict as
        ``optimizer_state_dict`` and the fp32 master weights as ``fp32_groups``, one list
        per param group in the group's order. The optimizer stores no names: they come from
        the module's parameter order (``what.map_names``, the contract's one interleaving
        that fits every shape), as for any optimizer saved beside its model."""
        ranks = sorted(
            int(m.group(1)) for n in os.listdir(self.folder) if (m := _PLAIN.fullmatch(n))
        )
        if (missing := _gap(ranks)) is not None:
            raise InputError(
                f"{self.folder}: holds model state files of "
                f"{', '.join(_mp(r) for r in ranks)} without ZeRO but no {_mp(missing)}: "
                "the model-parallel ranks are incomplete"
            )
        if len(ranks) > 1:
            return self.plain_ranks(given, len(ranks))
        model = self.load(f"{_mp(0)}_model_states.pt")
        root, file = model.root, model.path
        _check_saved_without_zero(model)
        params, buffers = _module(model)
        contents = Contents(
            path=given, kind=KIND, files=list(self.files), trusted_pickle=self.trusted
        )
        contents.weights = dict(params)
        contents.model_order_names = list(params)
        contents.buffers = buffers or None
        held = f"{file.name}'s 'optimizer'"
        optimizer, masters = _plain_optimizer(model, params)
        precision = ""
        if optimizer is not None:
            contents.optimizers = [optimizer]
            contents.evidence[roles.OPTIMIZER_STATE] = (
                f"a DeepSpeed checkpoint without ZeRO: {held}"
            )
        weights = f"a DeepSpeed checkpoint without ZeRO: {file.name}'s module"
        if masters:
            contents.weights.update(masters)
            precision = f"{_dtypes(params, masters)} module, "
            weights += f", fp32 master weights of {len(masters)} in {held} (fp32_groups)"
        contents.evidence[roles.WEIGHT] = weights
        version = self.header(contents, root, given, "DeepSpeed checkpoint without ZeRO (stage 0)")
        dp = root.get("dp_world_size")
        ranks_note = f"{dp} data-parallel rank(s)" if is_int(dp) else "one file"
        if optimizer is None:
            contents.description.append(
                f"{ranks_note}{version}: the module's weights; no optimizer state was saved"
            )
            return contents
        with_state = _with_state(optimizer)
        master_note = "fp32 master weights and " if masters else ""
        contents.description.append(
            f"{ranks_note}{version}: {precision}{master_note}Adam moments of "
            f"{len(with_state)} parameters"
        )
        _note_frozen(contents, len(params) - len(with_state))
        if masters:
            _note_zero_gradient_step(contents, optimizer, with_state)
        return contents

    def plain_ranks(self, given: Path, count: int) -> Contents:
        """Tensor-parallel ranks without ZeRO (stage 0): each ``mp_rank_XX_model_states.pt``
        read as ``plain`` reads one (its shards, and the moments of its optimizer, named by
        its module's order), then joined as ZeRO's model-parallel ranks are: a split
        parameter is its shards side by side, a replicated one counts once, from
        ``mp_rank_00``, by Megatron's layer names (``_tensor_parallel``)."""
        parts, low = [], set()
        for mp in range(count):
            model = self.load(f"{_mp(mp)}_model_states.pt")
            _check_saved_without_zero(model, ranks=count)
            params, _ = _module(model)
            optimizer, masters = _plain_optimizer(model, params)
            if optimizer is None:
                raise InputError(
                    f"{model.path}: holds no optimizer state; gradclip joins the "
                    "tensor-parallel ranks of a checkpoint without ZeRO by their optimizers"
                )
            if optimizer.param_names is None:
                optimizer.param_names = map_names(
                    Contents(path=model.path, kind=KIND, weights=params,
                             model_order_names=list(params)),
                    optimizer,
                )
            weights = {**params, **masters}
            low.update(_dtypes(params, masters).split("/") if masters else ())
            named = optimizer.param_names
            trainable = {named[p]: tuple(weights[named[p]].shape) for p in _with_state(optimizer)}
            dp = model.root.get("dp_world_size")
            world = dp if is_int(dp) else 1
            held = f"{model.path.name}'s 'optimizer'"
            parts.append(_Part(mp, model, 0, world, trainable, weights, {}, optimizer, held))
        _check_model_parallel(parts, self.folder, pipeline=False)
        weights, optimizer, split = _tensor_parallel(parts)
        first = parts[0]
        contents = Contents(
            path=given, kind=KIND, files=list(self.files), trusted_pickle=self.trusted
        )
        contents.weights = weights
        contents.model_order_names = list(weights)
        contents.optimizers = [optimizer]
        models = _span([p.model.path.name for p in parts])
        of = f" of {count} model-parallel ranks"
        contents.evidence[roles.WEIGHT] = f"a DeepSpeed checkpoint without ZeRO{of}: " + (
            "fp32 master weights in each file's 'optimizer' (fp32_groups)" if low
            else f"{models}' module"
        )
        contents.evidence[roles.OPTIMIZER_STATE] = (
            f"a DeepSpeed checkpoint without ZeRO{of}: each file's 'optimizer'"
        )
        root = first.model.root
        version = self.header(contents, root, given, "DeepSpeed checkpoint without ZeRO (stage 0)")
        with_state = _with_state(optimizer)
        precision = f"{'/'.join(sorted(low))} module, fp32 master weights and " if low else ""
        contents.description.append(
            f"{count} model-parallel ranks ({_span([_mp(r) for r in range(count)])}) x "
            f"{first.world} data-parallel rank(s){version}: {precision}Adam moments of "
            f"{len(with_state)} parameters"
        )
        _note_split(contents, split, len(weights))
        _note_frozen(contents, len(weights) - len(with_state))
        if low:
            _note_zero_gradient_step(contents, optimizer, with_state)
        return contents

    def pipeline(self, given: Path) -> Contents:
        """Pipeline parallelism (``deepspeed.pipe.PipelineModule``) without ZeRO: each stage
        ``XX`` saves ``mp_rank_XX_model_states.pt`` (no ``module``; its ``optimizer`` torch's
        state dict over the stage's parameters) and each of its layers' state dicts as
        ``layer_II-model_states.pt``, ``II`` the layer's global index, which names the layer
        as the module does (``II.weight``, as ZeRO's ``param_shapes`` of a PipelineModule).

        With tensor parallelism each stage has ``tp_degree`` ranks: layer ``II``'s shards of
        tensor-parallel rank ``TT`` are ``layer_II-model_TT-model_states.pt``, and DeepSpeed's
        topology numbers the rank files stage by stage (``mp_rank_XX``: stage
        ``XX // tp_degree``, tensor-parallel rank ``XX % tp_degree``). Each tensor-parallel
        rank is read as a pipeline of its own (``pipeline_rank``), then the ranks are joined
        as without stages: a split parameter its shards side by side, a replicated one once
        (``_tensor_parallel``), the ranks checked alike (``_check_alike``)."""
        names = os.listdir(self.folder)
        stages = sorted(int(m.group(1)) for n in names if (m := _PLAIN.fullmatch(n)))
        if (missing := _gap(stages)) is not None:
            raise InputError(
                f"{self.folder}: holds pipeline stages {', '.join(_mp(r) for r in stages)} "
                f"but no {_mp(missing)}: the stages are incomplete"
            )
        layers = _layer_names(self.folder, names)
        tp = len(layers)
        models = [self.load(f"{_mp(s)}_model_states.pt") for s in stages]
        first = models[0]
        for model in models:
            _check_saved_without_zero(model, pipeline_files=len(stages), tp=tp)
            for key in ("global_steps", "ds_version"):
                if model.root.get(key) != first.root.get(key):
                    raise InputError(
                        f"{model.path}: its {key} differs from {first.path.name}'s: the "
                        "stages are not one checkpoint"
                    )
        buffer_names: set[str] = set()
        for model in models:
            listed = model.root.get("buffer_names")
            if not isinstance(listed, (list, tuple)) or not all(isinstance(n, str) for n in listed):
                raise InputError(
                    f"{model.path}: no buffer_names: which of the layers' entries are buffers, "
                    "not parameters, cannot be told"
                )
            buffer_names.update(listed)
        read = [self.pipeline_rank(models[t::tp], layers[t], buffer_names) for t in range(tp)]
        params, buffers, optimizer = read[0]
        split = 0
        if tp > 1:
            parts = []
            for t, (weights, _, own) in enumerate(read):
                named = own.param_names or {}
                trainable = {named[p]: tuple(weights[named[p]].shape) for p in _with_state(own)}
                dp = models[t].root.get("dp_world_size")
                world = dp if is_int(dp) else 1
                parts.append(_Part(t, models[t], 0, world, trainable, weights, {}, own, ""))
            _check_alike(parts)
            # A name is its layer file's (tensor-parallel rank 0's named).
            where = {n: t.pieces[0].file for n, t in params.items()}
            params, optimizer, split = _tensor_parallel(parts, where)
        contents = Contents(
            path=given, kind=KIND, files=list(self.files), trusted_pickle=self.trusted
        )
        contents.weights = params
        contents.model_order_names = list(params)
        contents.buffers = buffers or None
        contents.optimizers = [optimizer]
        every = sorted(n for rank in layers for n in rank.values())
        files = _span(every)
        held = _span([f"{m.path.name}'s 'optimizer'" for m in models])
        ranks = _ranks_of(len(models) // tp, tp)
        of = f" of {ranks}" if len(models) > 1 else ""
        contents.evidence[roles.WEIGHT] = (
            f"a DeepSpeed pipeline checkpoint without ZeRO{of}: the layer files ({files})"
        )
        contents.evidence[roles.OPTIMIZER_STATE] = (
            f"a DeepSpeed pipeline checkpoint without ZeRO{of}: {held}"
        )
        version = self.header(
            contents, first.root, given, "DeepSpeed pipeline checkpoint without ZeRO (stage 0)"
        )
        dp = first.root.get("dp_world_size")
        dp_note = f" x {dp} data-parallel rank(s)" if is_int(dp) else ""
        with_state = _with_state(optimizer)
        ranks = f"{len(models)} pipeline stage(s)" if tp == 1 else ranks
        contents.description.append(
            f"{ranks} ({_span([_mp(s) for s in stages])}){dp_note}{version}: weights of "
            f"{len(params)} parameters in {len(every)} layer files ({files}), Adam moments "
            f"of {len(with_state)}"
        )
        if tp > 1:
            _note_split(contents, split, len(params), len(models) // tp)
        _note_frozen(contents, len(params) - len(with_state))
        return contents

    def pipeline_rank(
        self, models: list[Checkpoint], layers: dict[int, str], buffer_names: set[str]
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
            layer = self.load(layers[index])
            for key, value in layer.root.items():
                if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                    raise InputError(
                        f"{layer.path}: holds {visible(repr(key))[:60]}, which is not a named "
                        "tensor of the layer's state dict"
                    )
                name = f"{index}.{key}"
                tensor = StoredTensor.whole(name, value, layer.path)
                if name in buffer_names or not value.dtype.is_floating_point:
                    buffers[name] = tensor
                else:
                    params[name] = tensor
        _refuse_tied_layers(params)
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
            if len(models) == 1:
                own = order
            else:
                own = order[taken : taken + count]
            taken += count
            if count > len(own):
                raise InputError(
                    f"{file}: the optimizer lists {count} parameters, but the layer files "
                    f"hold {len(own)} for this stage: the layer files and the optimizer "
                    "disagree (a layer file missing?)"
                )
            stage_weights = {n: params[n] for n in own}
            optimizer.param_names = map_names(
                Contents(path=file, kind=KIND, weights=stage_weights,
                         model_order_names=list(own)),
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


def _with_state(optimizer) -> list:
    """The parameters of torch's optimizer state dict that hold state, in group order."""
    return [p for g in optimizer.param_groups for p in g["params"] if optimizer.state.get(p)]


def _dtypes(params: dict[str, StoredTensor], names) -> str:
    """The module's dtypes of ``names``, as words (``bfloat16``)."""
    return "/".join(sorted({str(params[n].dtype).removeprefix("torch.") for n in names}))


def _note_zero_gradient_step(contents, optimizer, with_state: list) -> None:
    """Under fp16/bf16 without ZeRO, Adam's step one past ``global_steps``, said."""
    steps = {_plain_number(optimizer.state[p].get("step")) for p in with_state}
    if contents.step is not None and steps == {contents.step + 1}:
        # FP16_UnfusedOptimizer.initialize_optimizer_states steps once with zero gradients.
        contents.description.append(
            f"Adam's step is {contents.step + 1}: DeepSpeed's fp16/bf16 optimizer took one "
            "step with zero gradients to create its state, and bias-corrects with that count"
        )


def _ranks_of(stages: int, tp: int) -> str:
    """The model-parallel ranks, in words: ``2 pipeline stages x 2 tensor-parallel ranks``."""
    if stages == 1:
        return f"{tp} model-parallel ranks"
    if tp == 1:
        return f"{stages} pipeline stages"
    return f"{stages} pipeline stages x {tp} tensor-parallel ranks"


def _note_split(contents, split: int, count: int, stages: int = 1) -> None:
    """How many of ``count`` tensors the model-parallel ranks split, and how many they copy
    (each stage's tensor-parallel rank 0 keeping the copy counted, under pipeline stages)."""
    ranks = "model-parallel ranks" if stages == 1 else "tensor-parallel ranks"
    once = _mp(0) if stages == 1 else "each stage's tensor-parallel rank 0"
    contents.description.append(
        f"{split} tensors split across the {ranks} (measured as their shards together), "
        f"{count - split} replicated (counted once, from {once}, as Megatron's "
        "get_grad_norm_fp32 does), by Megatron's layer names"
    )


def _note_frozen(contents, frozen: int) -> None:
    if frozen > 0:
        contents.description.append(
            f"{frozen} parameter(s) without optimizer state (frozen): weights only "
            "(measured by --what weights)"
        )


def _refuse_tied_layers(params: dict[str, StoredTensor]) -> None:
    """Two layers' equal weight matrices (2 dimensions or more): one module tied across
    layers (``TiedLayerSpec``), saved by each; refused rather than counted twice."""
    seen: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, stored in params.items():
        if len(stored.shape) < 2:
            continue
        value = stored.read()
        key = (tuple(value.shape), value.dtype, tuple(value.flatten()[:64].tolist()))
        for other, earlier in seen.get(key, ()):
            if torch.equal(value, earlier):
                raise InputError(
                    f"{stored.pieces[0].file}: holds {visible(name)}, equal to "
                    f"{visible(other)} (a layer tied across layers, saved by each); "
                    "gradclip does not read tied pipeline layers"
                )
        seen.setdefault(key, []).append((name, value))


def _plain_number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return float(value) if is_number(value) else None


def _check_saved_without_zero(
    model: Checkpoint, pipeline_files: int = 0, ranks: int = 1, tp: int = 1
) -> None:
    """A ZeRO checkpoint whose optimizer files are gone is not one saved without ZeRO; and
    it has one model-parallel rank, or is one of ``pipeline_files`` model state files of a
    pipeline whose layer files are those of ``tp`` tensor-parallel ranks (so
    ``pipeline_files // tp`` stages), or (``ranks``) one of that many model-parallel ranks,
    whose counts ``_check_model_parallel`` checks."""
    config = model.root.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    stage = zero.get("stage") if isinstance(zero, Mapping) else 0
    if model.root.get("param_shapes") is not None or stage not in (0, None, False):
        raise InputError(
            f"{model.path}: saved by ZeRO (stage {visible(repr(stage))[:20]}, or param_shapes "
            "recorded), but the folder holds no zero_pp_rank_*_optim_states.pt: the "
            "optimizer's files are missing"
        )
    dims = _dims(model)
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
                    f"{model.path}: {key} is {visible(repr(size))[:40]}, but the folder holds "
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
                f"{model.path}: {key} is {visible(repr(size))[:40]}, but the folder holds "
                f"{_mp(0)} alone: the other ranks' model state files are missing"
            )


def _module(model: Checkpoint) -> tuple[dict[str, StoredTensor], dict[str, StoredTensor]]:
    """The ``module`` state dict as ``(parameters, buffers)``, each in the model's order:
    buffers are what ``buffer_names`` lists (and any integer tensor)."""
    module = model.root.get("module")
    names = model.root.get("buffer_names")
    if not isinstance(module, Mapping) or not module:
        raise InputError(f"{model.path}: not a DeepSpeed model state: no 'module' state dict")
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InputError(
            f"{model.path}: no buffer_names: which of the module's entries are buffers, "
            "not parameters, cannot be told"
        )
    listed = set(names)
    params, buffers = {}, {}
    for name, value in module.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise InputError(
                f"{model.path}: 'module' holds {visible(repr(name))[:60]}, which is not a "
                "named tensor"
            )
        tensor = StoredTensor.whole(name, value, model.path)
        if name in listed or not value.dtype.is_floating_point:
            buffers[name] = tensor
        else:
            params[name] = tensor
    return params, buffers


def _plain_optimizer(
    model: Checkpoint, params: dict[str, StoredTensor]
) -> tuple[OptimizerState | None, dict[str, StoredTensor]]:
    """The ``optimizer`` entry of a checkpoint without ZeRO, and the fp32 master weights by
    name where mixed precision keeps them."""
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
    trained = _rounded_from(params, [m for held in groups for m in held])
    probe = {n: t for n, t in params.items() if n in trained}
    count = sum(len(held) for held in groups)
    if len(probe) < count:
        raise InputError(
            f"{file}: 'optimizer'.fp32_groups holds {count} fp32 master weights, but only "
            f"{len(probe)} of the module's parameters are a master rounded to their dtype: "
            "the masters and the module disagree"
        )
    names = map_names(Contents(path=file, kind=KIND, weights=probe), optimizer)
    optimizer.param_names = names
    masters = {}
    for g, (group, held) in enumerate(zip(optimizer.param_groups, groups)):
        for pid, master in zip(group["params"], held):
            name = names.get(pid)
            if (
                name is None
                or not isinstance(master, torch.Tensor)
                or master.dtype != torch.float32
                or tuple(master.shape) != tuple(params[name].shape)
            ):
                shown = visible(name) if name is not None else f"parameter {pid}"
                raise InputError(
                    f"{file}: 'optimizer'.fp32_groups[{g}] holds no fp32 tensor of {shown}'s shape"
                )
            masters[name] = StoredTensor.whole(name, master, file)
    return optimizer, masters


def _rounded_from(params: dict[str, StoredTensor], masters: list[torch.Tensor]) -> set[str]:
    """The parameters that some fp32 master, rounded to the parameter's dtype, equals.
    Candidates are found by shape and the first elements, then compared whole, one
    rounded master at a time."""
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


def _gap(numbers: list[int]) -> int | None:
    """The first of 0, 1, 2... that the sorted rank or stage ``numbers`` lack, where they
    are not exactly 0 .. n-1 (a duplicate counts as a gap after it); else None."""
    if numbers == list(range(len(numbers))):
        return None
    return next(r for r in range(len(numbers) + 1) if r not in numbers)


def _layer_files(folder: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if _PIPELINE_LAYER.fullmatch(n))
    except OSError:
        return []


def _layer_names(folder: Path, names: list[str]) -> list[dict[int, str]]:
    """A pipeline's layer files, ``{global layer index: file name}`` per tensor-parallel rank
    (``layer_II-model_TT-model_states.pt``; one rank where the names carry none): the ranks
    ``00`` on without a gap, each with the same layers."""
    ranks: dict[int | None, dict[int, str]] = {}
    for n in sorted(names):
        m = _LAYER_FILE.fullmatch(n)
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
    if (missing := _gap(tps)) is not None:
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


def _mp(rank: int) -> str:
    return f"mp_rank_{rank:02d}"


def _span(names: list[str]) -> str:
    """Names for a message: all of two, the first and last of more."""
    return ", ".join(names) if len(names) <= 2 else f"{names[0]} .. {names[-1]}"


@dataclass
class _Part:
    """One model-parallel rank's ZeRO checkpoint: its parameters (shards, under tensor
    parallelism) and their optimizer state, as one rank alone would be read."""

    mp: int
    model: Checkpoint
    stage: int
    world: int
    trainable: dict[str, tuple[int, ...]]
    weights: dict[str, StoredTensor]
    frozen: dict[str, StoredTensor]
    optimizer: OptimizerState
    held: str  # the optimizer files, for the evidence


def _args(model: Checkpoint) -> Mapping:
    """Megatron's ``args`` where Megatron-DeepSpeed saved them (its ``client_state``)."""
    args = model.root.get("args")
    return args.state if isinstance(args, NamespaceState) else {}


def _dims(model: Checkpoint) -> Mapping:
    dims = model.root.get("checkpoint_parallel_dimensions")
    return dims if isinstance(dims, Mapping) else {}


def _check_model_parallel(parts: list[_Part], folder: Path, pipeline: bool) -> tuple[int, int]:
    """The model-parallel ranks are one checkpoint: each says how many there are (DeepSpeed's
    ``mp_world_size`` and ``checkpoint_parallel_dimensions``, Megatron's args), and they agree
    on the ZeRO layout, the step and every parameter's name and shape. Returns the number of
    pipeline stages and of tensor-parallel ranks (``(1, len(parts))`` for tensor-parallel
    ranks alone).

    Or they are the ranks of a pipeline (``pipeline``: layer files beside them, ``pp_degree``
    stages x ``tp_degree`` tensor-parallel ranks, as many as the rank files): DeepSpeed's
    topology numbers them stage by stage, ``mp_rank_XX`` stage ``XX // tp_degree`` and
    tensor-parallel rank ``XX % tp_degree``; each tensor-parallel rank's stages hold other
    parameters (``_check_stages``), and are checked alike once joined (``_check_alike``)."""
    n = len(parts)
    dims = _dims(parts[0].model)
    pp, tp = dims.get("pp_degree"), dims.get("tp_degree")
    # One stage (pp_degree 1) of a PipelineModule, as Megatron-DeepSpeed's GPTModelPipe runs
    # without pipeline parallelism, is read as any model-parallel set.
    if pipeline and n > 1 and is_int(pp) and pp > 1:
        if not is_count(tp, 1) or pp * tp != n:
            raise InputError(
                f"{parts[0].model.path}: a pipeline checkpoint whose "
                f"checkpoint_parallel_dimensions are {visible(repr(dims))[:80]}, for {n} rank "
                "files: pp_degree x tp_degree should count them"
            )
        for part in parts:
            args = _args(part.model)
            for key, size, expected in (
                ("mp_world_size", part.model.root.get("mp_world_size"), n),
                ("checkpoint_parallel_dimensions", _dims(part.model), dims),
                # Megatron's args, where saved.
                ("args.tensor_model_parallel_size", args.get("tensor_model_parallel_size", tp), tp),
                ("args.pipeline_model_parallel_size",
                 args.get("pipeline_model_parallel_size", pp), pp),
            ):
                if size != expected:
                    raise InputError(
                        f"{part.model.path}: its {key} is {visible(repr(size))[:80]}, but "
                        f"{folder.name}/ holds {n} rank files, {pp} pipeline stages x {tp} "
                        "tensor-parallel rank(s): the ranks are not one checkpoint"
                    )
        for t in range(tp):
            _check_stages(parts[t::tp])
        return pp, tp
    held = f"{folder.name}/ holds {n} model-parallel rank(s)"
    for part in parts:
        root, file = part.model.root, part.model.path
        dims = _dims(part.model)
        args = _args(part.model)
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
    _check_alike(parts)
    return 1, n


def _check_alike(parts: list[_Part]) -> None:
    """Tensor-parallel ranks are one checkpoint: the same ZeRO layout, step, DeepSpeed version,
    and every parameter's name and shape (their shards'), trained ones in the same order."""
    first = parts[0]
    for part in parts[1:]:
        file = part.model.path
        if (part.stage, part.world) != (first.stage, first.world):
            raise InputError(
                f"{file}: ZeRO stage {part.stage} over {part.world} data-parallel "
                f"ranks, {first.model.path.name} stage {first.stage} over "
                f"{first.world}: the ranks are not one checkpoint"
            )
        for key in ("global_steps", "ds_version"):
            if part.model.root.get(key) != first.model.root.get(key):
                raise InputError(
                    f"{file}: its {key} differs from {first.model.path.name}'s: "
                    "the ranks are not one checkpoint"
                )
        mine = {n: tuple(t.shape) for n, t in part.weights.items()}
        theirs = {n: tuple(t.shape) for n, t in first.weights.items()}
        if mine != theirs or list(part.trainable) != list(first.trainable):
            other = next((n for n in mine.keys() ^ theirs.keys()), None) or next(
                (n for n in mine if mine[n] != theirs.get(n)), None
            )
            which = f" ({visible(other)})" if other is not None else ""
            raise InputError(
                f"{file}: its parameters differ from {first.model.path.name}'s"
                f"{which}: the ranks are not one model"
            )


def _check_stages(parts: list[_Part]) -> None:
    """Pipeline stages are one checkpoint: the same ZeRO layout and step on every stage, and
    each parameter on one stage only (a layer tied across stages, whose copies the stages
    keep alike, is refused rather than counted twice or guessed once)."""
    first = parts[0]
    seen: dict[str, Path] = {}
    for part in parts:
        file = part.model.path
        if (part.stage, part.world) != (first.stage, first.world):
            raise InputError(
                f"{file}: ZeRO stage {part.stage} over {part.world} data-parallel ranks, "
                f"{first.model.path.name} stage {first.stage} over {first.world}: the "
                "stages are not one checkpoint"
            )
        for key in ("global_steps", "ds_version"):
            if part.model.root.get(key) != first.model.root.get(key):
                raise InputError(
                    f"{file}: its {key} differs from {first.model.path.name}'s: the stages "
                    "are not one checkpoint"
                )
        for name in part.weights:
            if name in seen:
                raise InputError(
                    f"{file}: holds {visible(name)}, which {seen[name].name} holds too (a "
                    "layer tied across pipeline stages); gradclip does not read tied stages"
                )
            seen[name] = file


def _pipeline_stages(parts: list[_Part]) -> _Part:
    """One tensor-parallel rank's stages as one part: their parameters side by side, in
    stage order, and their optimizer states as one (``chained``: each stage's param groups
    kept, with their hyperparameters)."""
    first = parts[0]
    optimizer, _ = chained([p.optimizer for p in parts], first.optimizer.file)
    return _Part(
        first.mp,
        first.model,
        first.stage,
        first.world,
        {n: s for p in parts for n, s in p.trainable.items()},
        {n: t for p in parts for n, t in p.weights.items()},
        {n: t for p in parts for n, t in p.frozen.items()},
        optimizer,
        first.held,
    )


# The hyperparameters the moments are read with: the same on every model-parallel rank.
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def _tensor_parallel(
    parts: list[_Part], where: Mapping[str, Path] | None = None
) -> tuple[dict[str, StoredTensor], OptimizerState, int]:
    """The model-parallel ranks' shards as whole parameters, and their moments alike: split
    or replicated as Megatron's layer names say (``tensor_parallel``); and how many are
    split. A name the rule cannot place is refused naming the file it was read from
    (``where``; else the first rank's model state file, whose ``param_shapes`` name it)."""
    first = parts[0]
    shapes = {n: tuple(t.shape) for n, t in first.weights.items()}
    hidden = hidden_size(_args(first.model), shapes)
    where = where or {}
    axes = {
        n: split_axis(n, s, hidden, where.get(n, first.model.path)) for n, s in shapes.items()
    }
    weights = {n: merged(n, [p.weights[n] for p in parts], axes[n]) for n in shapes}
    names = first.optimizer.param_names or {}

    def hyper(part: _Part) -> list[tuple]:
        return [tuple(g.get(k) for k in _HYPER) for g in part.optimizer.param_groups]

    for part in parts[1:]:
        if hyper(part) != hyper(first):
            # The first group that differs names the file (a pipeline's groups are its
            # stages' files').
            g = next((g for g, (a, b) in enumerate(zip(hyper(part), hyper(first))) if a != b), 0)
            pid = next(iter(part.optimizer.param_groups[g]["params"]), None)
            raise InputError(
                f"{_held_in(part.optimizer, pid)}: its param groups' {', '.join(_HYPER)} "
                f"differ from {_held_in(first.optimizer, pid).name}'s: the ranks are not one "
                "checkpoint"
            )
    state = {}
    for pid, entry in first.optimizer.state.items():
        name = names[pid]
        entry = dict(entry)
        for part in parts[1:]:
            if part.optimizer.state[pid].get("step") != entry.get("step"):
                raise InputError(
                    f"{_held_in(part.optimizer, pid)}: Adam's step of {visible(name)} differs "
                    f"from {_held_in(first.optimizer, pid).name}'s: the ranks are not one "
                    "checkpoint"
                )
        for key, value in entry.items():
            if isinstance(value, StoredTensor):
                shards = [p.optimizer.state[pid][key] for p in parts]
                entry[key] = merged(value.name, shards, axes[name])
        state[pid] = entry
    optimizer = OptimizerState(first.optimizer.param_groups, state, names, first.optimizer.file)
    return weights, optimizer, sum(axis is not None for axis in axes.values())


def _held_in(optimizer: OptimizerState, pid: int | None) -> Path:
    """The file that holds parameter ``pid``'s moments (a pipeline's state spans its stages'
    files), else the optimizer's."""
    moment = optimizer.state.get(pid, {}).get("exp_avg") if pid is not None else None
    if isinstance(moment, StoredTensor) and moment.pieces and moment.pieces[0].file is not None:
        return moment.pieces[0].file
    return optimizer.file


def _frozen_in_module(model: Checkpoint, trainable: Mapping) -> dict[str, StoredTensor]:
    module = model.root.get("module")
    buffers = model.root.get("buffer_names")
    shared = model.root.get("shared_params")
    if not (
        isinstance(module, Mapping)
        and isinstance(buffers, (list, tuple))
        and isinstance(shared, Mapping)
    ):
        return {}  # what is a parameter cannot be told: none is taken for one
    others = (
        set(trainable)
        | {b for b in buffers if isinstance(b, str)}
        | {n for n in shared if isinstance(n, str)}
    )
    return {
        name: StoredTensor.whole(name, value, model.path)
        for name, value in module.items()
        if isinstance(name, str)
        and name not in others
        and isinstance(value, torch.Tensor)
        and value.dtype.is_floating_point
    }


def _osd(ckpt: Checkpoint) -> Mapping:
    osd = ckpt.root.get("optimizer_state_dict")
    if not isinstance(osd, Mapping):
        raise InputError(f"{ckpt.path}: not a DeepSpeed optimizer state: no 'optimizer_state_dict'")
    return osd


def _stage_and_world(ckpt: Checkpoint) -> tuple[int, int]:
    osd = _osd(ckpt)
    stage = osd.get("zero_stage")
    if not is_int(stage) or not 1 <= stage <= 3:
        raise InputError(
            f"{ckpt.path}: not a ZeRO optimizer state: zero_stage is {visible(repr(stage))}"
        )
    count = osd.get("partition_count")
    if isinstance(count, (list, tuple)) and count:
        # ZeRO 1/2 store one count per group (expert groups may differ); zero_to_fp32 takes
        # the largest as the data-parallel world size.
        counts = list(count)
    else:
        counts = [count]
    if not all(is_count(c, 1) and c <= _MAX_RANKS for c in counts):
        raise InputError(
            f"{ckpt.path}: partition_count is {visible(repr(count))}, not a number of ranks"
        )
    return stage, max(counts)


def _param_shapes(model: Checkpoint) -> list[dict[str, tuple[int, ...]]]:
    raw = model.root.get("param_shapes")
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise InputError(f"{model.path}: not a DeepSpeed model state: no 'param_shapes'")
    seen: set[str] = set()
    return [_shape_group(group, model, "param_shapes", seen) for group in raw]


def _shape_group(
    group: Any, model: Checkpoint, key: str, seen: set[str]
) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of one group of ``key``, each name new to ``seen`` (then added)."""
    if not isinstance(group, Mapping):
        raise InputError(f"{model.path}: {key} holds a group that is not a mapping")
    shapes = {}
    for name, shape in group.items():
        if not isinstance(name, str) or name in seen:
            raise InputError(
                f"{model.path}: {key} names {visible(repr(name))} twice or not as a string"
            )
        if not isinstance(shape, (tuple, list)) or not all(
            is_count(d) and d < 1 << 62 for d in shape
        ):
            raise InputError(
                f"{model.path}: {key} gives {visible(name)} the shape {visible(repr(shape))}"
            )
        seen.add(name)
        shapes[name] = tuple(shape)
    return shapes


def shapes_flat(shapes: list[dict[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    return {n: s for group in shapes for n, s in group.items()}


def _flat_tensor(value: Any, ckpt: Checkpoint, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.dtype.is_floating_point:
        raise InputError(f"{ckpt.path}: {what} is not a flat floating-point tensor")
    return value


def _flat_groups(ckpt: Checkpoint, stage: int, groups: int) -> list[torch.Tensor]:
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    flats = _osd(ckpt).get(key)
    if isinstance(flats, torch.Tensor):
        flats = [flats]
    if not isinstance(flats, (list, tuple)) or (stage <= 2 and len(flats) != groups):
        raise InputError(
            f"{ckpt.path}: {key} should list one flat partition per param group ({groups})"
        )
    return [_flat_tensor(f, ckpt, f"{key}[{i}]") for i, f in enumerate(flats)]


def _base_state(ckpt: Checkpoint, stage: int) -> tuple[list[dict], list[dict]]:
    """The wrapped optimizer's ``(param_groups, per-group state)``, one entry per flat group."""
    osd = _osd(ckpt)
    key = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    base = osd.get(key)
    if not (
        isinstance(base, Mapping)
        and isinstance(base.get("state"), Mapping)
        and isinstance(base.get("param_groups"), (list, tuple))
    ):
        raise InputError(f"{ckpt.path}: {key} is not an optimizer state dict")
    param_groups = list(base["param_groups"])
    states = []
    for g, group in enumerate(param_groups):
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, (list, tuple)) or len(params) != 1:
            raise InputError(f"{ckpt.path}: {key} param group {g} should hold one flat parameter")
        entry = base["state"].get(params[0], {})
        if not isinstance(entry, Mapping):
            raise InputError(f"{ckpt.path}: {key} state of group {g} is not a mapping")
        states.append(dict(entry))
    return param_groups, states


def _check_partition_sizes(optims: list[Checkpoint], flats, stage: int) -> list[int]:
    """Each group's partition size, padding included, checked to be the same on every rank.

    DeepSpeed cuts each group into equal partitions; ZeRO 1/2 files leave out the
    padding at the end of the fp32 partition (``group_paddings``) but keep it in the
    optimizer's moments, which are over the padded partition.
    """

    def sizes(r: int) -> list[int]:
        stored = [t.numel() for t in flats[r]]
        if stage <= 2:
            pads = _osd(optims[r]).get("group_paddings")
            if not _counts(pads, len(stored)):
                raise InputError(
                    f"{optims[r].path}: group_paddings is "
                    f"{visible(repr(pads))}, not one padding per group"
                )
            stored = [n + p for n, p in zip(stored, pads)]
        return stored

    expected = sizes(0)
    for r in range(1, len(optims)):
        if sizes(r) != expected:
            raise InputError(
                f"{optims[r].path}: its flat partitions (with padding) hold "
                f"{sizes(r)} elements, rank 0's {expected}; DeepSpeed "
                "partitions every group equally"
            )
    return expected


def _counts(value, n: int) -> bool:
    """Whether ``value`` is a list of ``n`` whole numbers >= 0 (DeepSpeed's paddings)."""
    return (isinstance(value, (list, tuple)) and len(value) == n
            and all(is_count(p) for p in value))


# A place: where one parameter's elements lie, as (rank, group, start, length, at) runs:
# ``length`` elements of rank ``rank``'s flat group ``group`` from ``start``, which are
# the parameter's flattened elements from ``at``.
Place = list[tuple[int, int, int, int, int]]


def _runs(sizes: list[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """``[start, start + length)`` of segments of ``sizes`` laid end to end: (segment, from, n)."""
    out = []
    base = 0
    for i, size in enumerate(sizes):
        lo, hi = max(start, base), min(start + length, base + size)
        if lo < hi:
            out.append((i, lo - base, hi - lo))
        base += size
    return out


def _zero2_places(shapes, flats, world: int, first: Checkpoint) -> dict[str, Place]:
    places: dict[str, Place] = {}
    paddings = _osd(first).get("param_alignment_paddings")
    for g, group in enumerate(shapes):
        sizes = [flats[r][g].numel() for r in range(world)]
        pads = None
        if isinstance(paddings, (list, tuple)) and g < len(paddings):
            pads = paddings[g]
            if not _counts(pads, len(group)):
                raise InputError(
                    f"{first.path}: param_alignment_paddings of group {g} do not "
                    f"match its {len(group)} parameters"
                )
        offset = 0
        avail = sum(sizes)
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            if offset + numel > avail:
                raise InputError(
                    f"{first.path}: the partitions of group {g} hold {avail} elements over "
                    f"{world} ranks, fewer than param_shapes needs ({visible(name)} ends at "
                    f"{offset + numel})"
                )
            at = 0
            place = []
            for r, start, n in _runs(sizes, offset, numel):
                place.append((r, g, start, n, at))
                at += n
            places[name] = place
            offset += numel + (pads[i] if pads is not None else 0)
        align = 2 * world
        if _align(offset, align) != _align(avail, align):
            raise InputError(
                f"{first.path}: the partitions of group {g} hold {avail} elements over {world} "
                f"ranks, but param_shapes accounts for {offset}"
            )
    return places


def _align(x: int, to: int) -> int:
    return to * math.ceil(x / to)


def _zero3_places(shapes, flats, world: int, first: Checkpoint) -> dict[str, Place]:
    places: dict[str, Place] = {}
    sizes = [[t.numel() for t in rank] for rank in flats]
    avail = sum(sizes[0])
    offset = 0
    for name, shape in shapes_flat(shapes).items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > avail:
            raise InputError(
                f"{first.path}: the flat buffers hold {avail} elements per rank, "
                f"fewer than param_shapes needs ({visible(name)} ends at "
                f"{offset + part})"
            )
        place = []
        for r in range(world):
            at = r * part
            keep = max(0, min(part, numel - at))  # the last parts are padding
            for g, start, n in _runs(sizes[r], offset, keep):
                place.append((r, g, start, n, at))
                at += n
        places[name] = place
        offset += part
    if offset != avail:
        raise InputError(
            f"{first.path}: the flat buffers hold {avail} elements per rank, but "
            f"param_shapes accounts for {offset}"
        )
    return places


def _stored(name: str, shape: tuple[int, ...], place: Place, tensors, files) -> StoredTensor:
    """``name`` as pieces of the flat tensors ``tensors[rank][group]`` (from ``files[rank]``)."""
    first = tensors[place[0][0]][place[0][1]] if place else None
    dtype = first.dtype if first is not None else torch.float32
    numel = math.prod(shape)
    if not place:  # an empty parameter
        return StoredTensor.whole(name, torch.empty(shape, dtype=dtype))
    if len(place) == 1:
        r, g, start, n, _ = place[0]
        view = tensors[r][g][start : start + n].view(shape)
        return StoredTensor.whole(name, view, files[r])
    pieces = []
    for r, g, start, n, at in place:
        part = tensors[r][g][start : start + n]
        pieces.append(Piece((at,), (n,), (lambda part=part: part), files[r]))
    if sum(n for *_, n, _ in place) != numel:
        raise AssertionError("pieces do not tile the parameter")  # _places guarantees it
    return StoredTensor(name, shape, dtype, pieces, flat=True)


def _optimizer(shapes, places, flats, padded, states, optims) -> OptimizerState:
    """The Adam state of every parameter, cut from the flat moment partitions."""
    world = len(optims)
    files = [c.path for c in optims]
    moments: dict[str, list[list[torch.Tensor]]] = {}
    for key in ("exp_avg", "exp_avg_sq"):
        per_rank = []
        for r in range(world):
            _, group_states = states[r]
            if len(group_states) != len(flats[r]):
                raise InputError(
                    f"{optims[r].path}: {len(group_states)} optimizer param "
                    f"groups for {len(flats[r])} flat groups"
                )
            row = []
            for g, entry in enumerate(group_states):
                value = entry.get(key)
                if value is None:
                    raise InputError(
                        f"{optims[r].path}: group {g} has no {key}; gradclip "
                        "reads Adam's state from DeepSpeed checkpoints"
                    )
                value = _flat_tensor(value, optims[r], f"group {g} {key}")
                if value.numel() not in (flats[r][g].numel(), padded[g]):
                    raise InputError(
                        f"{optims[r].path}: group {g} {key} holds "
                        f"{value.numel()} elements, its fp32 partition "
                        f"{flats[r][g].numel()} ({padded[g]} with padding)"
                    )
                row.append(value)
            per_rank.append(row)
        moments[key] = per_rank
    groups0, states0 = states[0]
    param_groups: list[dict[str, Any]] = []
    state: dict[int, dict[str, Any]] = {}
    names: dict[int, str] = {}
    flat_shapes = shapes_flat(shapes)
    pid = 0
    # ZeRO 3 merges all groups' parameters into one flat buffer per rank; the
    # hyperparameters then come from the group each parameter's first run lies in.
    for g, group in enumerate(shapes):
        ids = []
        for name in group:
            place = places[name]
            home = place[0][1] if place else min(g, len(groups0) - 1)
            hyper = groups0[home] if home < len(groups0) else groups0[-1]
            step = states0[home].get("step") if home < len(states0) else None
            if step is None and isinstance(hyper, Mapping):
                step = hyper.get("step")
            state[pid] = {
                "step": step,
                "exp_avg": _stored(
                    f"{name}.exp_avg", flat_shapes[name], place, moments["exp_avg"], files
                ),
                "exp_avg_sq": _stored(
                    f"{name}.exp_avg_sq", flat_shapes[name], place, moments["exp_avg_sq"], files
                ),
            }
            names[pid] = name
            ids.append(pid)
            pid += 1
        hyper = groups0[g] if g < len(groups0) else groups0[-1]
        param_groups.append(
            {**{str(k): v for k, v in hyper.items() if k != "params"}, "params": ids}
        )
    return OptimizerState(param_groups, state, names, optims[0].path)
