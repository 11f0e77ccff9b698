"""The gradients of one optimizer step, reconstructed from the states before and after it.

Where a checkpoint's Adam-family state is exactly one optimizer step after
another's (the same parameters, shapes and betas; the learning rate may
differ), the gradient that step used is determined: every optimizer below
averages its input into a first moment as ``m_t = beta1 * m_{t-1} + (1 -
beta1) * x_t`` (torch's ``exp_avg.lerp_(grad, 1 - beta1)``), so ``x_t = (m_t
- beta1 * m_{t-1}) / (1 - beta1)``, and its second moment (or Adamax's
infinity norm) must agree with that ``x_t``: the cross-check. The math is
``core/optimizer_math.py``; this module pairs the two states, decides which
rule applies, and refuses (``NotDetermined``, exit 3) where the pair does not
determine the gradient.

Per optimizer (torch.optim; ``x_t`` the first moment's input, ``p_{t-1}`` PREV's
weights, ``wd`` the L2 weight decay):

* AdamW, and Adam/NAdam/RAdam with ``decoupled_weight_decay``: ``g = x_t``;
  checked against ``exp_avg_sq``;
* Adam, NAdam, RAdam with L2 weight decay: ``g = x_t - wd * p_{t-1}``;
  checked against ``exp_avg_sq``;
* AMSGrad: as without (``max_exp_avg_sq`` plays no part in ``g``); also
  checked: ``max_exp_avg_sq_t = max(max_exp_avg_sq_{t-1}, v_t)`` exactly;
* Adamax: ``g = x_t - wd * p_{t-1}``; checked against
  ``exp_inf_t = max(beta2 * exp_inf_{t-1}, |x_t| + eps)``;
* RMSprop with ``centered=True``: ``g = x_t - wd * p_{t-1}`` from ``grad_avg``
  (beta ``alpha``); checked against ``square_avg``;
* ``maximize=True``: the negation of the above;
* every other optimizer: refused, for the reason ``REFUSED`` gives.

Fused and foreach variants compute the same moments, so the same rule holds.
The gradient is the one the optimizer saw: after any clipping (the Hugging
Face Trainer clips before ``optimizer.step()``) and after a ``GradScaler``'s
unscaling; a ``GradScaler`` step skipped for an inf leaves the step counter
where it was, and the pair is refused as not consecutive.

Layouts need no code of their own: the states come from ``Contents.optimizers``
and are named by ``source.naming.map_names``, as ``--what exp_avg`` names them.

For other commands (``autopsy``): ``reconstruct(curr, prev)`` gives a
``Reconstruction`` or raises ``NotDetermined``; ``gradients_between(curr,
prev)`` gives the gradients as float64 tensors with the cross-check, or the
refusal's reason, without raising.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from gradclip_cli.core import optimizer_math as om
from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import optimizers, roles
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import Contents, Derivation, OptimizerState, StoredTensor
from gradclip_cli.source.naming import (
    AMBIGUOUS,
    AmbiguousOrder,
    Model,
    by_ids,
    ids_reason,
    map_names,
)
from gradclip_cli.source.what import Selection, named_by_id, optimizer_state, report_order

# The cross-check's bound, in units of the state's rounding (unit roundoff: 2^-24 for
# float32 state, 2^-8 for bfloat16): torch's moment updates keep the residual below 9
# units (core.optimizer_math.second_moment_residual; docs/guides/previous.md counts
# them); implementations that order the operations otherwise (fused kernels, FMAs,
# DeepSpeed's CPU Adam) may add a few. A pair that is not one step of one optimizer
# disagrees by about 1/unit (1.7e7 units in float32, 256 in bfloat16), so the margin
# costs no power to tell them apart.
CHECK_BOUND = 32.0

EXPLAIN = ("gradients of optimizer step {step} as the optimizer saw them (after any "
           "clipping and loss-scale unscaling)")
EVIDENCE = "reconstructed from the {kind} states of steps {before} and {after} in {prev} and {curr}"

# Optimizers whose pair of states does not determine the gradient, and why.
REFUSED = {
    "SparseAdam": "its moments move only on the rows its sparse gradient held, and the state "
                  "does not record which",
    "SGD": "it keeps no step counter, so the pair cannot be shown one step apart (and its "
           "first step stores the gradient itself, not an average)",
    "LARS": "it keeps no step counter, and scales the gradient by a trust ratio first",
    "Adagrad": "its sum accumulates g**2 alone: the sign of the gradient is lost",
    "Adadelta": "its square_avg averages g**2 alone: the sign of the gradient is lost",
    "Adafactor": "its factored second moment averages g**2 by rows and columns: the gradient "
                 "is lost",
    "Adafactor (transformers)": "its exp_avg averages the scaled updates, and its second "
                                "moment is factored: the gradient is lost",
    "LAMB": "its moments' averaging and step count are its own, which gradclip does not model",
    "Muon": "its momentum is kept without a step counter",
    "Rprop": "its prev is the gradient's sign history, zeroed where the sign flipped",
    "ASGD": "it keeps no average of the gradient",
    "LBFGS": "one step() takes several iterations; its state holds the last one's alone",
}


class NotDetermined(InputError):
    """The pair does not determine the gradient; the message says why and names the files."""


@dataclass(frozen=True)
class Rule:
    """How one optimizer's pair of states gives the gradient: the state key of its first
    moment, the key its cross-check reads, and AMSGrad's running maximum, if any."""

    first: str
    check: str  # "exp_avg_sq" | "square_avg" | "exp_inf"
    running_max: str | None = None
    beta_key: str = "betas"  # RMSprop's: "alpha"
    decouples: bool = True  # the optimizer has a decoupled weight decay option


