"""Optimizer state's parameter ids as the model's names, by shape.

An optimizer's ``state_dict()`` keys its state by parameter id. Where it stored
``param_names`` (torch >= 2.6 given named parameters, DeepSpeed's
``param_shapes``) those are the names; otherwise each param group lists its
parameters in model order, but the groups may split that order (the HF
Trainer's decay and no-decay groups), so the mapping is the one interleaving of
the groups that matches every state tensor's shape (``interleave``), or the
state keeps its ids as names (``ids_reason`` says why; names are never
guessed).

What this reads of the model is plain data (``Model``): the weights, their
order, the buffers. ``source/what.py`` names what it measures with it, the
layouts that read a model's state from several files (DeepSpeed's ranks and
stages, Megatron's) name each part with it, and ``source/previous.py`` names
both checkpoints of a pair.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from gradclip_cli.core import distinct_elements
from gradclip_cli.errors import InputError
from gradclip_cli.source import roles
from gradclip_cli.source.interface import NOTHING, Contents, OptimizerState, StoredTensor


@dataclass(frozen=True)
class Model:
    """The model beside an optimizer's state, as naming the state reads it.

    ``weights``: the parameters by name (None: none beside the state).
    ``order``: the model's parameter names in order, where known (``Contents.order``);
    names that are ties of an earlier weight (one storage under two names) count once.
    ``buffers``: names that are the model's but never the optimizer's.
    ``fused``: weights under the optimizer's name for a parameter stored otherwise
    (``Contents.fused_weights``). ``unnamed``: the layout's own reason the state keeps
    its ids as names (``Contents.missing[roles.PARAMETER_NAMES]``).
    """

    weights: Mapping[str, StoredTensor] | None = None
    order: Sequence[str] | None = None
    buffers: Collection[str] = ()
    fused: Mapping[str, StoredTensor] = field(default_factory=lambda: NOTHING)
    unnamed: str | None = None

    @classmethod
    def of(cls, contents: Contents) -> Model:
        """The model side of a checkpoint's inventory."""
        return cls(contents.weights, contents.order, tuple(contents.buffers or ()),
                   contents.fused_weights, contents.missing.get(roles.PARAMETER_NAMES))


def untied(source: Mapping[str, StoredTensor]):
    """Names and stored tensors without tie duplicates, the ties, and the distinct
    elements of what is kept when all of it is held and nothing was dropped."""
    names = list(source)
    stored = list(source.values())
    held = [s.held for s in stored]
    ties: dict[str, list[str]] = {}
    keep = list(range(len(names)))
    candidates = [i for i, h in enumerate(held) if h is not None]
    elements = None
    if candidates:
        elements = distinct_elements([held[i] for i in candidates])
        dropped = set()
        for k, o in enumerate(elements.tie_of):
            if o != k:
                ties.setdefault(names[candidates[o]], []).append(names[candidates[k]])
                dropped.add(candidates[k])
        keep = [i for i in keep if i not in dropped]
        if dropped or len(candidates) < len(names):
            elements = None  # they describe other tensors than those kept
    return [names[i] for i in keep], [stored[i] for i in keep], ties, elements


