"""DCP's Hugging Face layout: safetensors shards that record where each piece lies.

``dcp.save(state_dict, storage_writer=HuggingFaceStorageWriter(path,
save_distributed=True))`` has every rank write its own shards of the model
as a safetensors file (``shard-0000R-model-0000K-of-0000N.safetensors``)
whose header metadata ``DCP_SHARDING_INFO`` is JSON: for each tensor of the
file, ``saved_offsets``, where the piece starts in the full tensor. There
is no ``.metadata``: the full size of a tensor is where its pieces end.
Recognised by content: a folder of safetensors files whose first one
carries ``DCP_SHARDING_INFO`` (a header read, never the data).

Every file is read by the safetensors reader (header checks, mapped data);
a tensor becomes a ``StoredTensor`` whose pieces are its pieces in the
files, checked to tile it exactly (``dcp_folder.check_tiling``); a piece stored
twice at the same place (replicated) counts once, and must hold the same
bytes both times: with no ``.metadata`` to give the full size, a piece that
claimed another's place would otherwise hide a part of the tensor. What the files hold is a
flat ``name -> tensor`` state dict: the model's weights, or gradients saved
that way (the ``--key`` rule's whole file), as for a flat DCP folder.

``clip`` holds each piece as a gradient of its own (``write_back``, as
``dcp_folder.hold_gradient_chunks`` holds a DCP folder's chunks) and writes every
file back as a safetensors file, the set switched in whole
(``sink/sharded_set.py``): the same tensors in the same order, the same
header metadata, ``DCP_SHARDING_INFO`` included, so the pieces stay where
they were. A piece stored twice is one gradient, counted and scaled once;
the second file is written from that same tensor, so both copies keep equal
bytes, as the layout requires.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files.json_text import parse_json
from gradclip_cli.source.files.safetensors_file import read_header
from gradclip_cli.source.interface import (
    Checkpoint,
    Contents,
    FileWrite,
    Piece,
    StoredTensor,
    WriteBack,
    WriteBackPlan,
)
from gradclip_cli.source.untrusted import is_count

from .dcp_folder import check_tiling, piece_name
from .draft import Draft
from .facts import UNMARKED, Found, wording
from .master_copy import same_bits
from .paths import inside

KIND = "dcp-hf"
SHARDING_KEY = "DCP_SHARDING_INFO"
SUFFIX = ".safetensors"


def recognises(path: Path) -> bool:
    if not os.path.isdir(path):
        return False
    try:
        files = _shards(path)
        return bool(files) and SHARDING_KEY in (read_header(files[0]).metadata or {})
    except (OSError, InputError):
        return False


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    if key:
        raise InputError(f"{path}: --key '{key}': a DCP Hugging Face folder holds one flat "
                         "name -> tensor mapping; omit --key")
    pieces: dict[str, list[_ShardPiece]] = {}
    dtypes: dict[str, torch.dtype] = {}
    shards: list[Checkpoint] = []
    files = _shards(path)
    for file in files:
        file = inside(path, file.name, named_by=path)
        ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
        offsets = _sharding_info(file, ckpt.metadata)
        if set(offsets) != set(ckpt.root):
            extra = sorted(set(ckpt.root) ^ set(offsets))[0]
            raise InputError(f"{file}: {SHARDING_KEY} and the tensors disagree about "
                             f"'{extra}'")
        for name, tensor in ckpt.root.items():
            at = offsets[name]
            if len(at) != tensor.dim():
                raise InputError(f"{file}: {SHARDING_KEY} places '{name}' at "
                                 f"{at}, but it has {tensor.dim()} dimensions")
            if dtypes.setdefault(name, tensor.dtype) != tensor.dtype:
                raise InputError(f"{file}: '{name}' is {tensor.dtype} here and "
                                 f"{dtypes[name]} in another file")
            piece = _ShardPiece(tuple(at), tuple(tensor.shape), lambda t=tensor: t, file,
                                tensor)
            known = pieces.setdefault(name, [])
            same = [i for i, p in enumerate(known)
                    if p.offsets == piece.offsets and p.shape == piece.shape]
            if not same:
                known.append(piece)
                continue
            first = known[same[0]]
            if not same_bits(first.held, tensor):
                # Replicated state is written by every rank alike and counts once; a
                # piece that differs would silently lose one copy's values.
                raise InputError(f"{file}: holds '{name}' at {at}, where "
                                 f"{first.file.name} holds other values")
            # Kept once; where the copy lies is kept for clip, which writes it back.
            known[same[0]] = _ShardPiece(first.offsets, first.shape, first.read, first.file,
                                         first.held, copies=(*first.copies, file))
        shards.append(ckpt)
    tensors = {}
    for name in sorted(pieces):
        found = pieces[name]
        size = tuple(max(p.offsets[d] + p.shape[d] for p in found)
                     for d in range(len(found[0].shape)))
        check_tiling(path, name, size, [(p.offsets, p.shape) for p in found])
        tensors[name] = StoredTensor(name, size, dtypes[name], found)
    floating = {n: t for n, t in tensors.items() if t.dtype.is_floating_point}
    contents = Draft(path=path, kind=KIND, files=list(files), shards=shards, folder=path,
                     weights_sorted=True,
                     gradients=floating or None, weights=floating or None,
                     skipped=[n for n in tensors if n not in floating])
    if not floating:
        contents.missing[roles.GRADIENT] = f"{path}: no floating-point tensors in its shards"
    held = f"safetensors shards with {SHARDING_KEY}, a flat name -> tensor set"
    contents.say(wording(Found(roles.GRADIENT, UNMARKED, (), "DCP's Hugging Face layout", held)))
    chunks = sum(len(p) for p in pieces.values())
    contents.description.append(
        f"DCP Hugging Face layout: {len(tensors)} tensors in {chunks} pieces, "
        f"{len(files)} safetensors files")
    return contents.finish()


@dataclass(frozen=True)
class _ShardPiece(Piece):
    """A piece read from one file; ``copies``: the other files that hold it (replicated)."""

    copies: tuple[Path, ...] = ()


def write_back(contents: Contents) -> WriteBack:
    """For clip: every gradient piece held as a gradient of its own, and every shard
    written back whole as safetensors.

    The held gradients are one per piece (named as DCP chunks are,
    ``dcp_folder.piece_name``): the mapped tensors of the shards'
    ``Checkpoint``s, private mappings, so scaling in place changes what the
    sink writes and never the files. A piece that
    another file holds too is written there from the same held tensor (its
    bytes are the same, checked at open): scaled once, written to both.
    """
    held: dict[str, StoredTensor] = {}
    own: dict[Path, list[str]] = {}
    copied: dict[Path, list[tuple[str, str]]] = {}
    for name, tensor in (contents.gradients or {}).items():
        for piece in tensor.pieces:
            assert isinstance(piece, _ShardPiece) and piece.held is not None
            label = piece_name(name, tensor, piece)
            held[label] = StoredTensor.whole(label, piece.held, piece.file)
            own.setdefault(piece.file, []).append(label)
            for copy in piece.copies:
                copied.setdefault(copy, []).append((name, label))
    files = tuple(FileWrite(Path(s.path), s.format, tuple(own.get(Path(s.path), ())),
                            tuple(copied.get(Path(s.path), ()))) for s in contents.shards)
    counted = sum(1 for t in (contents.gradients or {}).values() if t.pieces)
    return WriteBack(WriteBackPlan(contents.folder, files, counted), held)


def set_of(path: Path, metadata) -> Path | None:
    """The folder of which the safetensors file ``path`` (header ``metadata``) is one shard
    among several, by its ``DCP_SHARDING_INFO``: the pieces it holds are parts of the
    tensors whose full size only the folder's shards together give. None otherwise."""
    if SHARDING_KEY not in (metadata or {}) or not recognises(path.parent):
        return None
    return path.parent if len(_shards(path.parent)) > 1 else None


def _shards(folder: Path) -> list[Path]:
    return sorted(folder / n for n in os.listdir(folder) if n.endswith(SUFFIX))


def _sharding_info(file: Path, metadata: dict[str, str] | None) -> dict[str, list[int]]:
    text = (metadata or {}).get(SHARDING_KEY)
    if text is None:
        raise InputError(f"{file}: no {SHARDING_KEY} in its metadata, as the folder's other "
                         "shards have")
    info = parse_json(text, where=f"{file}: {SHARDING_KEY}", what="JSON")
    if not isinstance(info, dict):
        raise InputError(f"{file}: {SHARDING_KEY} is not a JSON object")
    out = {}
    for name, entry in info.items():
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(offsets, list) or not all(is_count(o) for o in offsets):
            raise InputError(f"{file}: {SHARDING_KEY} gives '{name}' no list "
                             "of offsets >= 0")
        out[name] = offsets
    return out