def rule_of(kind: optimizers.Kind, groups: list[dict]) -> Rule | str:
    """The rule for ``kind``, or why its pair does not determine the gradient."""
    name = kind.name
    if name.endswith(optimizers.SOME_AMSGRAD):
        return "some groups use AMSGrad and some do not"
    if name in ("Adam", "AdamW", "NAdam", "RAdam"):
        return Rule("exp_avg", "exp_avg_sq")
    if name in ("Adam (AMSGrad)", "AdamW (AMSGrad)"):
        return Rule("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    if name == "Adamax":
        return Rule("exp_avg", "exp_inf", decouples=False)
    if name == "RMSprop":
        if groups and all(g.get("centered") for g in groups):
            return Rule("grad_avg", "square_avg", beta_key="alpha", decouples=False)
        return "uncentered, its square_avg averages g**2 alone: the sign of the gradient is lost"
    return REFUSED.get(name, f"gradclip knows no rule that gives its gradient "
                             f"({optimizers.holds(kind)})")


@dataclass
class Disagreement:
    """The cross-check's outcome: the largest residual in units of the state's rounding
    (``core.optimizer_math.second_moment_residual``), where, and the bound."""

    max_units: float
    tensor: str | None
    unit: float
    check: str  # what was checked, for people
    bound: float = CHECK_BOUND
    per_tensor: dict[str, float] = field(default_factory=dict)

    @property
    def within(self) -> bool:
        return self.max_units <= self.bound

    def sentence(self) -> str:
        where = f", largest at {visible(self.tensor)}" if self.tensor and self.max_units else ""
        return (f"cross-check: {self.check} agrees with the reconstructed gradients to "
                f"{self.max_units:.3g} units of the state's rounding ({self.unit:.3g}) at most"
                f"{where}; the bound is {self.bound:g} units")

    def as_json(self) -> dict:
        return {"metric": "max over elements of |residual| / (unit * scale of its terms)",
                "check": self.check, "max_units": self.max_units, "bound_units": self.bound,
                "unit": self.unit, "tensor": self.tensor, "summary": self.sentence()}


@dataclass
class Reconstruction:
    """The gradients of one optimizer step as derivations of the two states' tensors.

    ``derivations[i]`` gives ``names[i]``'s gradient (float64) from CURR's and
    PREV's stored tensors, ``checks[i]`` its cross-check residual in units of
    the state's rounding; ``weights[i]`` is PREV's weight (the weights the
    gradient was taken at), for ``ratio``. ``steps``: CURR's step counter per
    name. ``idle``: parameters whose state did not move (no gradient that step).
    """

    kind: str
    names: list[str]
    derivations: list[Derivation]
    checks: list[Derivation]
    weights: list[StoredTensor | None]
    steps: list[float]
    idle: list[str]
    unit: float
    check: str
    curr: str
    prev: str
    rule: str
    # Where the state is named by parameter id (state.N): why (``what.named_by_id``).
    ids_note: str | None = None

    @property
    def state_dtypes(self) -> list[str]:
        """The dtypes the first moments are stored in (``float32``, ``bfloat16``): they set
        how close the reconstruction is (docs/guides/previous.md, "How close")."""
        found = {str(d.reads[0].dtype).removeprefix("torch."): None for d in self.derivations}
        return list(found)

    @property
    def step(self) -> int:
        return int(max(self.steps)) if self.steps else 0

    @property
    def evidence(self) -> str:
        t = self.step
        return EVIDENCE.format(kind=self.kind, before=t - 1, after=t, prev=self.prev,
                               curr=self.curr)

    def disagreement(self, device: torch.device | None = None,
                     on_batch: Callable | None = None, workers: int = 1) -> Disagreement:
        """Run the cross-check (reads both states once more); ``NotDetermined`` beyond
        ``CHECK_BOUND``."""
        from gradclip_cli.measuring import power_sums

        sums = power_sums(self.checks, float("inf"), device, on_batch, workers)
        per = [float(x) for x in sums.norm]
        worst = max(range(len(per)), key=per.__getitem__) if per else None
        found = Disagreement(per[worst] if per else 0.0,
                             None if worst is None else self.names[worst], self.unit,
                             self.check, per_tensor=dict(zip(self.names, per)))
        if not found.within:
            raise NotDetermined(
                f"{self.curr}, {self.prev}: {self.check} disagrees with the gradient the first "
                f"moments give by {found.max_units:.3g} units of the state's rounding at "
                f"{found.tensor} (bound {CHECK_BOUND:g}): the two states are not one "
                f"{self.kind} step apart")
        return found

    def gradients(self) -> dict[str, torch.Tensor]:
        """Every reconstructed gradient, float64 (complex128), read whole."""
        return {n: d.compute(*(t.read() for t in d.reads))
                for n, d in zip(self.names, self.derivations)}

    def selection(self, disagreement: Disagreement) -> Selection:
        """What ``inspect`` measures: the gradients, with the evidence and the check."""
        described = [StoredTensor(n, d.shape, torch.complex128 if d.reads[0].dtype.is_complex
                                  else torch.float64, ())
                     for n, d in zip(self.names, self.derivations)]
        weights = self.weights if all(w is not None for w in self.weights) else None
        return Selection(
            what="grads", names=list(self.names), tensors=described, ties={}, skipped=[],
            key="", explain=EXPLAIN.format(step=self.step), derivations=list(self.derivations),
            weights=weights, evidence=self.evidence, ids_note=self.ids_note)


@dataclass
class Reconstructed:
    """``gradients_between``'s answer: the gradients and the check, or why not."""

    gradients: dict[str, torch.Tensor] | None
    disagreement: Disagreement | None
    refusal: str | None
    reconstruction: Reconstruction | None = None


def gradients_between(curr: Contents, prev: Contents) -> Reconstructed:
    """The gradients of CURR's last optimizer step, from CURR's and PREV's states
    (``Contents`` as ``source.layouts.open_checkpoint`` gives them), checked; or
    the reason the pair does not determine them. Never raises for a pair that
    does not fit: the reason is ``refusal``."""
    try:
        rec = reconstruct(curr, prev)
        found = rec.disagreement()
    except InputError as error:
        return Reconstructed(None, None, str(error))
    return Reconstructed(rec.gradients(), found, None, rec)


# ----------------------------------------------------------------- pairing


def reconstruct(curr: Contents, prev: Contents) -> Reconstruction:
    """Pair CURR's optimizer state with PREV's, one step before it; ``NotDetermined``
    (exit 3) naming why and the files where the pair does not determine the gradient."""
    files = f"{curr.path}, {prev.path}"

    def refuse(why: str) -> NotDetermined:
        return NotDetermined(f"{files}: --previous: {why}")

    states = []
    for contents in (curr, prev):
        opt = optimizer_state(contents)
        if opt is None:
            why = contents.missing.get(roles.OPTIMIZER_STATE) or "it holds no optimizer state"
            raise NotDetermined(f"{contents.path}: --previous: {why}; the gradients are "
                                "reconstructed from two optimizer states")
        if isinstance(opt, str):
            raise NotDetermined(f"{contents.path}: --previous: {opt}")
        states.append(opt)
    opt, opt_prev = states
    kind = optimizers.identify(opt)
    # Before its first step an optimizer holds no per-parameter state, only its groups
    # (PREV saved at step 0): nothing to tell it from CURR's by, and nothing to differ.
    kind_prev = optimizers.identify(opt_prev) if opt_prev.state else kind
    if kind.name != kind_prev.name:
        raise refuse(f"the optimizers differ ({kind.name} in {curr.path}, {kind_prev.name} in "
                     f"{prev.path})")
    rule = rule_of(kind, opt.param_groups)
    if isinstance(rule, str):
        raise refuse(f"{kind.name}: {rule}")
    model = Model.of(curr)
    try:
        names, reason = map_names(opt, model), ids_reason(opt, model)
    except AmbiguousOrder:
        # No one placement by shape: the state under its ids, as --what exp_avg measures it
        # (names are never guessed); PREV is paired id by id where its groups are CURR's.
        names, reason = by_ids(opt), AMBIGUOUS
    if not opt_prev.state and (other := _other_shape(curr, prev, names.values())):
        raise refuse(other)
    # Before its first step no state places PREV's parameters by shape (groups that split
    # the model's order, decay and no-decay, fit it several ways); the same groups of the
    # same ids are CURR's parameters.
    if _stateless_twin(opt_prev, opt, prev, names.values()):
        names_prev = names
    elif reason == AMBIGUOUS:
        if not _same_groups(opt_prev, opt):
            raise refuse(f"{curr.path}'s optimizer state is named by parameter id ({AMBIGUOUS}"
                         f"), and the param groups of {prev.path} hold other ids: the two "
                         "cannot be paired id by id")
        names_prev = by_ids(opt_prev)
    else:
        try:
            names_prev = map_names(opt_prev, Model.of(prev))
        except AmbiguousOrder:
            # CURR's placement is one; PREV's state (a parameter without a gradient yet)
            # fits several: the same groups of the same ids are CURR's parameters.
            if not _same_groups(opt_prev, opt):
                raise
            names_prev = names
    if reason != AMBIGUOUS and _same_groups(opt_prev, opt):
        names_prev = _unplaced_from(names_prev, names, opt_prev, prev)
    by_name_prev = {n: pid for pid, n in names_prev.items()}
    group_of = {pid: g for g in opt.param_groups for pid in g["params"]}
    group_of_prev = {pid: g for g in opt_prev.param_groups for pid in g["params"]}
    held = set(names.values())
    missing = [n for n in names.values() if n not in by_name_prev]
    extra = [n for n in names_prev.values() if n not in held]
    if missing or extra:
        where, which = (prev.path, missing[0]) if missing else (curr.path, extra[0])
        raise refuse(f"the parameters differ: {where}'s optimizer holds no parameter "
                     f"{which}")

    out = _Builder(curr, prev, kind.name, rule, refuse)
    out.ids_note = None if reason is None else named_by_id(reason)
    order = report_order(curr, list(names.values()))
    for pid, name in sorted(names.items(), key=lambda item: order.get(item[1], len(order))):
        pid_prev = by_name_prev[name]
        out.add(name, opt, opt.state.get(pid), group_of[pid], opt_prev,
                opt_prev.state.get(pid_prev), group_of_prev[pid_prev])
    return out.finish()


class _Builder:
    """Collects each parameter's derivations, checking the pair as it goes."""

    def __init__(self, curr: Contents, prev: Contents, kind: str, rule: Rule, refuse):
        self.curr, self.prev, self.kind, self.rule, self.refuse = curr, prev, kind, rule, refuse
        self.names: list[str] = []
        self.derivations: list[Derivation] = []
        self.checks: list[Derivation] = []
        self.weights: list[StoredTensor | None] = []
        self.steps: list[float] = []
        self.idle: list[str] = []
        self.units: set[float] = set()
        self.ids_note: str | None = None

    def add(self, name: str, opt: OptimizerState, entry: dict | None, group: dict,
            opt_prev: OptimizerState, entry_prev: dict | None, group_prev: dict) -> None:
        rule, refuse = self.rule, self.refuse
        if not entry:
            if entry_prev:
                raise refuse(f"parameter {name} has optimizer state in "
                             f"{self.prev.path} but none in {self.curr.path}")
            return  # never stepped in either: no gradient to give
        num, num_prev = optimizers.Numbers(opt, name), optimizers.Numbers(opt_prev, name)
        t = num.step(entry)
        first = num.tensor(entry, rule.first)
        if entry_prev:
            t_prev = num_prev(entry_prev.get("step"), "step")
            first_prev = num_prev.tensor(entry_prev, rule.first)
        else:
            # torch makes a parameter's state at its first step with a gradient: before
            # it, the moments are zeros and the step 0.
            t_prev, first_prev = 0.0, None
        if t == t_prev:
            self.idle.append(name)  # skipped by the optimizer: no gradient that step
            return
        if t != t_prev + 1:
            raise refuse(_apart(name, t, t_prev, self.curr.path, self.prev.path))
        self._same_settings(name, group, group_prev)
        beta1, beta2 = self._betas(num, group)
        shape = tuple(first.shape)
        checked = num.tensor(entry, rule.check)
        reads_prev = [first_prev, num_prev.tensor(entry_prev, rule.check) if entry_prev
                      else None]
        if rule.running_max:
            reads_prev.append(num_prev.tensor(entry_prev, rule.running_max) if entry_prev
                              else None)
        currs = [first, checked] + ([num.tensor(entry, rule.running_max)]
                                    if rule.running_max else [])
        for key, stored, before in zip((rule.first, rule.check, rule.running_max), currs,
                                       reads_prev):
            if tuple(stored.shape) != shape:
                raise InputError(f"{self.curr.path}: parameter {name}: "
                                 f"{key} {list(stored.shape)} and "
                                 f"{rule.first} {shape} differ in shape")
            if before is not None and tuple(before.shape) != shape:
                raise refuse(f"parameter {name} has shape {list(before.shape)} in "
                             f"{self.prev.path} and {list(shape)} in {self.curr.path}")
        if first_prev is None:
            reads_prev = [_zeros(s) for s in (first, checked)]
            if rule.running_max:
                reads_prev.append(_zeros(num.tensor(entry, rule.running_max)))
        weight = self._weight(name)
        decay = self._l2(name, num, group)
        if decay and weight is None and self.ids_note is not None:
            raise refuse(f"parameter {visible(name)}: {self.kind}'s weight decay {decay:g} "
                         "enters its moments as decay * weights before the step, and the "
                         "state is named by parameter id: which of the weights in "
                         f"{self.prev.path} is its is not known")
        if decay and weight is None:
            raise refuse(f"parameter {name}: {self.kind}'s weight decay "
                         f"{decay:g} enters its moments as decay * weights before the step, "
                         f"and {self.prev.path} holds no weights for it")
        if weight is not None and tuple(weight.shape) != shape:
            if decay:
                raise refuse(f"parameter {name}: the weight in {self.prev.path} has "
                             f"shape {list(weight.shape)}, its state {list(shape)}")
            weight = None  # held otherwise (a fused parameter): no ratio, nothing else
        maximize = bool(group.get("maximize"))
        gradient = partial(om.adam_gradient, beta1=beta1, weight_decay=decay, maximize=maximize)
        reads = (first, reads_prev[0], *([weight] if decay else []))
        self.derivations.append(Derivation(reads, gradient, shape))
        unit = max(om.unit_roundoff(s.dtype) for s in (first, checked))
        tiny = max(om.smallest_subnormal(s.dtype) for s in (first, checked))
        self.units.add(unit)
        self.checks.append(self._check(num, group, beta1, beta2, unit, tiny, first, checked,
                                       entry, reads_prev))
        self.names.append(name)
        self.weights.append(weight)
        self.steps.append(t)

    def _check(self, num, group, beta1, beta2, unit, tiny, first, checked, entry, reads_prev):
        rule = self.rule
        if rule.check == "exp_inf":
            eps = num(group.get("eps"), "eps")
            compute = partial(om.infinity_norm_residual, beta1=beta1, beta2=beta2, eps=eps,
                              unit=unit, tiny=tiny)
            return Derivation((first, reads_prev[0], checked, reads_prev[1]), compute,
                              tuple(first.shape))
        second = partial(om.second_moment_residual, beta1=beta1, beta2=beta2, unit=unit,
                         tiny=tiny)
        if rule.running_max is None:
            return Derivation((first, reads_prev[0], checked, reads_prev[1]), second,
                              tuple(first.shape))
        running = num.tensor(entry, rule.running_max)

        def both(m, mp, v, vp, mx, mxp):
            return torch.maximum(second(m, mp, v, vp), om.running_max_residual(mx, mxp, v))

        return Derivation((first, reads_prev[0], checked, reads_prev[1], running,
                           reads_prev[2]), both, tuple(first.shape))

    def _betas(self, num: optimizers.Numbers, group: dict) -> tuple[float, float]:
        if self.rule.beta_key == "alpha":
            alpha = num(group.get("alpha"), "alpha")
            if not 0 <= alpha < 1:
                raise InputError(f"{num.opt.file}: RMSprop alpha {alpha} outside [0, 1)")
            return alpha, alpha
        return num.betas(group)

    def _same_settings(self, name: str, group: dict, group_prev: dict) -> None:
        """The settings the rule reads must be the same in both states: a changed beta
        means the averages are not one optimizer's."""
        keys = [self.rule.beta_key, "maximize", "decoupled_weight_decay", "amsgrad",
                "centered"]
        if self._l2_key_matters(group) or self._l2_key_matters(group_prev):
            keys.append("weight_decay")
        for key in keys:
            a, b = group.get(key), group_prev.get(key)
            if _plain(a) != _plain(b):
                raise self.refuse(f"{key} differs for parameter {name}: "
                                  f"{quoted(_plain(b))} in {self.prev.path}, "
                                  f"{quoted(_plain(a))} in {self.curr.path}")

    def _l2_key_matters(self, group: dict) -> bool:
        return not _decoupled(group, self.rule)

    def _l2(self, name: str, num: optimizers.Numbers, group: dict) -> float:
        """The L2 weight decay that entered the moments (0 for decoupled decay)."""
        decay = num(group.get("weight_decay", 0.0), "weight_decay")
        if decay == 0.0 or _decoupled(group, self.rule):
            return 0.0
        if self.rule.decouples and not any(k in group for k in _DECOUPLING_KEYS):
            raise self.refuse(
                f"parameter {name}: weight_decay {decay:g} with no record of whether "
                f"it was decoupled (AdamW) or added to the gradient (Adam): the groups of "
                f"{self.curr.path} store neither decoupled_weight_decay nor adam_w_mode, and "
                "the two rules give different gradients")
        return decay

    def _weight(self, name: str) -> StoredTensor | None:
        """PREV's weight of ``name``: the weights the step's gradient was taken at."""
        weights = self.prev.weights or {}
        return weights.get(name, self.prev.fused_weights.get(name))

    def finish(self) -> Reconstruction:
        if not self.names:
            if self.idle:
                raise self.refuse("no optimizer step between them: every parameter's step "
                                  "counter is the same in both (the same checkpoint twice, "
                                  "or a step a GradScaler skipped)")
            raise self.refuse("no parameter has optimizer state")
        check = {"exp_avg_sq": "exp_avg_sq", "square_avg": "square_avg",
                 "exp_inf": "exp_inf"}[self.rule.check]
        if self.rule.running_max:
            check += " (and max_exp_avg_sq)"
        return Reconstruction(
            kind=self.kind, names=self.names, derivations=self.derivations, checks=self.checks,
            weights=self.weights, steps=self.steps, idle=self.idle, unit=max(self.units),
            check=check, curr=str(self.curr.path), prev=str(self.prev.path),
            rule=self.rule.first, ids_note=self.ids_note)


# Group keys that say whether weight decay is decoupled: torch's decoupled_weight_decay
# (Adam, AdamW, NAdam, RAdam since 2.x), DeepSpeed's and apex's adam_w_mode, and
# transformers' own AdamW (correct_bias: always decoupled).
_DECOUPLING_KEYS = ("decoupled_weight_decay", "adam_w_mode", "correct_bias")


def _decoupled(group: dict, rule: Rule) -> bool:
    if not rule.decouples:
        return False
    return bool(group.get("decoupled_weight_decay")) or bool(group.get("adam_w_mode")) \
        or "correct_bias" in group


def _plain(value):
    """A group setting as a comparable Python value (a 0-dim tensor beta is a number)."""
    if isinstance(value, StoredTensor):
        value = value.read()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def _same_groups(opt_prev: OptimizerState, opt: OptimizerState) -> bool:
    """The same param groups of the same ids in both states (one run's optimizer)."""
    return [list(g["params"]) for g in opt_prev.param_groups] == \
        [list(g["params"]) for g in opt.param_groups]


def _unplaced_from(names_prev: dict[int, str], names: dict[int, str],
                   opt_prev: OptimizerState, prev: Contents) -> dict[int, str]:
    """PREV's names with its stateless parameters named as CURR names the same ids.

    A parameter with no state in PREV (no gradient before CURR's step) has no shape
    there, so where the groups split the model's order it fits several places and
    stays unplaced (``naming.map_names``); with the same groups of the same ids (one
    run's optimizer) it is CURR's parameter of that id, where PREV's weights (if held)
    have that name and no other id of PREV already carries it."""
    taken = set(names_prev.values())
    weights = prev.weights
    out = dict(names_prev)
    for pid, name in names.items():
        if pid in out or opt_prev.state.get(pid) or name in taken:
            continue
        if weights and name not in weights and name not in prev.fused_weights:
            continue
        out[pid] = name
    return dict(sorted(out.items()))


def _stateless_twin(opt_prev: OptimizerState, opt: OptimizerState, prev: Contents,
                    names) -> bool:
    """PREV's optimizer before its first step: no per-parameter state, the same groups of
    the same ids as CURR's, and PREV's weights (where it has them) under CURR's names."""
    if opt_prev.state or not _same_groups(opt_prev, opt):
        return False
    weights = prev.weights
    return not weights or all(n in weights or n in prev.fused_weights for n in names)


def _other_shape(curr: Contents, prev: Contents, names) -> str | None:
    """A parameter whose weights differ in shape between the two checkpoints: before its
    first step PREV's optimizer holds no state to compare, its weights do."""
    now, before = curr.weights or {}, prev.weights or {}
    for name in names:
        if name in now and name in before and tuple(now[name].shape) != \
                tuple(before[name].shape):
            return (f"parameter {name} has shape {list(before[name].shape)} in "
                    f"{prev.path} and {list(now[name].shape)} in {curr.path}")
    return None


def _zeros(like: StoredTensor) -> StoredTensor:
    return StoredTensor.whole(like.name, torch.zeros(like.shape, dtype=like.dtype))


def _apart(name: str, t: float, t_prev: float, curr, prev) -> str:
    """Why a pair of steps other than t-1 and t gives no single gradient, and what it gives."""
    if t < t_prev:
        return (f"parameter {name} is at step {t:g} in {curr} and {t_prev:g} in "
                f"{prev}: give the earlier checkpoint as --previous")
    k = t - t_prev
    return (f"parameter {name} is at step {t_prev:g} in {prev} and {t:g} in {curr}, "
            f"{k:g} optimizer steps apart: such a pair determines only a weighted sum of "
            f"those {k:g} gradients, (m_t - beta1^{k:g} m_(t-{k:g})) / (1 - beta1) = "
            f"sum of beta1^j g_(t-j) over j < {k:g}, no single step's gradient")