def map_names(opt: OptimizerState, model: Model) -> dict[int, str]:
    """Parameter id -> model name, in optimizer id order.

    ``param_names`` when the optimizer stored them. Otherwise each param group
    lists its parameters in model order, but the groups may split that order
    (the HF Trainer's decay and no-decay groups), so the mapping is the one
    interleaving of the groups that matches every state tensor's shape
    (``interleave``). None: ``InputError`` with the reason; several: ``AmbiguousOrder``.
    Where no order can be had (``ids_reason``), the ids themselves: ``state.N``.
    """
    if opt.param_names is not None:
        if model.weights:
            # Evidence against evidence: names the model does not have.
            # (a layout's fused parameters, torchtitan's wqkv, are held under the
            # optimizer's name: ``Contents.fused_weights``)
            held = set(model.weights) | set(model.buffers) | set(model.fused)
            strangers = [n for n in opt.param_names.values() if n not in held]
            if strangers:
                more = f" and {len(strangers) - 1} more" if len(strangers) > 1 else ""
                raise InputError(
                    f"{opt.file}: the optimizer's param_names name {strangers[0]}"
                    f"{more}, which the checkpoint's weights do not hold: the two disagree")
        return dict(sorted(opt.param_names.items()))
    if ids_reason(opt, model) is not None:
        # Its ids are the only names there are, and the total does not depend on them.
        if model.weights:
            check_state_fits_weights(opt, model)
        return by_ids(opt)
    order = _model_order(opt, model)
    shapes = {n: tuple(model.weights[n].shape) if model.weights and n in model.weights
              else None for n in order}
    groups = [[(pid, _state_shape(opt.state.get(pid))) for pid in g["params"]]
              for g in opt.param_groups]
    model_shapes = [shapes[n] for n in order]
    group_shapes = [[s for _, s in g] for g in groups]
    placed = interleave(model_shapes, group_shapes)
    if placed == "ambiguous":
        placed = _unique_where_stateful(model_shapes, group_shapes)
    if placed is None:
        sizes = ", ".join(str(len(g)) for g in groups)
        raise InputError(
            f"{opt.file}: cannot map optimizer state to parameter names: no order of the "
            f"{len(order)} model parameters fits the param groups (sizes {sizes}) by shape, "
            "and the optimizer stored no param_names")
    if placed == "ambiguous":
        raise AmbiguousOrder(
            f"{opt.file}: cannot map optimizer state to parameter names: {AMBIGUOUS}, and "
            "the optimizer stored no param_names")
    names = {}
    for model_index, spot in enumerate(placed):
        if spot is not None:
            g, j = spot
            names[groups[g][j][0]] = order[model_index]
    return dict(sorted(names.items()))


AMBIGUOUS = ("the param groups fit the model's parameter order in more than one way "
             "(parameters of equal shape)")


class AmbiguousOrder(InputError):
    """Several placements of the param groups in the model's order fit every shape
    (``AMBIGUOUS``): a layout that needs the names refuses; what measures the state
    itself measures it under its ids (``by_ids``), as it would with no order at all."""


def by_ids(opt: OptimizerState) -> dict[int, str]:
    """Parameter id -> ``state.N``: the state under its ids, in id order."""
    return {pid: f"state.{pid}" for g in opt.param_groups for pid in sorted(g["params"])}


def ids_reason(opt: OptimizerState, model: Model) -> str | None:
    """Why ``opt``'s state can be named by its parameter ids alone, or None when it can be
    mapped to the model's names (docs/reference/contract.md: "measured under its ids (``state.N``),
    never under guessed names, and the report says why").

    The one rule for every layout: no ``param_names``, and no model order to
    interleave the groups with: no model beside the state (an optimizer's
    state dict saved alone: a bare ``optimizer.bin``, torchtune's
    ``recipe_state.pt``), or weights stored sorted by name (a safetensors
    header, an index) with no other evidence of the order. A layout that
    knows its own cause says it (``Model.unnamed``: ``Contents.missing`` under
    ``roles.PARAMETER_NAMES``).
    """
    if opt.param_names is not None:
        return None
    if model.unnamed:
        return model.unnamed
    if model.order:
        return None
    if not model.weights:
        return "no model weights beside the optimizer state to take the names from"
    return "the model's weights are stored sorted by name, not in the model's order"


