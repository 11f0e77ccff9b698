"""The tensor-parallel rule Megatron legacy and DeepSpeed ``mp_rank_XX`` checkpoints share:
each name's split axis as Megatron's parallel layers define it (``tensor_parallel/layers.py``
in Megatron-core, ``legacy/model/transformer.py`` for the legacy names), and a refusal for
every name or shape the rule cannot place."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradclip_cli.errors import InputError
from gradclip_cli.source.layouts.tensor_parallel import hidden_size, split_axis

H = 8
FILE = Path("ckpt/mp_rank_00_model_states.pt")
# (name, shape of one rank's shard, axis): column-parallel layers split their output rows,
# row-parallel ones their input columns; their biases, the norms and the position
# embeddings are whole on every rank.
PLACED = [
    ("decoder.layers.0.self_attention.linear_qkv.weight", (12, H), 0),
    ("decoder.layers.0.self_attention.linear_qkv.bias", (12,), 0),
    ("decoder.layers.0.self_attention.linear_proj.weight", (H, 4), 1),
    ("decoder.layers.0.self_attention.linear_proj.bias", (H,), None),
    ("decoder.layers.0.mlp.linear_fc2.weight", (H, 8), 1),
    ("decoder.layers.0.input_layernorm.weight", (H,), None),
    ("embedding.word_embeddings.weight", (16, H), 0),
    ("output_layer.weight", (16, H), 0),
    ("language_model.encoder.layers.0.self_attention.query_key_value.weight", (12, H), 0),
    ("language_model.encoder.layers.0.inter_attention.key_value.bias", (8,), 0),
    ("language_model.encoder.layers.0.self_attention.dense.weight", (H, 4), 1),
    ("language_model.encoder.layers.0.self_attention.dense.bias", (H,), None),
    ("language_model.encoder.layers.0.mlp.dense_h_to_4h.weight", (8, H), 0),
    ("language_model.encoder.layers.0.mlp.dense_4h_to_h.weight", (H, 8), 1),
    ("language_model.encoder.layers.0.post_attention_layernorm.bias", (H,), None),
    ("language_model.embedding.position_embeddings.weight", (6, H), None),
    ("language_model.embedding.tokentype_embeddings.weight", (2, H), None),
]


@pytest.mark.parametrize(("name", "shape", "axis"), PLACED)
def test_megatrons_layers_are_placed(name, shape, axis):
    assert split_axis(name, shape, H, FILE) == axis


@pytest.mark.parametrize(
    ("name", "shape", "why"),
    [
        # BERT's pooler and LM head: plain Linear layers named dense, replicated.
        ("language_model.pooler.dense.weight", (H, H), "naming says how to split"),
        ("lm_head.dense.weight", (H, H), "naming says how to split"),
        ("blocks.0.attn.qkv.weight", (12, H), "naming says how to split"),
        ("decoder.layers.0.mlp.linear_fc1.weight", (8, 2 * H), "input size 8"),
        ("decoder.layers.0.mlp.linear_fc2.weight", (2 * H, 8), "output size 8"),
        ("decoder.layers.0.mlp.linear_fc2.bias", (4,), "row-parallel bias of size 8"),
    ],
)
def test_what_the_rule_cannot_place_is_refused(name, shape, why):
    with pytest.raises(InputError, match="cannot tell how it is split") as refused:
        split_axis(name, shape, H, FILE)
    assert str(refused.value).startswith(f"{FILE}: {name} (shape {list(shape)})")
    assert why in str(refused.value)


def test_a_split_needs_a_hidden_size_to_check_it_by():
    with pytest.raises(InputError, match="neither args.hidden_size nor the norms' size"):
        split_axis("decoder.layers.0.mlp.linear_fc1.weight", (8, H), None, FILE)
    assert split_axis("decoder.final_layernorm.weight", (H,), None, FILE) is None


def test_the_hidden_size_from_args_else_from_the_norms():
    norms = {
        "a.input_layernorm.weight": (H,),
        "b.final_layernorm.weight": (H,),
        "b.final_layernorm.bias": (H,),
        "c.linear_fc1.weight": (16, H),
    }
    assert hidden_size({"hidden_size": 32}, norms) == 32
    assert hidden_size({}, norms) == H
    # QK norms normalise a head, not the hidden state: sizes that differ tell nothing.
    assert hidden_size({}, {**norms, "a.q_layernorm.weight": (4,)}) is None
    assert hidden_size({"hidden_size": True}, {}) is None
