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
from the model's order group by group (``source/naming.py``).
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from gradclip_cli.core import Elements
from gradclip_cli.errors import InputError, UsageError
from gradclip_cli.source import naming, optimizers, roles
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
        if _gives(contents, what) and undetermined(contents, what) is None:
            found.append(what)
    if contents.weights:
        found.append("weights")
    return found


def undetermined(contents: Contents, what: str) -> str | None:
    """Why this checkpoint's state does not give ``what``, an optimizer quantity its
    optimizer's rule gives (a param group's stored lr 0, corrupt state), as one raw line
    naming the file; None where it does, or where the rule never gives it."""
    if not _gives(contents, what):
        return None
    try:
        _from_optimizer(contents, what, offer=False)
    except InputError as error:
        return str(error)
    return None


def _keyed(contents: Contents, what: str) -> list[str]:
    """Where several optimizers are measured as one by no rule (different kinds), each
    that a ``--key`` names alone, as the flags that measure it: ``--key optimizer_g``
    (``--key optimizer_states.0`` in Lightning's list) where it gives ``what``, else
    ``--key optimizer_d --what update`` per quantity it gives (each one tried, as
    ``available`` does)."""
    if not isinstance(optimizer_state(contents), str):
        return []
    offers = []
    for opt in contents.optimizers:
        if opt.key is None:
            continue
        alone = dataclasses.replace(contents, optimizers=(opt,))
        gives = [w for w in available(alone) if w in optimizers.QUANTITIES]
        flag = f"--key {shlex.quote(opt.key)}"
        offers += [flag] if what in gives else [f"{flag} --what {w}" for w in gives]
    return offers


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
    offer = [f"--what {w}" for w in available(contents) if w != what]
    offer += _keyed(contents, what)
    options = ", ".join(offer) if offer else "nothing gradclip measures"
    held = holdings(contents)
    keys = held[held.find("("):] if "(" in held else held
    held = "" if not contents.optimizers or keys in why else f"it holds {held}; "
    return InputError(f"{path}: --what {what}: {why}; {held}available: {options}")


# ----------------------------------------------------------------- grads, weights


def _raw(contents: Contents, what: str, gradients_only: bool = False) -> Selection:
    source = contents.gradients if what == "grads" else contents.weights
    if not source:
        error = contents.missing.get(roles.GRADIENT)
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
    names, tensors, ties, elements = naming.untied(source)
    weights = None
    if what == "grads" and contents.weights and contents.weights is not contents.gradients:
        weights = [contents.weights.get(n) for n in names]
    role = roles.GRADIENT if what == "grads" else roles.WEIGHT
    explain = EXPLAIN[what]
    if what == "weights" and contents.weights_of:
        explain = f"{contents.weights_of} weights, not the model's"
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


# ----------------------------------------------------------------- optimizer state


@dataclass
class _Param:
    name: str
    state: dict
    group: dict


def _from_optimizer(contents: Contents, what: str, offer: bool = True) -> Selection:
    """``offer``: a refusal lists what else is available (False: ``available`` is asking)."""
    opt = optimizer_state(contents)
    if opt is None:
        raise _unavailable(
            contents, what,
            contents.missing.get(roles.OPTIMIZER_STATE) or "the checkpoint holds no optimizer state"
        )
    if isinstance(opt, str):
        raise _unavailable(contents, what, opt)
    kind = optimizers.identify(opt)
    if not kind.gives(what):
        raise _unavailable(contents, what, f"{kind.name}: {kind.why_not(what)}")
    model = naming.Model.of(contents)
    reason = None
    try:
        names = naming.map_names(opt, model)
    except naming.AmbiguousOrder:
        # No one placement: the ids are the names, as with no order at all (the
        # totals do not depend on them), never a guess among the placements.
        names, reason = naming.by_ids(opt), naming.AMBIGUOUS
    except InputError as error:
        # No optimizer quantity can be named here: offer what needs no mapping.
        offer = [w for w, held in (("grads", contents.gradients), ("weights", contents.weights))
                 if held]
        if not offer:
            raise
        raise InputError(f"{error}; available: "
                         + ", ".join(f"--what {w}" for w in offer)) from None
    if len(set(names.values())) < len(names):
        twice = next(n for n in names.values() if list(names.values()).count(n) > 1)
        raise InputError(f"{contents.path}: two of its {len(contents.optimizers)} optimizers "
                         f"hold parameter {twice}: they are not one training's parts")
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
            if not offer:
                raise InputError(f"{contents.path}: {kind.name} {what}: {refusal}") from None
            raise _unavailable(contents, what, f"{kind.name}: {refusal}") from None
        for t in d.reads[1:]:
            if tuple(d.reads[0].shape) == d.shape and tuple(t.shape) != d.shape:
                raise InputError(
                    f"{opt.file}: parameter {p.name}: {_key_of(d.reads[0])} "
                    f"{list(d.shape)} and {_key_of(t)} {list(t.shape)} differ in "
                    "shape")
        weight = contents.weights.get(p.name) if contents.weights else None
        if weight is not None and tuple(weight.shape) != d.shape:
            raise InputError(f"{opt.file}: parameter {p.name}: "
                             f"{_key_of(d.reads[0])} implies shape {list(d.shape)}, "
                             f"which does not fit the weight's shape {list(weight.shape)}")
        derived.append(d)
    described = [d.reads[0] if d.scale is not None or tuple(d.reads[0].shape) == d.shape
                 else StoredTensor(p.name, d.shape, d.reads[0].dtype, ())
                 for p, d in zip(params, derived)]

    weights = None
    if contents.weights:
        weights = [contents.weights.get(p.name, contents.fused_weights.get(p.name)) for p in params]
    reason = reason or naming.ids_reason(opt, model)
    return Selection(
        what=what, names=[p.name for p in params], tensors=described, ties={}, skipped=[],
        key="", explain=f"{kind.name} {kind.explains.get(what, EXPLAIN[what])}",
        derivations=derived, weights=weights,
        evidence=contents.evidence.get(roles.OPTIMIZER_STATE, f"the {contents.kind} layout"),
        optimizer=kind.name,
        ids_note=None if reason is None else named_by_id(reason),
    )


def _key_of(t: StoredTensor) -> str:
    return t.name.split(".", 1)[1] if "." in t.name else t.name


def report_order(contents: Contents, names: list[str]) -> dict[str, int]:
    """Name -> position in the report: the model's parameter order where the checkpoint
    knows it (``Contents.order``), else the order of ``names``."""
    return {n: i for i, n in enumerate(contents.order or names)}


def named_by_id(reason: str) -> str:
    """The report's line for state measured under its ids: the one wording of ``reason``."""
    return (f"optimizer state named by parameter id (state.N): {reason}, and the optimizer "
            "stored no param_names (one given model.named_parameters() stores them); names "
            "are never guessed")