def check_state_fits_weights(opt: OptimizerState, model: Model) -> None:
    """Where state is named by id beside the model's weights, the two files still agree on
    shapes: whatever the order, every state tensor is a parameter's, so each shape the
    state holds is a parameter's shape at least as often (shapes as a multiset; a
    parameter the optimizer does not hold, a buffer, only adds to the weights' side).
    Else the checkpoint's two files contradict each other: ``InputError`` naming both
    and the tensor (docs/reference/contract.md: "a mapping that two layouts of the evidence
    contradict is exit 3 with the reason").
    """
    buffers = set(model.buffers)
    params = {n: t for n, t in (model.weights or {}).items() if n not in buffers}
    held = Counter(tuple(t.shape) for t in [*params.values(), *model.fused.values()])
    wanted = Counter()
    first: dict[tuple, tuple[int, str]] = {}
    for pid in sorted(opt.state):
        found = _state_key_shape(opt.state.get(pid))
        if found is not None:
            wanted[found[1]] += 1
            first.setdefault(found[1], (pid, found[0]))
    for shape, count in wanted.items():
        if held[shape] >= count:
            continue
        pid, key = first[shape]
        # A parameter whose shape the state never holds: the likely other side.
        odd = next((n for n, t in params.items() if tuple(t.shape) not in wanted), None)
        named = next(iter(params.values()), None) if odd is None else params[odd]
        weights_file = named.pieces[0].file if named is not None and named.pieces else None
        where = weights_file.name if weights_file is not None else "the model's weights"
        other = "" if odd is None else \
            f" ({where} holds {odd} as {list(params[odd].shape)})"
        fits = (f"which no parameter of {where} has" if held[shape] == 0 else
                f"as {count} state tensors do, which only {held[shape]} parameter(s) of "
                f"{where} have")
        raise InputError(
            f"{opt.file}: state.{pid}'s {key} has shape {list(shape)}, {fits}{other}: the "
            "optimizer state and the model weights of this checkpoint contradict each other")


def _state_key_shape(entry: dict | None) -> tuple[str, tuple[int, ...]] | None:
    """The state key that gives the parameter's shape, and that shape (``_state_shape``)."""
    for key in _FULL_SHAPED:
        value = (entry or {}).get(key)
        if isinstance(value, StoredTensor):
            return key, tuple(value.shape)
    shape = _state_shape(entry)
    return None if shape is None else ("factored state", shape)


def _model_order(opt: OptimizerState, model: Model) -> list[str]:
    """The model's order, each storage once: a name that ties an earlier weight (one
    tensor under two names, as tied embeddings are) is no parameter of its own."""
    if model.order:
        if not model.weights:
            return list(model.order)
        kept, _, _, _ = untied(model.weights)
        tie = set(model.weights) - set(kept)
        return [n for n in model.order if n not in tie]
    where = "its weights are stored sorted by name" if model.weights else \
        "it holds no model weights"
    raise InputError(
        f"{opt.file}: cannot map optimizer state to parameter names: the optimizer stored no "
        f"param_names and the model's parameter order is unknown ({where})")


_FULL_SHAPED = ("exp_avg", "exp_avg_sq", "momentum_buffer", "square_avg", "sum", "exp_inf",
                "variance", "max_exp_avg_sq", "grad_avg", "acc_delta", "prev", "step_size")


def _state_shape(entry: dict | None) -> tuple[int, ...] | None:
    """The parameter's shape as its state implies it (None: unknown, fits any)."""
    if not entry:
        return None
    for key in _FULL_SHAPED:
        value = entry.get(key)
        if isinstance(value, StoredTensor):
            return tuple(value.shape)
    row, col = entry.get("row_var"), entry.get("col_var")  # torch's Adafactor: (n, 1), (1, m)
    if isinstance(row, StoredTensor) and isinstance(col, StoredTensor) and row.shape:
        return (*row.shape[:-1], col.shape[-1])
    row, col = entry.get("exp_avg_sq_row"), entry.get("exp_avg_sq_col")  # transformers'
    if isinstance(row, StoredTensor) and isinstance(col, StoredTensor) and col.shape:
        return (*row.shape, col.shape[-1])
    return None


