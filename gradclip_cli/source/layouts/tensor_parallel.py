"""Megatron-style tensor parallelism: which parameters the ranks split, and along which axis.

Each tensor-parallel rank saves its own shards under the model's names, and a
norm needs no merge: a split parameter's norm is the norm of its shards, so
it becomes one tensor of its full shape whose pieces are the ranks' shards; a
replicated one (norms, the row-parallel layers' biases, learned position
embeddings) counts once, from rank 0, as Megatron's ``get_grad_norm_fp32``
counts a parameter only where ``param_is_not_tensor_parallel_duplicate`` (its
``tensor_model_parallel`` attribute, set by the parallel layers and saved
nowhere). So replication is decided from the module names Megatron gives its
parallel layers (``split_axis``) and checked against the hidden size; a name
the rules do not know is refused, naming the file. Megatron legacy
checkpoints (``megatron.legacy``) and DeepSpeed's ``mp_rank_XX`` files
(``deepspeed``, as Megatron-DeepSpeed writes them) share the rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.interface import Piece, StoredTensor
from gradclip_cli.source.untrusted import is_count

# Megatron-core's tensor-parallel layers (core_v0.16.1 ``tensor_parallel/layers.py``) by the
# names its GPT, BERT and T5 specs give them: column-parallel layers split their output rows
# (weight and bias along axis 0), row-parallel ones their input columns (weight along axis 1;
# the bias is added after the all-reduce, replicated); the vocabulary-parallel embedding
# splits its rows.
_COLUMN = ("linear_qkv", "linear_q", "linear_kv", "linear_fc1", "output_layer", "word_embeddings")
_ROW = ("linear_proj", "linear_fc2")
# Legacy Megatron's names for the same layers (``megatron/legacy/model/transformer.py``, which
# Megatron-DeepSpeed's models keep): ``query_key_value``, ``query``, ``key_value`` and
# ``dense_h_to_4h`` column-parallel; ``dense_4h_to_h`` and the attention's ``dense``
# row-parallel. A ``dense`` elsewhere (BERT's pooler and LM head) is a plain, replicated
# ``Linear``: not known here, so refused.
_LEGACY_COLUMN = ("query_key_value", "query", "key_value", "dense_h_to_4h")
_LEGACY_ROW = ("dense_4h_to_h",)
_ATTENTION = ("self_attention", "inter_attention")
# Replicated: the norms (``*layernorm``, Transformer Engine's fused ``layer_norm_*``) and the
# learned position and token-type embeddings (plain ``torch.nn.Embedding``).
_REPLICATED = re.compile(
    r"(^|\.)((\w*layernorm|\w*_norm)\.(weight|bias)|layer_norm_(weight|bias)"
    r"|(position|tokentype)_embeddings\.weight)$"
)
_NORM_WEIGHT = re.compile(r"(^|\.)(\w*layernorm|\w*_norm)\.weight$|(^|\.)layer_norm_weight$")


def hidden_size(args: Mapping, shapes: Mapping[str, tuple[int, ...]]) -> int | None:
    """The model's hidden size: ``args.hidden_size`` where the checkpoint saves Megatron's
    args, else the one size of its norms' weights (every norm of a transformer normalises
    the hidden state); None when neither tells."""
    given = args.get("hidden_size")
    if is_count(given, 1):
        return given
    sizes = {shape for name, shape in shapes.items() if _NORM_WEIGHT.search(name)}
    if len(sizes) == 1 and len(shape := next(iter(sizes))) == 1:
        return shape[0]
    return None


def split_axis(name: str, shape: tuple[int, ...], hidden: int | None, file: Path) -> int | None:
    """The axis Megatron splits ``name`` along across tensor-parallel ranks; None:
    replicated. Decided by the module's name, checked against the hidden size."""

    def unfit(why: str) -> InputError:
        return InputError(
            f"{file}: {name} (shape {list(shape)}) {why}; "
            "gradclip cannot tell how it is split across tensor-parallel ranks"
        )

    module, _, kind = name.rpartition(".")
    parent, _, layer = module.rpartition(".")
    parent = parent.rpartition(".")[2]
    if _REPLICATED.search(name):
        return None
    column = layer in _COLUMN or layer in _LEGACY_COLUMN
    row = layer in _ROW or layer in _LEGACY_ROW or (layer == "dense" and parent in _ATTENTION)
    if not (column or row) or kind not in ("weight", "bias"):
        raise unfit("is not a layer Megatron's naming says how to split")
    if hidden is None:
        raise unfit(
            "is not a norm, and neither args.hidden_size nor the norms' size gives the "
            "hidden size to check a split by"
        )
    if column:
        if kind == "weight" and (len(shape) != 2 or shape[1] != hidden):
            raise unfit(f"is not a column-parallel weight of input size {hidden}")
        if kind == "bias" and len(shape) != 1:
            raise unfit("is not a column-parallel bias")
        return 0
    if kind == "weight":
        if len(shape) != 2 or shape[0] != hidden:
            raise unfit(f"is not a row-parallel weight of output size {hidden}")
        return 1
    if shape != (hidden,):
        raise unfit(f"is not a row-parallel bias of size {hidden}")
    return None


def merged(name: str, shards: Sequence[StoredTensor], axis: int | None) -> StoredTensor:
    """Rank 0's tensor (replicated), or the ranks' shards as one tensor split on ``axis``.

    A shard stored whole is one piece of the result as it is (mapped, never copied); a
    shard stored in several pieces (a ZeRO partition cut inside it) is read whole when
    measured, so memory stays bounded by the largest shard."""
    first = shards[0]
    if axis is None or len(shards) == 1:
        return StoredTensor(name, first.shape, first.dtype, first.pieces, flat=first.flat)
    shape = list(first.shape)
    pieces = []
    for r, shard in enumerate(shards):
        offsets = [0] * len(shape)
        offsets[axis] = r * shape[axis]
        held = shard.held
        file = shard.pieces[0].file if shard.pieces else None
        read = (lambda t=held: t) if held is not None else shard.read
        pieces.append(Piece(tuple(offsets), tuple(shard.shape), read, file, held))
    full = list(shape)
    full[axis] *= len(shards)
    return StoredTensor(name, full, first.dtype, pieces)


def whole_shards(
    name: str, tensors: Sequence[torch.Tensor], files: Sequence[Path]
) -> list[StoredTensor]:
    """Each rank's tensor of ``name``, at hand, as a shard for ``merged``."""
    return [StoredTensor.whole(name, t, f) for t, f in zip(tensors, files)]
