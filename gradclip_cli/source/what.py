"""What is measured (``--what``): gradients, an optimizer's quantities, or the weights.

A checkpoint rarely holds gradients; what it holds after a divergence is the
optimizer's state. This module says what to measure and measures nothing:
each measured name gets a ``Derivation`` (which stored tensors it reads and
the transform that gives its value), and ``gradclip_cli.measuring`` does the
reading for all of them alike.

* ``grads`` and ``weights``: the tensors as stored, by role
  (``source/roles.py``: buffers are never weights);
* ``exp_avg``, ``grad_rms``, ``update``: as the optimizer that wrote the
  state defines them (``source/optimizers.py`` recognises it, the math is
  ``core/optimizer_math.py``), or an ``InputError`` naming the optimizer,
  what it holds and what is available;
* ``auto``: ``grads`` when the checkpoint holds gradients, else ``exp_avg``
  when its optimizer keeps a first moment, else ``weights``.

Bias correction is a scalar per tensor, so ``exp_avg`` is measured on the
stored moment and its norm scaled afterwards (no copy). Optimizer state is
keyed by parameter id; names come from ``param_names`` when stored, else
from the model's order group by group (``map_names``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradclip_cli.core import Elements, distinct_elements
from gradclip_cli.errors import InputError, UsageError
from gradclip_cli.escaping import visible
from gradclip_cli.source import optimizers, roles
from gradclip_cli.source.interface import (
    Contents,
    Derivation,
    OptimizerState,
    StoredTensor,
    chained,
)

WHATS = ("auto", "grads", "exp_avg", "grad_rms", "update", "weights")
EXPLAIN = {
    "grads": "saved gradients",
    "exp_avg": "first moment exp_avg / (1 - beta1^step), each parameter's own step",
    "grad_rms": "gradient RMS, the square root of its debiased second moment",
    # The lr is the one stored: a scheduler that stepped after the optimizer has set
    # it for the next step, and the files rarely say what the last step used.
    # Decoupled decay (AdamW's lr * wd * w) is not part of it; an L2 weight_decay
    # enters the moments (or SGD's buffer), so it is in the step they give.
    "update": "last update, as its own update rule gives it, decoupled weight decay excluded, "
              "at the stored lr, which a scheduler sets for the next step",
    "weights": "model weights",
}



@dataclass
class Selection:
    """The named tensors chosen by ``--what``, in report order, without tie duplicates.

    A selection says what to measure and measures nothing: ``derivations[i]``
    is which stored tensors ``names[i]`` reads and the transform that gives
    its value (the identity for grads and weights, a scale for ``exp_avg``,
    an optimizer's rule from ``core.optimizer_math`` otherwise); one
    measuring step (``gradclip_cli.measuring``) reads, batches, reports
    progress and gives pages back for every kind alike. ``tensors`` describe
    the measured tensors in the report (shape, dtype, elements): the stored
    tensors for grads, weights and ``exp_avg``, the state a quantity is
    derived from where it has the parameter's shape, else a description of
    the parameter's shape. ``weights[i]`` is the
    weight of ``names[i]`` for ``ratio`` (None when the checkpoint lacks it or
    ``what`` is ``weights``). ``evidence``: why these tensors are what is
    measured (``source/roles.py``).
    """

    what: str
    names: list[str]
    tensors: list[StoredTensor]
    ties: dict[str, list[str]]
    skipped: list[str]
    key: str
    explain: str
    derivations: list[Derivation]
    weights: list[StoredTensor | None] | None = None
    # The distinct storage elements of ``tensors``, when every one is held and
    # finding the ties already computed them (so loading need not again).
    elements: Elements | None = None
    evidence: str = ""
    optimizer: str | None = None  # whose rule gave an optimizer quantity ("Adam")
    # Where optimizer state is measured under its ids (``state.N``): why (``named_by_id``).
    ids_note: str | None = None

    def read_sizes(self) -> list[int]:
        """Bytes measuring each tensor reads (for progress and for sharing work)."""
        return [sum(t.nbytes for t in d.reads) for d in self.derivations]

    def bytes_to_read(self, only: list[int] | None = None) -> int:
        return sum(_pick(self.read_sizes(), only))

    @property
    def measured(self) -> str:
        """What was measured and the evidence: ``model weights (a state_dict: ...)``."""
        return f"{self.explain} ({self.evidence})" if self.evidence else self.explain


def select(contents: Contents, what: str, *, gradients_only: bool = False) -> Selection:
    """Choose what ``contents`` offers for ``--what``; ``InputError`` says what is available."""
    if what not in WHATS:
        raise UsageError(f"--what must be one of {', '.join(WHATS)}, got {what!r}")
    if gradients_only and what not in ("auto", "grads"):
        raise UsageError(f"clip changes gradients only: --what grads, got {what!r}")
    if what == "auto":
        what = _auto(contents, gradients_only)
    if what == "grads":
        selection = _raw(contents, "grads", gradients_only)
    elif what == "weights":
        selection = _raw(contents, "weights")
    else:
        selection = _from_optimizer(contents, what)
    return selection


def _auto(contents: Contents, gradients_only: bool) -> str:
    """The contract's default: gradients, else Adam-family moments, else the weights."""
    if contents.gradients or gradients_only:
        return "grads"
    if contents.keyed == roles.WEIGHT:
        return "weights"
    if contents.keyed == roles.OPTIMIZER_STATE:
        return next((q for q in optimizers.QUANTITIES if _gives(contents, q)), "exp_avg")
    if _gives(contents, "exp_avg"):
        return "exp_avg"
    return "weights" if contents.weights else "grads"


def _gives(contents: Contents, what: str) -> bool:
    opt = optimizer_state(contents)
    return isinstance(opt, OptimizerState) and optimizers.identify(opt).gives(what)


def optimizer_state(contents: Contents) -> OptimizerState | str | None:
    """The optimizer state to measure; several (Lightning's list, a file's ``optimizer_g``
    and ``optimizer_d``) are one, their ids chained in order, when one rule serves them
    all; else why not. Measuring the first alone would report a part as the total."""
    opts = contents.optimizers
    if len(opts) <= 1:
        return contents.optimizer
    kinds = [optimizers.identify(o).name for o in opts]
    if len(set(kinds)) > 1:
        return (f"it holds {len(opts)} optimizers of different kinds ({', '.join(kinds)}), "
                "whose parameters no one rule measures together")
    return chained(opts, opts[0].file)[0]


def available(contents: Contents) -> list[str]:
    """The ``--what`` choices that succeed on this checkpoint (each one is tried)."""
    found = []
    if contents.gradients:
        found.append("grads")
    for what in optimizers.QUANTITIES:
        if _gives(contents, what):
            try:
                _from_optimizer(contents, what)
            except InputError:
                continue
            found.append(what)
    if contents.weights:
        found.append("weights")
    return found


def holdings(contents: Contents) -> str:
    """What the optimizer state holds per parameter, named for people."""
    if not contents.optimizers:
        return "no optimizer state"
    return "; ".join(optimizers.holds(optimizers.identify(o)) for o in contents.optimizers)


def _unavailable(contents: Contents, what: str, why: str, gradients_only: bool = False
                 ) -> InputError:
    path = contents.path
    if gradients_only:
        # clip changes gradients only: never offer weights or optimizer state.
        return InputError(f"{path}: {why}; clip changes saved gradients only")
    offer = [w for w in available(contents) if w != what]
    options = ", ".join(f"--what {w}" for w in offer) if offer else "nothing gradclip measures"
    held = holdings(contents)
    keys = held[held.find("("):] if "(" in held else held
    held = "" if not contents.optimizers or keys in why else f"it holds {held}; "
    return InputError(f"{path}: --what {what}: {why}; {held}available: {options}")


# ----------------------------------------------------------------- grads, weights


def _raw(contents: Contents, what: str, gradients_only: bool = False) -> Selection:
    source = contents.gradients if what == "grads" else contents.weights
    if not source:
        error = contents.gradient_error
        nothing_else = not contents.optimizers and not contents.weights
        if what == "grads" and error and (nothing_else or gradients_only):
            # The reason alone (with its --key candidates): there is nothing else to offer.
            raise InputError(error if nothing_else else
                             f"{error}; clip changes saved gradients only")
        why = "the checkpoint holds no gradients" if what == "grads" else \
            "the checkpoint holds no model weights"
        if what == "grads" and error:
            why = error.removeprefix(f"{contents.path}: ")
        raise _unavailable(contents, what, why, gradients_only)
    names, tensors, ties, elements = _untied(source)
    weights = None
    if what == "grads" and contents.weights and contents.weights is not contents.gradients:
        weights = [contents.weights.get(n) for n in names]
    role = roles.GRADIENT if what == "grads" else roles.WEIGHT
    explain = EXPLAIN[what]
    if what == "weights" and contents.buffers:
        explain += f", {len(contents.buffers)} buffers apart"
    return Selection(
        what=what, names=names, tensors=tensors, ties=ties,
        skipped=list(contents.skipped) if what == "grads" else [],
        key=contents.gradient_key if what == "grads" else "", explain=explain,
        derivations=[Derivation.stored(t) for t in tensors],
        weights=weights, elements=elements,
        evidence=contents.evidence.get(role, f"the {contents.kind} layout"),
    )


def _pick(items: list, only: list[int] | None) -> list:
    return items if only is None else [items[i] for i in only]


def _untied(source: dict[str, StoredTensor]):
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


# ----------------------------------------------------------------- optimizer state


@dataclass
class _Param:
    name: str
    state: dict
    group: dict


def _from_optimizer(contents: Contents, what: str) -> Selection:
    opt = optimizer_state(contents)
    if opt is None:
        raise _unavailable(
            contents, what, contents.optimizer_error or "the checkpoint holds no optimizer state"
        )
    if isinstance(opt, str):
        raise _unavailable(contents, what, opt)
    kind = optimizers.identify(opt)
    if not kind.gives(what):
        raise _unavailable(contents, what, f"{kind.name}: {kind.why_not(what)}")
    names = map_names(contents, opt)
    if len(set(names.values())) < len(names):
        twice = next(n for n in names.values() if list(names.values()).count(n) > 1)
        raise InputError(f"{contents.path}: two of its {len(contents.optimizers)} optimizers "
                         f"hold parameter {visible(twice)}: they are not one training's parts")
    group_of = {pid: group for group in opt.param_groups for pid in group["params"]}
    params = []
    stepped = {pid for pid in names if optimizers.stepped(kind, opt.state.get(pid))}
    for pid, name in names.items():
        entry = opt.state.get(pid)
        if pid not in stepped and (stepped or not entry):
            # Never stepped (no gradient yet): nothing to measure. Where no parameter
            # has stepped, the state is refused for saying so (step 0).
            continue
        params.append(_Param(name, entry, group_of[pid]))
    order = report_order(contents, [p.name for p in params])
    params.sort(key=lambda p: order.get(p.name, len(order)))
    derived = []
    for p in params:
        try:
            d = optimizers.derive(kind, what, opt, p.name, p.state, p.group)
        except optimizers.Refusal as refusal:
            raise _unavailable(contents, what, f"{kind.name}: {refusal}") from None
        for t in d.reads[1:]:
            if tuple(d.reads[0].shape) == d.shape and tuple(t.shape) != d.shape:
                raise InputError(
                    f"{opt.file}: parameter {visible(p.name)}: {visible(_key_of(d.reads[0]))} "
                    f"{list(d.shape)} and {visible(_key_of(t))} {list(t.shape)} differ in "
                    "shape")
        weight = contents.weights.get(p.name) if contents.weights else None
        if weight is not None and tuple(weight.shape) != d.shape:
            raise InputError(f"{opt.file}: parameter {visible(p.name)}: "
                             f"{visible(_key_of(d.reads[0]))} implies shape {list(d.shape)}, "
                             f"which does not fit the weight's shape {list(weight.shape)}")
        derived.append(d)
    described = [d.reads[0] if d.scale is not None or tuple(d.reads[0].shape) == d.shape
                 else StoredTensor(p.name, d.shape, d.reads[0].dtype, ())
                 for p, d in zip(params, derived)]

    weights = None
    if contents.weights:
        weights = [contents.weights.get(p.name, contents.fused_weights.get(p.name)) for p in params]
    reason = ids_reason(contents, opt)
    return Selection(
        what=what, names=[p.name for p in params], tensors=described, ties={}, skipped=[],
        key="", explain=f"{kind.name} {EXPLAIN[what]}", derivations=derived, weights=weights,
        evidence=contents.evidence.get(roles.OPTIMIZER_STATE, f"the {contents.kind} layout"),
        optimizer=kind.name,
        ids_note=None if reason is None else named_by_id(reason),
    )


def _key_of(t: StoredTensor) -> str:
    return t.name.split(".", 1)[1] if "." in t.name else t.name


def report_order(contents: Contents, names: list[str]) -> dict[str, int]:
    """Name -> position in the report: the model's parameter order where the checkpoint
    knows it, else the order of ``names``."""
    if contents.model_order_names:
        return {n: i for i, n in enumerate(contents.model_order_names)}
    if contents.weights and contents.model_order:
        return {n: i for i, n in enumerate(contents.weights)}
    return {n: i for i, n in enumerate(names)}


# ----------------------------------------------------------------- ids to names


def map_names(contents: Contents, opt: OptimizerState) -> dict[int, str]:
    """Parameter id -> model name, in optimizer id order.

    ``param_names`` when the optimizer stored them. Otherwise each param group
    lists its parameters in model order, but the groups may split that order
    (the HF Trainer's decay and no-decay groups), so the mapping is the one
    interleaving of the groups that matches every state tensor's shape
    (``interleave``). None or several: ``InputError`` with the reason.
    """
    if opt.param_names is not None:
        if contents.weights:
            # Evidence against evidence: names the model does not have.
            # (a layout's fused parameters, torchtitan's wqkv, are held under the
            # optimizer's name: ``Contents.fused_weights``)
            held = set(contents.weights) | set(contents.buffers or ()) | set(contents.fused_weights)
            strangers = [n for n in opt.param_names.values() if n not in held]
            if strangers:
                more = f" and {len(strangers) - 1} more" if len(strangers) > 1 else ""
                raise InputError(
                    f"{opt.file}: the optimizer's param_names name {visible(strangers[0])}"
                    f"{more}, which the checkpoint's weights do not hold: the two disagree")
        return dict(sorted(opt.param_names.items()))
    if ids_reason(contents, opt) is not None:
        # Its ids are the only names there are, and the total does not depend on them.
        return {pid: f"state.{pid}" for g in opt.param_groups for pid in sorted(g["params"])}
    order = _model_order(contents, opt)
    shapes = {n: tuple(contents.weights[n].shape) if contents.weights and n in contents.weights
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
        raise InputError(
            f"{opt.file}: cannot map optimizer state to parameter names: the param groups fit "
            "the model's parameter order in more than one way (parameters of equal shape), and "
            "the optimizer stored no param_names")
    names = {}
    for model_index, spot in enumerate(placed):
        if spot is not None:
            g, j = spot
            names[groups[g][j][0]] = order[model_index]
    return dict(sorted(names.items()))


def ids_reason(contents: Contents, opt: OptimizerState) -> str | None:
    """Why ``opt``'s state can be named by its parameter ids alone, or None when it can be
    mapped to the model's names (docs/reference/contract.md: "measured under its ids (``state.N``),
    never under guessed names, and the report says why").

    The one rule for every layout: no ``param_names``, and no model order to
    interleave the groups with: no model beside the state (an optimizer's
    state dict saved alone: a bare ``optimizer.bin``, torchtune's
    ``recipe_state.pt``), or weights stored sorted by name (a safetensors
    header, an index) with no other evidence of the order. A layout that
    knows its own cause says it in ``Contents.unmapped``.
    """
    if opt.param_names is not None:
        return None
    if contents.unmapped:
        return contents.unmapped
    if contents.model_order_names:
        return None
    if not contents.weights:
        return "no model weights beside the optimizer state to take the names from"
    if not contents.model_order:
        return "the model's weights are stored sorted by name, not in the model's order"
    return None


def named_by_id(reason: str) -> str:
    """The report's line for state measured under its ids: the one wording of ``reason``."""
    return (f"optimizer state named by parameter id (state.N): {reason}, and the optimizer "
            "stored no param_names (one given model.named_parameters() stores them); names "
            "are never guessed")


def _model_order(contents: Contents, opt: OptimizerState) -> list[str]:
    if contents.model_order_names:
        return list(contents.model_order_names)
    if contents.weights and contents.model_order:
        names, _, _, _ = _untied(contents.weights)
        return names
    where = "its weights are stored sorted by name" if contents.weights else \
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
