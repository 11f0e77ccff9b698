"""Megatron's tensor-parallel ranks joined: a split parameter as one tensor of the model's
shape whose pieces are the ranks' shards (never copied), a replicated one once.

The legacy format saves each rank's shards whole under the model's names, split as
``layouts/tensor_parallel`` decides (``split_axes``, ``joined``); ``torch_dist`` saves a
distributed optimizer's state of a shard flat in its buckets' ranges (``assembled``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source.interface import Piece, StoredTensor

from ..tensor_parallel import hidden_size, merged, split_axis, whole_shards


def split_axes(ranks: list) -> tuple[list[str], dict[str, int | None]]:
    """The model's names (rank 0's order), and each one's split axis (None: replicated)."""
    first = ranks[0]
    names = list(first.weights)
    for rank in ranks[1:]:
        if list(rank.weights) != names:
            other = next(iter(set(rank.weights) ^ set(names)), None)
            which = f" ({visible(other)} is in one only)" if other is not None else ""
            raise InputError(
                f"{rank.file}: its model tensors differ from "
                f"{first.file.parent.name}'s{which}: the ranks are not one model"
            )
        for n in names:
            a, b = first.weights[n], rank.weights[n]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise InputError(
                    f"{rank.file}: {visible(n)} is {list(b.shape)} {b.dtype}, "
                    f"{list(a.shape)} {a.dtype} in {first.file.parent.name}: the "
                    "ranks are not one model"
                )
    if len(ranks) == 1:
        return names, dict.fromkeys(names)
    shapes = {n: tuple(t.shape) for n, t in first.weights.items()}
    hidden = hidden_size(first.args, shapes)
    return names, {n: split_axis(n, shapes[n], hidden, first.file) for n in names}


def joined(name: str, tensors: list[torch.Tensor], axis: int | None, files) -> StoredTensor:
    """The ranks' tensors of ``name`` (one per rank, from ``files``) as one stored tensor."""
    return merged(name, whole_shards(name, tensors, files), axis)


def assembled(
    name: str, shape, shards: Iterable[tuple[Piece, dict[str, StoredTensor]]], key: str
) -> StoredTensor:
    """A split parameter's ``key`` (a moment, or its fp32 main param) as one fp32 tensor of
    the model's ``shape``: each rank's, flat in its buckets' ranges, the piece at its
    shard's place."""
    return StoredTensor(name, shape, torch.float32, [_placed(s, m[key]) for s, m in shards])


def _placed(shard: Piece, flat: StoredTensor) -> Piece:
    def read() -> torch.Tensor:
        return torch.cat([p.read() for p in flat.pieces]).view(shard.shape)

    files = {p.file for p in flat.pieces}
    file = files.pop() if len(files) == 1 else None
    return Piece(tuple(shard.offsets), tuple(shard.shape), read, file)