def _unique_where_stateful(model: list, groups: list[list]):
    """A placement of the groups' items on the model (``interleave``'s form) in which every
    item with state (a shape) has the one place that any placement gives it, the items
    without state (None: a parameter the optimizer holds but never stepped, a frozen one)
    left unplaced, since placements differ there; ``"ambiguous"`` when an item with state
    can sit in two places; None when there is no placement.

    One pass forward (the group positions reachable after each model parameter) and one
    backward (those from which every group can still be finished): an item can sit at a
    model parameter when a step between the two passes places it there.
    """
    n = len(model)
    spare = n - sum(len(g) for g in groups)
    end = tuple(len(g) for g in groups)
    if spare < 0:
        return None

    def moves(i: int, pos: tuple):
        """(next positions, the item placed or None) from ``pos`` at model parameter i."""
        if i - sum(pos) < spare:
            yield pos, None
        for g, group in enumerate(groups):
            j = pos[g]
            if j < len(group) and _fits(model[i], group[j]):
                yield pos[:g] + (j + 1,) + pos[g + 1:], (g, j)

    forward = [{(0,) * len(groups)}]
    for i in range(n):
        forward.append({nxt for pos in forward[i] for nxt, _ in moves(i, pos)})
    if end not in forward[n]:
        return None
    backward: list[set] = [set() for _ in range(n + 1)]
    backward[n] = {end}
    for i in range(n - 1, -1, -1):
        backward[i] = {pos for pos in forward[i]
                       if any(nxt in backward[i + 1] for nxt, _ in moves(i, pos))}
    places: dict[tuple[int, int], set[int]] = {}
    for i in range(n):
        for pos in forward[i] & backward[i]:
            for nxt, item in moves(i, pos):
                if item is not None and nxt in backward[i + 1]:
                    places.setdefault(item, set()).add(i)
    placed: list = [None] * n
    for (g, j), at in places.items():
        if groups[g][j] is None:
            continue
        if len(at) > 1:
            return "ambiguous"
        placed[next(iter(at))] = (g, j)
    return placed


def interleave(model: list, groups: list[list], *, first: bool = False,
               forbid: tuple[int, int, int] | None = None):
    """Place each group's items, in order, onto the model's sequence by matching shape.

    Returns, per model position, ``(group, index)`` or None (a model
    parameter no group holds: frozen); None when no placement exists;
    ``"ambiguous"`` when several do (with ``first``, the first placement found
    instead). A shape of None (no state stored) fits anything; ``forbid``,
    ``(position, group, index)``, rules that one choice out. Dynamic
    programming over the groups' positions, counting placements up to two.
    """
    total = sum(len(g) for g in groups)
    spare = len(model) - total  # model parameters no group holds
    if spare < 0:
        return None
    start = (0,) * len(groups)
    # layer i: {positions: (count, back)} where back = (previous positions, choice)
    layer: dict[tuple[int, ...], tuple[int, tuple | None]] = {start: (1, None)}
    history = [layer]
    for i, shape in enumerate(model):
        nxt: dict[tuple[int, ...], tuple[int, tuple | None]] = {}
        for pos, (count, _) in layer.items():
            skipped = i - sum(pos)
            if skipped < spare:
                _arrive(nxt, pos, count, (pos, None))
            for g, group in enumerate(groups):
                j = pos[g]
                if j < len(group) and _fits(shape, group[j]) and forbid != (i, g, j):
                    _arrive(nxt, pos[:g] + (j + 1,) + pos[g + 1:], count, (pos, (g, j)))
        layer = nxt
        history.append(layer)
        if not layer:
            return None
    end = tuple(len(g) for g in groups)
    if end not in layer:
        return None
    if layer[end][0] > 1 and not first:
        return "ambiguous"
    placed: list = []
    state = end
    for i in range(len(model), 0, -1):
        prev, choice = history[i][state][1]
        placed.append(choice)
        state = prev
    placed.reverse()
    return placed


def _arrive(layer: dict, state: tuple, count: int, back: tuple) -> None:
    """Count the ways into ``state`` (capped at 2); keep the first way's back pointer."""
    old = layer.get(state)
    layer[state] = (min(count, 2), back) if old is None else (min(old[0] + count, 2), old[1])


def _fits(a, b) -> bool:
    return a is None or b is None or tuple(a) == tuple(b)
