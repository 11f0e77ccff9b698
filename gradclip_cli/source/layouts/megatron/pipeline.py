"""Megatron's pipeline stages in the legacy format: which global layers each stage (and
each virtual stage's model chunk) holds, from the args, as Megatron-core builds them
(``megatron.legacy`` states the rules); what the args do not decide is refused."""

from __future__ import annotations

import re
from collections.abc import Mapping
from math import inf

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.untrusted import is_count

from .model import refuse_if

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_ANY_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
COPY = "output_layer.weight"  # a tied last stage's copy of embedding.word_embeddings.weight


def stage_layers(stages: list[list]) -> dict:
    """Each stage's layers, ``(first global layer, count)`` per model chunk (one, or one per
    virtual stage), and whether the last stage's output layer is the first stage's
    embedding (tied), from the args, as Megatron-core builds them (core_v0.16.1
    ``get_num_layers_to_build``, ``get_transformer_layer_offset``,
    ``LanguageModule.setup_embeddings_and_output_layer``); what they do not decide exactly
    is refused, naming the file."""
    rank = stages[0][0]
    args = rank.args

    def refuse(why: str) -> InputError:
        return InputError(
            f"{rank.file}: {why}; gradclip cannot tell which global layer each stage holds"
        )

    size = args["pipeline_model_parallel_size"]
    layers = args.get("num_layers")
    if not is_count(layers, 1):
        raise refuse("its args give no num_layers")
    layout = args.get("pipeline_model_parallel_layout")
    if layout is not None:
        raise refuse(
            f"its args set pipeline_model_parallel_layout {quoted(layout)[:40]} "
            "(a custom layout)"
        )
    for key in ("mtp_num_layers", "standalone_embedding_stage"):
        if args.get(key):
            raise refuse(f"its args set {key} {quoted(args[key])[:40]}")
    first, last, embedding, loss = _split(args)
    if first is not None or last is not None:
        if embedding or loss:
            raise refuse("its args set both an uneven first or last stage and account_for_*")
        rest = layers - (first or 0) - (last or 0)
        middle = size - (first is not None) - (last is not None)
        if middle > 0 and rest % middle:
            raise refuse(f"{rest} layers do not split evenly over {middle} middle stages")
        counts = [rest // middle if middle > 0 else 0] * size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        built = list(counts)  # each stage's layers before its chunks take their share
    else:
        total = layers + embedding + loss
        if total % size:
            raise refuse(f"{total} layers do not split evenly over {size} stages")
        built = [total // size] * size
        counts = list(built)
        counts[0] -= embedding
        counts[-1] -= loss
    if sum(counts) != layers or min(counts) < 0:
        raise refuse(f"its args' stages hold {counts} layers, not num_layers {layers}")
    virtual = len(rank.chunks)  # the args' virtual_pipeline_model_parallel_size (_chunks)
    if virtual == 1:
        spans = [[(sum(counts[:s]), counts[s])] for s in range(size)]
    else:
        spans = _virtual_spans(args, size, virtual, built, refuse)
    numbers = sorted(n for stage in spans for o, count in stage for n in range(o, o + count))
    if numbers != list(range(layers)):  # every layer built once, by one chunk of one stage
        raise refuse(
            f"its args' stages and {virtual} virtual stages hold layers {numbers}, not each "
            f"of num_layers {layers} once"
        )
    untie = args.get("untie_embeddings_and_output_weights")
    refuse_if(not isinstance(untie, bool), rank.file, "its args do not say "
              "untie_embeddings_and_output_weights: gradclip cannot tell whether the last "
              f"stage's {COPY} is the embedding's copy")
    for ranks in stages:  # each chunk of each stage holds exactly the layers its args give it
        stage = ranks[0].stage
        for key, (_, count) in zip(ranks[0].chunks, spans[stage]):
            held = _held_layers(ranks[0], key)
            if held != set(range(count)):
                where, chunk = (f" in {key}", f"'s chunk {key}") if virtual > 1 else ("", "")
                raise InputError(
                    f"{ranks[0].file}: holds decoder layers {sorted(held)}{where}, but its args "
                    f"give pipeline stage {stage}{chunk} {count} layer(s) of {layers}: "
                    "gradclip cannot tell which global layer each stage holds"
                )
        copy = copy_name(ranks[0])
        refuse_if(not untie and stage == size - 1 and copy not in ranks[0].weights, ranks[0].file,
                  f"its args say the output layer is tied to the embedding, but the last stage "
                  f"holds no {copy}")
    return {"spans": spans, "tied": not untie, "size": size}


def _split(args: Mapping) -> tuple:
    """The args' uneven first and last stage, and whether the embedding and the loss count
    as a layer in the split."""
    return (
        args.get("decoder_first_pipeline_num_layers"),
        args.get("decoder_last_pipeline_num_layers"),
        bool(args.get("account_for_embedding_in_pipeline_split")),
        bool(args.get("account_for_loss_in_pipeline_split")),
    )


def _virtual_spans(args: Mapping, size: int, virtual: int, built: list[int], refuse) -> list:
    """``[[(first global layer, count) per chunk] per stage]`` of an interleaved pipeline:
    each stage's layers in ``virtual`` chunks, chunk ``v`` of every stage before chunk
    ``v + 1`` of any (with 4 layers, 2 stages and 2 chunks of 1 layer: stage 0 holds layers
    0 and 2, stage 1 layers 1 and 3), as core_v0.16.1's ``get_num_layers_to_build`` and
    ``get_transformer_layer_offset`` compute them with a ``vp_stage``."""
    layers = args["num_layers"]
    first, last, embedding, loss = _split(args)
    bad = next((s for s in range(size) if built[s] % virtual), None)
    if bad is not None:
        raise refuse(f"stage {bad}'s {built[bad]} layers do not split into {virtual} chunks")
    spans = []
    for stage in range(size):
        chunks = []
        for v in range(virtual):
            count = built[stage] // virtual
            count -= embedding and stage == 0 and v == 0
            count -= loss and stage == size - 1 and v == virtual - 1
            if first is not None or last is not None:  # an uneven first or last stage
                first_chunk = (first or 0) // virtual
                middle = size - (first is not None) - (last is not None)
                middle_chunk = (layers - (first or 0) - (last or 0)) // virtual
                every = first_chunk + middle_chunk + (last or 0) // virtual
                if stage == 0:
                    offset = v * every
                elif middle == 0:  # Megatron-core divides by the middle stages here
                    raise refuse("its args set an uneven first and last stage, no middle one")
                else:
                    rank = stage if first is None else stage - 1
                    offset = v * every + first_chunk + rank * (middle_chunk // middle)
            else:
                total = layers + embedding + loss
                offset = v * (total // virtual) + stage * (built[stage] // virtual)
                offset -= embedding and not (stage == 0 and v == 0)
            if count < 0:
                raise refuse(f"stage {stage}'s virtual stage {v} holds {count} layers")
            chunks.append((offset, count))
        spans.append(chunks)
    return spans


def _held_layers(rank, key: str) -> set[int]:
    """The local numbers of the decoder layers in one model chunk of ``rank``."""
    prefix = f"{key}." if len(rank.chunks) > 1 else ""
    return {
        int(m.group(1))
        for n in rank.weights
        if n.startswith(prefix) and (m := _LAYER.fullmatch(n[len(prefix) :]))
    }


def copy_name(rank) -> str:
    """The name a tied last stage's copy of the embedding has here: its last chunk's."""
    return f"{rank.chunks[-1]}.{COPY}" if len(rank.chunks) > 1 else COPY


def global_names(rank, local: list[str], layers: dict) -> tuple[dict, list[str]]:
    """``decoder.layers.N`` of a stage's chunk renamed by its global layer (each chunk
    numbers its own from 0: a ``state_dict`` of its ``TransformerBlock``'s ``ModuleList``),
    a chunk's other names without its key, and the names that are the tied embedding's copy
    (a tied last stage's output layer, which Megatron's grad norm skips as ``shared``)."""
    spans = layers["spans"][rank.stage]
    keyed = len(rank.chunks) > 1
    rename = {}
    for name in local:
        chunk, plain = 0, name
        if keyed:  # model1.decoder.layers.0...: _Rank put each chunk's names under its key
            key, _, plain = name.partition(".")
            chunk = rank.chunks.index(key)
        match = _LAYER.fullmatch(plain)
        if match:
            number = spans[chunk][0] + int(match.group(1))
            rename[name] = f"decoder.layers.{number}.{match.group(2)}"
        elif _ANY_LAYER.search(plain):
            raise InputError(
                f"{rank.file}: {name} is a layer outside decoder.layers: gradclip "
                "cannot tell which global layer it is"
            )
        elif keyed:
            rename[name] = plain
    last = rank.stage == layers["size"] - 1
    copies = [copy_name(rank)] if layers["tied"] and last and copy_name(rank) in local else []
    return rename, copies


def by_layer(names: list[str]) -> list[str]:
    """The stages' names with the decoder layers by global number, what comes before the
    first (the embeddings) first and what comes after them (the final norm, the output
    layer) last, each otherwise in its stage's order."""
    numbers = [int(m.group(1)) if (m := _LAYER.fullmatch(n)) else None for n in names]
    start = next((i for i, n in enumerate(numbers) if n is not None), len(names))
    keys = [n if n is not None else -1 if i < start else inf for i, n in enumerate(numbers)]
    return [name for _, name in sorted(zip(keys, names), key=lambda pair: pair[0])]
