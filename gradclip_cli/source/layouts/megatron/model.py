"""The model's tensors in Megatron's checkpoints: which are buffers, how the
``torch_dist`` format's stacked layers and experts (``megatron`` states the rules) split
into one tensor each, in Megatron's parameter order, the check that an fp32 main param is
the model's tensor, and ``refuse_if``, the package's refusal of a file in one line."""

from __future__ import annotations

import re

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import Piece, StoredTensor

from .. import dcp_folder
from ..master_copy import rounds_to

# A buffer Megatron saves among the model's tensors, in both formats: the router's expert
# bias (``TopKRouter``'s ``register_buffer('expert_bias')``, core_v0.16.1), which no
# optimizer steps: never a weight, nor mapped to optimizer state.
BUFFER = re.compile(r"(?:.*\.)?router\.expert_bias")
SIXTEEN = (torch.bfloat16, torch.float16)  # the model dtypes an fp32 main param is kept for
MOMENT = re.compile(r"optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.+)")
# The optimizer's keys, a chained one's too (``chained_N.``): never the model's
OPTIMIZER = re.compile(r"(chained_\d+\.)?optimizer\.")
_LAYERS = re.compile(r"(^|.*\.)layers\.(?!\d)")  # a stacked key: ``layers.`` then no number
_EXPERTS = re.compile(r"(^|.*\.)experts\.experts\.(?!\d)")  # stacked experts: then no number
EXPERT = re.compile(r"(?:^|.*\.)experts\.experts\.(\d+)\.")  # one expert, split off


def split_layers(folder: dcp_folder.DcpFolder) -> dict[str, list[tuple[str, StoredTensor]]]:
    """Each tensor of the folder as ``[(name, tensor)]``: one per layer for a stacked one,
    and one per expert (of each layer) for a Mixture of Experts' stacked experts."""
    out: dict[str, list[tuple[str, StoredTensor]]] = {}
    for key, tensor in folder.tensors.items():
        model_key = MOMENT.fullmatch(key)
        name = model_key.group(2) if model_key else key
        parts = [(name, tensor)]
        if _LAYERS.match(name) and tensor.shape:
            refuse_if(any(piece.shape[0] != 1 for piece in tensor.pieces), folder.metadata_file,
                      f"{quoted(key)} is stacked by layer (shape {list(tensor.shape)}) "
                      "but a chunk holds several layers: its layers cannot be told apart")
            parts = _split_axis(name, tensor, _LAYERS)
        if _EXPERTS.match(name):
            # SequentialMLP.sharded_state_dict (core_v0.16.1): the global expert index an axis
            # after the layer's; a chunk may hold several experts (GroupedMLP's local ones).
            flat = next((t for _, t in parts if len(t.shape) < 2), None)
            if flat is not None:
                raise InputError(
                    f"{folder.metadata_file}: {quoted(key)} is named as a Mixture of "
                    f"Experts' stacked experts (experts.experts.) but has shape "
                    f"{list(flat.shape)}: no expert axis to split"
                )
            parts = [each for n, t in parts for each in _split_axis(n, t, _EXPERTS)]
        out[key] = parts
    return out


def _split_axis(name: str, tensor: StoredTensor, stacked: re.Pattern) -> list:
    """``tensor`` split along its first axis, index ``i`` named ``name`` with ``i`` inserted
    after ``stacked``'s match; each chunk's slice at ``i`` a piece of its own."""
    head = stacked.match(name).group(0)
    rest = name[len(head) :]
    parts = []
    for i in range(tensor.shape[0]):
        pieces = [
            Piece(p.offsets[1:], p.shape[1:], _sliced(p.read, i - p.offsets[0]), p.file)
            for p in tensor.pieces
            if p.offsets[0] <= i < p.offsets[0] + p.shape[0]
        ]
        each = f"{head}{i}.{rest}"
        parts.append((each, StoredTensor(each, tensor.shape[1:], tensor.dtype, pieces)))
    return parts


def _sliced(read, i: int):
    return lambda: read()[i]


def model_order(split) -> list[str]:
    """The model's parameters in Megatron's order: the metadata's, each stacked block's
    layers in turn (layer 0's tensors, then layer 1's...), and within a layer a Mixture of
    Experts' experts in turn (``SequentialMLP``'s ``local_experts``: expert 0's
    ``linear_fc1`` and ``linear_fc2``, then expert 1's...)."""
    keys = [k for k in split if not OPTIMIZER.match(k) and not BUFFER.fullmatch(k)]
    first: dict[tuple[str, str], int] = {}  # a block's head -> the place of its first key
    for here, key in enumerate(keys):
        for pattern in (_LAYERS, _EXPERTS):
            if found := pattern.match(key):
                first.setdefault((pattern.pattern, found.group(0)), here)
    places = []
    for here, key in enumerate(keys):
        stacked, experts = _LAYERS.match(key), _EXPERTS.match(key)
        among = first[(_EXPERTS.pattern, experts.group(0))] if experts else here
        start = first[(_LAYERS.pattern, stacked.group(0))] if stacked else among
        for name, _ in split[key]:
            layer = _index(name, stacked.group(0)) if stacked else 0
            expert = int(EXPERT.match(name).group(1)) if experts else 0
            places.append(((start, layer, among, expert, here), name))
    return [name for _, name in sorted(places)]


def _index(name: str, head: str) -> int:
    """The number that follows ``head`` in a split tensor's name."""
    return int(name[len(head) :].split(".", 1)[0])


def dtypes(weights: dict[str, StoredTensor], names) -> str:
    """The model's dtypes of ``names``, as words (``bfloat16``)."""
    return "/".join(sorted({str(weights[n].dtype).removeprefix("torch.") for n in names}))


def refuse_if(bad: object, file, why: str) -> None:
    """Refuses ``file`` in one line, its name then ``why``, where ``bad`` holds. ``why`` is
    made before the check: a sentence that cannot be made when the check passes is raised
    by its own ``if``."""
    if bad:
        raise InputError(f"{file}: {why}")


def checked(name: str, kind: str, main: Piece, model: Piece):
    """``main.read`` that first checks the chunk rounds to the model's chunk."""

    def read() -> torch.Tensor:
        value = main.read()
        refuse_unrounded(main.file, name, kind, value, model.read())
        return value

    return read


def refuse_unrounded(file, name: str, kind: str, main: torch.Tensor, model: torch.Tensor) -> None:
    """Refuses ``file`` where ``name``'s fp32 main param (``kind``) does not round to the
    model's tensor (``rounds_to``): Megatron copies it, rounded, into the model after each
    step (``_copy_main_params_to_model_params``), so the two copies disagree."""
    if not rounds_to(main, model):
        raise InputError(
            f"{file}: {name}'s fp32 main param ({kind}) "
            f"rounded to {str(model.dtype).removeprefix('torch.')} is not the model's "
            "tensor: the optimizer's weights and the model's disagree"
        )
