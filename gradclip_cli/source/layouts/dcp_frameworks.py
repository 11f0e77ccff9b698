"""What the DCP-based pretraining frameworks (torchtitan, OLMo-core, Megatron) share.

Each of them saves with ``torch.distributed.checkpoint`` but lays its state
dict out its own way; the layouts ``torchtitan``, ``olmo_core`` and
``megatron`` read the folder with ``dcp_folder.read_folder`` (the one DCP
folder reader, which the ``dcp``, ``lightning`` and ``accelerate_fsdp``
layouts use too: every file inside the folder, byte ranges checked, chunks
tiling their tensors) and name what the keys hold with the helpers here:

* ``fqn_optimizer``: an optimizer state flattened by parameter name, as
  torchtitan's ``get_flat_optim_state_dict`` writes it
  (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``: each parameter's
  hyperparameters repeated under its own name) and OLMo-core's
  ``optim.state.<fqn>.exp_avg`` (``get_optimizer_state_dict`` with
  ``flatten_optimizer_state_dict``);
* ``fused_weights``: torchtitan's fused ``wqkv``, whose optimizer state is
  keyed by the fused parameter while the model's state dict stores it split
  as ``wq``/``wk``/``wv`` (``FusedQKVLinear._split_qkv_on_save``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import OptimizerState, Piece, StoredTensor
from gradclip_cli.source.vocabulary import step_after, step_value

from .dcp_folder import DcpFolder, renamed


def fqn_optimizer(folder: DcpFolder, entries: dict[str, str]) -> OptimizerState | None:
    """An optimizer state flattened by parameter name.

    ``entries`` maps each DCP key of the optimizer to its name inside the
    optimizer's flat dict (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``).
    The parameter is what lies between the prefix and the last dotted part
    (the state key or hyperparameter, which hold no dots). Parameters whose
    hyperparameters are equal form one param group, in the order they appear.
    """
    where = folder.metadata_file
    state: dict[str, dict] = {}
    hyper: dict[str, dict] = {}
    for key, inner in entries.items():
        head, _, rest = inner.partition(".")
        fqn, _, name = rest.rpartition(".")
        if head not in ("state", "param_groups") or not fqn or not name:
            raise InputError(
                f"{where}: optimizer entry '{key}' is not "
                "state.<parameter>.<key> or param_groups.<parameter>.<key>"
            )
        if head == "state":
            tensor = folder.tensors.get(key)
            if tensor is not None and tensor.shape:
                state.setdefault(fqn, {})[name] = renamed(tensor, f"{fqn}.{name}")
            else:  # a 0-dim step, or a bytes value
                state.setdefault(fqn, {})[name] = folder.value(key)
        else:
            hyper.setdefault(fqn, {})[name] = folder.value(key)
    if not state and not hyper:
        return None
    for fqn in state:
        if fqn not in hyper:
            raise InputError(
                f"{where}: the optimizer holds state for '{fqn}' "
                "but no hyperparameters (param_groups) for it"
            )
    groups: list[dict] = []
    keyed: dict[str, int] = {}
    ids = {fqn: i for i, fqn in enumerate(hyper)}
    for fqn, values in hyper.items():
        signature = repr(sorted(values.items()))
        if signature not in keyed:
            keyed[signature] = len(groups)
            groups.append({**values, "params": []})
        groups[keyed[signature]]["params"].append(ids[fqn])
    return OptimizerState(
        groups, {ids[f]: s for f, s in state.items()}, {i: f for f, i in ids.items()}, where
    )


# --------------------------------------------------------------------- fused qkv


_SPLIT = ("wq", "wk", "wv")


def fused_weights(
    optimizer: OptimizerState | None, weights: dict[str, StoredTensor]
) -> tuple[dict[str, StoredTensor], list[str]]:
    """The weights of each fused ``wqkv`` parameter the optimizer names, from ``wq/wk/wv``.

    torchtitan's ``FusedQKVLinear`` trains one ``wqkv`` but saves it split:
    the rows of each key-value group interleaved (``reshape(n_kv, r,
    head_dim, dim)``), so which row goes where needs ``head_dim``, which the
    checkpoint does not record. A norm does not depend on the order of the
    elements, though: ``wq``, ``wk`` and ``wv`` together are exactly the
    fused parameter's elements, so the fused weight is given as their
    elements end to end (a flat ``StoredTensor``, good for norms and not for
    element-wise use) and its ``ratio`` is exact. Returns those weights by
    the optimizer's name, and a sentence for each fused parameter that could
    not be matched, saying why.
    """
    found: dict[str, StoredTensor] = {}
    notes: list[str] = []
    if optimizer is None or optimizer.param_names is None:
        return found, notes
    for pid, name in optimizer.param_names.items():
        module, _, param = name.rpartition(".")
        if name in weights or not module.endswith("wqkv"):
            continue
        base = module[: -len("wqkv")]
        parts = [weights.get(f"{base}{w}.{param}") for w in _SPLIT]
        moment = optimizer.state.get(pid, {}).get("exp_avg")
        why = _why_not_fused(parts, moment)
        if why:
            notes.append(f"no ratio for {visible(name)}: {why}")
            continue
        found[name] = _end_to_end(name, tuple(moment.shape), parts)
    return found, notes


def _why_not_fused(parts, moment) -> str | None:
    if any(p is None for p in parts):
        return "the weights hold no wq, wk and wv beside it"
    if not isinstance(moment, StoredTensor):
        return "its optimizer state holds no exp_avg"
    if sum(p.numel() for p in parts) != moment.numel():
        return (
            f"wq, wk and wv hold {sum(p.numel() for p in parts)} elements, its "
            f"optimizer state {moment.numel()}"
        )
    if any(p.dtype != parts[0].dtype for p in parts):
        return "wq, wk and wv differ in dtype"
    if any(not _rows(p) for p in parts):
        return "a chunk of wq, wk or wv is not a block of whole rows"
    return None


def _rows(tensor: StoredTensor) -> bool:
    """Whether every piece spans the trailing dimensions whole (a contiguous flat range)."""
    return tensor.flat or all(
        piece.offsets[1:] == (0,) * (len(piece.offsets) - 1)
        and piece.shape[1:] == tuple(tensor.shape[1:])
        for piece in tensor.pieces
    )


def _end_to_end(name: str, shape: tuple[int, ...], parts: list[StoredTensor]) -> StoredTensor:
    pieces = []
    start = 0
    for part in parts:
        row = part.numel() // part.shape[0] if part.shape and part.shape[0] else 1
        for piece in part.pieces:
            first = piece.offsets[0] * row if not part.flat else piece.offsets[0]
            pieces.append(
                Piece((start + first,), (piece.numel,), _flattened(piece.read), piece.file)
            )
        start += part.numel()
    return StoredTensor(name, shape, parts[0].dtype, pieces, flat=True)


def _flattened(read):
    return lambda: read().reshape(-1)


def refuse_key(path: Path, key: str | None, what: str) -> None:
    """``--key`` finds saved gradients; these frameworks save none, and their weights and
    optimizer state are named by the layout, so a ``--key`` would only mislabel them."""
    if key is not None:
        raise InputError(
            f"{path}: --key '{key}': {what} saves no gradients and "
            "gradclip names its weights and optimizer state itself: drop --key "
            "(--what chooses what is measured)"
        )


def step_folder_number(path: Path, prefix: str) -> int | None:
    """N of a folder named ``<prefix>N`` (``step-3``, ``step3``), else None."""
    return step_after(os.path.basename(os.path.normpath(path)), prefix)


def int_value(value, where: Path, what: str) -> int:
    """A step count read from a checkpoint (``vocabulary.step_value``: a non-negative
    whole number, a 1-element tensor too)."""
    step = step_value(value)
    if step is None:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = value.item()
        raise InputError(f"{where}: {what} is {quoted(value)[:60]}, not a step count")
    return step
