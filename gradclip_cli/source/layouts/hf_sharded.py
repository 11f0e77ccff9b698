"""Hugging Face sharded checkpoints: an index JSON plus the shard files it names.

``model.safetensors.index.json`` / ``pytorch_model.bin.index.json`` (any
``*.index.json``) hold ``{"metadata": {...}, "weight_map": {name: shard}}``
(transformers ``save_pretrained``, ``huggingface_hub.save_torch_state_dict``).
Recognised by content: a JSON object with a ``weight_map`` of strings, given
as the index itself or as the folder that holds exactly one. Extra keys,
in ``metadata`` or beside it, are tolerated.

Every shard is opened by the file readers (so safetensors and torch shards
alike are mapped, checked and weights-only), and the set is checked to be
what the index says: each shard inside the folder, each name in the shard the
index names and in no other. The tensors form one mapping in index order: one
total across shards. A shard given alone is measured alone, and the report says
so (``clip`` refuses it); shards whose index is gone are refused, naming it:
their numbers count parts, not steps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files.small_file import excerpt
from gradclip_cli.source.interface import (
    Checkpoint,
    Contents,
    StoredTensor,
    WriteBack,
    written_whole,
)

from .draft import Draft
from .facts import FLAT, PROOF, Found, NotGradients, wording
from .paths import MAX_JSON_BYTES, inside, json_head_keys, read_json

KIND = "hf-sharded"
INDEX_SUFFIX = ".index.json"


def recognises(path: Path) -> bool:
    return find_index(path) is not None


def find_index(path: Path) -> Path | None:
    """The index ``path`` is, or the one index in the folder ``path``; else None."""
    if os.path.isdir(path):
        try:
            names = sorted(n for n in os.listdir(path) if n.endswith(INDEX_SUFFIX))
        except OSError:
            return None
        found = [path / n for n in names if _looks_like_index(path / n)]
        return found[0] if len(found) == 1 else None
    return path if _looks_like_index(path) else None


def _looks_like_index(path: Path) -> bool:
    # Content, cheaply: a JSON object that mentions weight_map near its top.
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_JSON_BYTES:
            return False
    except OSError:
        return False
    head = json_head_keys(path).lstrip()
    return head.startswith("{") and '"weight_map"' in head


def write_back(contents: Contents) -> WriteBack:
    """For clip: the shards (their tensors held, mapped privately) written back whole as a
    set, the index and the folder's other files copied."""
    return WriteBack(written_whole(contents.shards, contents.gradients or {}, contents.folder))


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    index = find_index(path)
    assert index is not None  # recognises() said so
    shards, tensors = read_set(index, trust_pickle=trust_pickle, verify=verify,
                               folder=path if os.path.isdir(path) else None)
    contents = Draft(path=path, kind=KIND, files=[index, *(s.path for s in shards)],
                     shards=shards, index=index, folder=index.parent,
                     weights_sorted=True,
                     trusted_pickle=any(s.trusted_pickle for s in shards))
    contents.description.append(
        f"{visible(index.name)}: {len(tensors)} tensors in {len(shards)} shards")
    if key is not None:
        raise InputError(f"{index}: --key '{key}' does not apply: a sharded set is one flat "
                         "mapping of name -> tensor")
    # A set is one flat name -> tensor mapping: its tensors are what the
    # --key rule calls the whole file (gradients, when saved as such).
    floating = {n: t for n, t in tensors.items() if t.is_floating_point()}
    contents.skipped = [n for n in tensors if n not in floating]
    # A model folder (save_pretrained: config.json beside the index) or a model's
    # buffers say weights; else the set is gradients, as a flat file would be.
    evidence = roles.weight_evidence(tensors, folder=index.parent)
    if evidence is not None:
        contents.weights = floating or None
        contents.say(wording(Found(roles.WEIGHT, PROOF, detail=evidence),
                             NotGradients(index, roles.WEIGHT, evidence, file="the set")))
        return contents.finish()
    contents.gradients = floating or None
    contents.say(wording(Found(roles.GRADIENT, FLAT, detail="a set of name -> tensor shards")))
    if not floating:
        contents.missing[roles.GRADIENT] = f"{index}: no floating-point tensors in the set"
    # The same tensors are the weights should the set be a model saved without its
    # config: --what weights measures them; no ratio of a tensor to itself.
    contents.weights = contents.gradients
    return contents.finish()


def read_set(
    index: Path, *, trust_pickle: bool, verify: bool, folder: Path | None = None
) -> tuple[list[Checkpoint], dict[str, StoredTensor]]:
    """Open every shard ``index`` names; the tensors in the index's order, checked.

    ``folder``: the checkpoint's folder when the layout found the index in it (the
    index's real path must stay inside); None for an index the user named."""
    weight_map = _weight_map(index, folder)
    folder = index.parent
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    shards: list[Checkpoint] = []
    found: dict[str, StoredTensor] = {}
    for shard_name, names in sorted(by_shard.items()):
        shard_path = inside(folder, shard_name, named_by=index)
        if not os.path.exists(shard_path):
            raise InputError(f"{shard_path}: missing: {index.name} names it as a shard")
        ckpt = load_checkpoint(shard_path, trust_pickle=trust_pickle, verify=verify)
        root = ckpt.root
        if not isinstance(root, Mapping):
            raise InputError(f"{shard_path}: a shard should hold name -> tensor, "
                             f"holds a {type(root).__name__}")
        for name, tensor in root.items():
            name = str(name)
            owner = weight_map.get(name)
            if owner is None:
                raise InputError(f"{shard_path}: holds '{name}', which "
                                 f"{index.name} does not list")
            if owner != shard_name:
                raise InputError(f"{shard_path}: holds '{name}', which "
                                 f"{index.name} puts in {owner}")
            if name in found:
                raise InputError(f"{shard_path}: '{name}' is stored twice")
            if not hasattr(tensor, "dtype"):
                raise InputError(f"{shard_path}: entry '{name}' is not a tensor")
            found[name] = StoredTensor.whole(name, tensor, shard_path)
        missing = [n for n in names if n not in found]
        if missing:
            raise InputError(f"{shard_path}: lacks '{missing[0]}'"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                             + f", which {index.name} puts there")
        shards.append(ckpt)
    return shards, {name: found[name] for name in weight_map}


def _weight_map(index: Path, folder: Path | None) -> dict[str, str]:
    document = read_json(index, what="a sharded checkpoint's index", folder=folder)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f"{index}: not a sharded checkpoint's index: no 'weight_map' object")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise InputError(f"{index}: weight_map maps {excerpt(name)} to "
                             f"a {type(shard).__name__}, not a file name")
    return weight_map
