"""Checkpoint layouts: how one checkpoint is laid out across files and keys.

Each module here recognises one layout by content and opens it into
``Contents`` (see ``source/interface.py`` for the contract a layout keeps),
filling a ``Draft`` (``draft.py``) and handing over what ``finish`` makes of it.
Adding a layout is one module and one line in ``LAYOUTS``; order matters:
the first layout that recognises a path opens it, so a framework folder
(which may hold a sharded index) comes before the bare index.

``open_checkpoint`` is the one entry point the commands use: folders and
indexes go to the layouts, single files to ``open_file`` (the file readers,
then what a file's content says: a Lightning ``.ckpt``, else ``single_file``,
which also says when the file is a shard of an indexed set).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from gradclip_cli.errors import GradclipError, InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, unverified
from gradclip_cli.source.files.dcp_metadata import METADATA_NAME
from gradclip_cli.source.files.deepspeed_pickle import GLOBALS as DEEPSPEED_GLOBALS
from gradclip_cli.source.files.dtensor_pickle import GLOBALS as DTENSOR_GLOBALS
from gradclip_cli.source.files.dtensor_pickle import DTensorShard
from gradclip_cli.source.files.megatron_pickle import NamespaceState
from gradclip_cli.source.files.weights_pickle import allowing
from gradclip_cli.source.interface import Contents, Layout, WriteBack, written_whole
from gradclip_cli.source.roles import OPTIMIZER_STATE

from . import (
    accelerate_fsdp,
    accelerate_state,
    dcp,
    dcp_hf,
    deepspeed,
    hf_sharded,
    hf_trainer,
    lightning,
    litgpt,
    litgpt_adapter,
    megatron,
    nemo,
    olmo_core,
    olmo_core_gradients,
    single_file,
    torchtitan,
    torchtune,
    verl,
)
from .deepspeed import universal as deepspeed_universal
from .megatron import legacy as megatron_legacy

LAYOUTS: tuple[Layout, ...] = (
    nemo,  # its weights/ is a Megatron torch_dist folder: before megatron
    megatron,  # its folders hold a DCP folder and common.pt: before any flat mapping
    megatron_legacy,  # iter_N/mp_rank_XX/model_optim_rng.pt
    deepspeed_universal,  # holds DeepSpeed's model state files: before deepspeed
    deepspeed,
    verl,  # model_world_size_W_rank_R.pt files: a run folder's look, one checkpoint
    accelerate_fsdp,  # a Trainer checkpoint-N/ under FSDP: no weights file beside
    accelerate_state,  # model.safetensors beside optimizer.bin, none of the Trainer's files
    hf_trainer,
    torchtune,  # its epoch_N/ may hold a Hugging Face index: before hf_sharded
    litgpt,  # LoRA's final/ holds the merged model beside the adapter: before litgpt_adapter
    litgpt_adapter,
    hf_sharded,
    olmo_core,
    olmo_core_gradients,  # its full_gradients/ is a plain DCP folder: before dcp
    torchtitan,  # a DCP folder laid out torchtitan's way: before dcp
    lightning,  # a sharded Lightning folder is a DCP folder with meta.pt: before dcp
    dcp,
    dcp_hf,
)

# The layouts whose checkpoint is itself one DCP folder, laid out the framework's way.
_DCP_FRAMEWORKS: tuple[Layout, ...] = (megatron, torchtitan)


def open_checkpoint(
    path: Path | str, *, key: str | None = None, trust_pickle: bool = False,
    verify: bool = False,
) -> Contents:
    """Open ``path`` (a file, an index or a checkpoint folder) as ``Contents``.

    Under ``verify``, a file whose kind stores no checksums (a legacy torch file,
    safetensors) is named in ``Contents.notes`` with what could not be checked: the
    user asked for a check that was not (all) made. Every failure is an ``InputError``
    with one line naming the file.
    """
    with unverified() as found:
        try:
            contents = _open(Path(path), key=key, trust_pickle=trust_pickle, verify=verify)
        except GradclipError as error:
            error.noting(_unverified_notes(found))
            raise
    if not found:
        return contents
    return dataclasses.replace(contents, notes=(*contents.notes, *_unverified_notes(found)))


def _unverified_notes(found: dict[Path, str]) -> list[str]:
    """One note per thing ``--verify`` could not check, naming its files (a few)."""
    by_gap: dict[str, list[str]] = {}
    for file, gap in found.items():
        by_gap.setdefault(gap, []).append(file.name)
    notes = []
    for gap, names in by_gap.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        notes.append(f"--verify: {visible(', '.join(names[:3]))}{more}: {gap}")
    return notes


def _open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    if path.name == METADATA_NAME and os.path.isfile(path):
        # A DCP folder's .metadata given itself, in a folder a framework lays out its own
        # way: read as that folder. Read as a plain DCP folder, Megatron's flat keys
        # (weights, moments, main params) would be one flat mapping taken for gradients,
        # and a torchtitan weights-only export would be too.
        for layout in _DCP_FRAMEWORKS:
            if layout.recognises(path.parent):
                return layout.open(path.parent, key=key, trust_pickle=trust_pickle,
                                   verify=verify)
    for layout in LAYOUTS:
        if layout.recognises(path):
            return layout.open(path, key=key, trust_pickle=trust_pickle, verify=verify)
    if os.path.isdir(path):
        indexes = sorted(n for n in os.listdir(path) if n.endswith(hf_sharded.INDEX_SUFFIX))
        if len(indexes) > 1:
            raise InputError(f"{path}: holds several indexes ({', '.join(indexes)}); "
                             "give the one to read")
        hint = near_miss(path)
        if hint is not None:
            raise InputError(hint)
        raise InputError(
            f"{path}: is a directory, but not a checkpoint gradclip knows (expected a sharded "
            "checkpoint's index, a Hugging Face Trainer checkpoint-N/ folder, a DeepSpeed "
            "global_stepN/ folder or its parent with 'latest', an accelerate save_state or "
            "FSDP folder, a Megatron iter_N/ folder or its save folder with "
            "latest_checkpointed_iteration.txt, a torchtitan step-N/, an OLMo-core stepN/, "
            "a litgpt step-N/, a torchtune output or epoch_N/ folder, or a "
            "torch.distributed.checkpoint folder: .metadata, or safetensors shards with "
            "DCP_SHARDING_INFO)")
    alone = (deepspeed.rank_file_alone(path) or verl.rank_file_alone(path)
             or dcp.data_file_alone(path) or olmo_core.train_state_alone(path))
    if alone is not None:
        raise InputError(alone)
    return open_file(path, key=key, trust_pickle=trust_pickle, verify=verify)


def near_miss(path: Path) -> str | None:
    """Why a folder that is almost a checkpoint, or a part of one, cannot be read
    (DeepSpeed's missing files, a DCP folder without its index, OLMo-core's trainer state),
    in one line; None for any other path."""
    return (deepspeed.near_miss(path) or dcp.index_missing(path)
            or olmo_core.train_state_alone(path))


def write_back(contents: Contents) -> WriteBack | None:
    """How clip writes ``contents`` back (``WriteBack``: its plan, and the gradients clip
    scales), from the layout that opened it; None where it cannot be written. A single
    file (any layout's) is written whole."""
    if contents.checkpoint is not None:
        return WriteBack(written_whole([contents.checkpoint], contents.gradients or {}))
    for layout in LAYOUTS:
        if layout.KIND == contents.kind and hasattr(layout, "write_back"):
            return layout.write_back(contents)
    return None


# A training script's command line, saved beside its state (timm's train.py,
# Megatron, many scripts' ``args``): an ``argparse.Namespace`` is read as its
# attributes (``NamespaceState``), inert data, never constructed; what the
# attributes hold goes through the restricted reader like the rest of the file.
_INERT = {("argparse", "Namespace"): NamespaceState}


def open_file(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    """One checkpoint file: a framework's own file (a Lightning ``.ckpt``, recognised by its
    keys) or a plain one (``single_file``). A file of ``DTensor``s (read as their stand-ins,
    ``DTensorShard``) is one rank's shards, which no file alone places: refused, as is one
    rank's file of a DeepSpeed checkpoint away from its folder (its pickled DeepSpeed
    objects read as inert stand-ins: ``deepspeed.rank_content_alone``). A DeepSpeed model
    state file's fp16/bf16 optimizer wrapper is not read as a file's: the reason why says
    what it holds (``deepspeed.optimizer_alone``)."""
    with allowing({**_INERT, **DTENSOR_GLOBALS, **DEEPSPEED_GLOBALS}):
        ckpt = load_checkpoint(path, trust_pickle=trust_pickle, verify=verify)
    _refuse_shards(path, ckpt.root, trusted=ckpt.trusted_pickle)
    alone = deepspeed.rank_content_alone(path, ckpt.root)
    if alone is not None:
        raise InputError(alone)
    if lightning.claims(ckpt.root):
        return lightning.contents(ckpt, key=key).finish()
    contents = single_file.contents_of(ckpt, key=key)
    unread = deepspeed.optimizer_alone(ckpt.root)
    if unread is not None and not contents.optimizers:
        contents.missing.setdefault(OPTIMIZER_STATE, unread)
    return contents.finish()


def _refuse_shards(path: Path, root, *, trusted: bool) -> None:
    """``InputError`` when the loaded ``root`` holds a ``DTensor``: ``torch.save`` of one
    rank's sharded state dict (FSDP2, tensor parallelism), whose shards only all the ranks'
    files together place. A trusted load's real ``DTensor`` counts too."""
    real = None
    if trusted and "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor as real
    kinds = (DTensorShard,) if real is None else (DTensorShard, real)
    found = _first_of(root, kinds)
    if found is not None:
        raise InputError(
            f"{path}: {found} is a DTensor: the file holds one rank's shards of a "
            "distributed model, which it alone does not place; give a folder that holds "
            "every rank's (dcp.save), or a full state dict")


def _first_of(value, kinds, name: str = "", depth: int = 0) -> str | None:
    """The dotted name of the first entry in ``value`` (dicts, lists, tuples) that is one of
    ``kinds``, or None."""
    if isinstance(value, kinds):
        return name or "the file's content"
    if depth > 16:
        return None
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _first_of(item, kinds, f"{name}.{key}" if name else str(key), depth + 1)
        if found is not None:
            return found
    return None
