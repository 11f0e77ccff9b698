"""Which optimizer wrote a state dict, and which of its quantities the state determines.

An optimizer is recognised by what it keeps per parameter (its state keys)
and by its ``param_groups`` hyperparameters, as torch.optim and transformers
write them. For each ``--what`` quantity (``exp_avg``, ``grad_rms``,
``update``) a kind either says how one parameter's value follows from its
state (a ``Derivation``: the state tensors read and a function of
``core.optimizer_math``) or why the state does not determine it. The math
lives in the core; this module only matches keys and hyperparameters.

| optimizer | exp_avg | grad_rms | update |
| --- | --- | --- | --- |
| Adam, AdamW | yes | yes | yes |
| Adam/AdamW amsgrad | yes | yes (max_exp_avg_sq) | yes (max_exp_avg_sq) |
| NAdam | yes | yes | no: needs the last gradient |
| SparseAdam | yes | yes | no: it steps only the last gradient's rows |
| RAdam | yes | yes | yes (rectified) |
| Adamax | yes | no: exp_inf is an infinity norm | yes |
| Adagrad | no | yes (over all steps) | no: needs the last gradient |
| Adadelta | no | yes (square_avg) | no: needs the last gradient |
| Rprop | no | no | yes: sign(prev) * step_size |
| RMSprop | centered only (grad_avg) | yes | with momentum only |
| SGD, LARS | no | no | momentum in every group, not Nesterov |
| LAMB | no | no | no: a trust ratio of the weights before the step |
| Muon | no | no | no: an orthogonalisation of the momentum |
| Adafactor (torch) | no | yes (factored) | no: needs the last gradient |
| Adafactor (transformers) | no | yes (factored) | with beta1 only |

An update that the lr scales is taken at the lr its param group stores (``Numbers.lr``),
the next step's where a scheduler stepped after the optimizer; a stored 0 or none is a
``Refusal``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from gradclip_cli.core import optimizer_math as om
from gradclip_cli.errors import InputError
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.interface import Derivation, OptimizerState, StoredTensor
from gradclip_cli.source.untrusted import is_number

QUANTITIES = ("exp_avg", "grad_rms", "update")


class Refusal(Exception):
    """The state does not determine this quantity; the message says why."""


@dataclass(frozen=True)
class Kind:
    """One optimizer: its name, what it keeps, and how each quantity follows from it."""

    name: str
    keys: tuple[str, ...]  # what it keeps per parameter, for people
    # quantity -> None when given for every group, else why not
    refusals: Mapping[str, str | None]
    derive: Callable[[str, dict, dict, Numbers], Derivation] | None
    # Its state is made for every parameter when it is built (Adagrad's, step 0), not at
    # the parameter's first step with a gradient.
    state_when_built: bool = False
    # quantity -> what it is under this optimizer's own rule, for the report's "measured:"
    # line, where the general words (``source/what.py``'s ``EXPLAIN``: Adam's) would not say it
    explains: Mapping[str, str] = field(default_factory=dict)

    def gives(self, what: str) -> bool:
        return self.derive is not None and self.refusals.get(what, "") is None

    def why_not(self, what: str) -> str:
        return self.refusals.get(what) or f"{self.name} gives no {what}"


class Numbers:
    """Reads hyperparameters and per-parameter scalars as finite floats, or says where not."""

    def __init__(self, opt: OptimizerState, name: str):
        self.opt, self.name = opt, name

    def __call__(self, value: Any, what: str) -> float:
        if isinstance(value, StoredTensor):
            value = value.read()
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise InputError(f"{self.opt.file}: parameter {self.name}: {what} is "
                                 f"a tensor of {value.numel()} values, not a number")
            value = value.item()
        if not is_number(value) or not math.isfinite(value):
            raise InputError(f"{self.opt.file}: parameter {self.name}: {what} is "
                             f"{quoted(value)}, not a finite number")
        return float(value)

    def step(self, entry: dict) -> float:
        step = self(entry.get("step"), "step")
        if step < 1:
            raise InputError(f"{self.opt.file}: parameter {self.name}: step "
                             f"{step:g}: the state is not an average of anything yet")
        return step

    def betas(self, group: dict) -> tuple[float, float]:
        betas = group.get("betas")
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise InputError(f"{self.opt.file}: the param group of {self.name} has "
                             "no betas (beta1, beta2)")
        b1, b2 = self(betas[0], "beta1"), self(betas[1], "beta2")
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise InputError(f"{self.opt.file}: the param group of {self.name} has "
                             f"betas ({b1}, {b2}) outside [0, 1)")
        return b1, b2

    def eps(self, group: dict) -> float:
        """The group's ``eps``, at least 0 (torch.optim refuses a negative one: under
        ``sqrt(v_hat) + eps`` it would make a step of any size)."""
        eps = self(group.get("eps"), "eps")
        if eps < 0:
            raise InputError(f"{self.opt.file}: the param group of {self.name} has "
                             f"eps {eps!r}, below 0")
        return eps

    def lr(self, group: dict) -> float:
        """The group's stored ``lr``; ``Refusal`` where it is 0 or absent.

        Every common loop (the Hugging Face Trainer, Lightning, torchtitan, a
        ``LambdaLR`` loop) steps its scheduler right after ``optimizer.step()``,
        so the stored lr is the one the next step will use; the last step's is in
        no checkpoint (a ``LambdaLR``'s lambda is not saved). Off by one step of
        the schedule it still gives the step's size, but a stored 0 (a linear or
        cosine schedule's end) would report a last step of 0 that was not taken.
        """
        index = next((i for i, g in enumerate(self.opt.param_groups) if g is group), None)
        which = (f"the param group of {self.name}" if index is None else
                 f"param group {index} (holding {self.name})")
        if group.get("lr") is None:
            raise Refusal(f"{which} stores no lr")
        lr = self(group["lr"], "lr")
        if lr == 0:
            raise Refusal(f"{which} stores lr 0 (a schedule's end or start), and the lr its "
                          "last step used is not in the checkpoint")
        return lr

    def tensor(self, entry: dict, key: str) -> StoredTensor:
        value = entry.get(key)
        if not isinstance(value, StoredTensor):
            raise InputError(f"{self.opt.file}: parameter {self.name} has no "
                             f"{key} while its optimizer keeps one")
        return value


# ----------------------------------------------------------------- the kinds


def _first_moment(entry, group, num, key="exp_avg", beta=None) -> Derivation:
    m = num.tensor(entry, key)
    b1 = num.betas(group)[0] if beta is None else beta
    scale = 1.0 / om.one_minus_power(b1, num.step(entry))
    return Derivation((m,), lambda t: t.to(torch.promote_types(t.dtype, torch.float32)) * scale,
                      tuple(m.shape), scale)


def _rms(entry, group, num, key="exp_avg_sq", beta=None) -> Derivation:
    v = num.tensor(entry, key)
    b2 = num.betas(group)[1] if beta is None else beta
    return Derivation((v,), partial(om.debiased_rms, beta=b2, step=num.step(entry)),
                      tuple(v.shape))


def _adam(what, entry, group, num):
    # torch.optim takes amsgrad per param group: each group's step reads its own.
    second = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
    if what == "exp_avg":
        return _first_moment(entry, group, num)
    if what == "grad_rms":
        return _rms(entry, group, num, second)
    b1, b2 = num.betas(group)
    m, v = num.tensor(entry, "exp_avg"), num.tensor(entry, second)
    # DeepSpeed's and apex's Adam (bias_correction) and transformers' old AdamW
    # (correct_bias) may step without debiasing the moments.
    debias = not any(_off(group.get(k, True)) for k in ("bias_correction", "correct_bias"))
    return Derivation((m, v), partial(om.adam_update, lr=num.lr(group),
                                      beta1=b1, beta2=b2, eps=num.eps(group),
                                      step=num.step(entry), debias=debias),
                      tuple(m.shape))


def _nadam(what, entry, group, num):
    if what == "exp_avg":
        return _first_moment(entry, group, num)
    return _rms(entry, group, num)


def _radam(what, entry, group, num):
    if what == "exp_avg":
        return _first_moment(entry, group, num)
    if what == "grad_rms":
        return _rms(entry, group, num)
    b1, b2 = num.betas(group)
    m, v = num.tensor(entry, "exp_avg"), num.tensor(entry, "exp_avg_sq")
    return Derivation((m, v), partial(om.radam_update, lr=num.lr(group), beta1=b1,
                                      beta2=b2, eps=num.eps(group),
                                      step=num.step(entry)), tuple(m.shape))


def _adamax(what, entry, group, num):
    if what == "exp_avg":
        return _first_moment(entry, group, num)
    m, u = num.tensor(entry, "exp_avg"), num.tensor(entry, "exp_inf")
    return Derivation((m, u), partial(om.adamax_update, lr=num.lr(group),
                                      beta1=num.betas(group)[0], step=num.step(entry)),
                      tuple(m.shape))


def _adagrad(what, entry, group, num):
    s = num.tensor(entry, "sum")
    initial = num(group.get("initial_accumulator_value", 0.0), "initial_accumulator_value")
    return Derivation((s,), partial(om.accumulated_rms, initial=initial, step=num.step(entry)),
                      tuple(s.shape))


def _rmsprop(what, entry, group, num):
    alpha = num(group.get("alpha"), "alpha")
    if what == "exp_avg":
        return _first_moment(entry, group, num, "grad_avg", alpha)
    if what == "grad_rms":
        return _rms(entry, group, num, "square_avg", alpha)
    buf = num.tensor(entry, "momentum_buffer")
    return Derivation((buf,), partial(om.momentum_update, lr=num.lr(group)),
                      tuple(buf.shape))


def _rprop(what, entry, group, num):
    prev, size = num.tensor(entry, "prev"), num.tensor(entry, "step_size")
    return Derivation((prev, size), om.rprop_update, tuple(prev.shape))


def _adadelta(what, entry, group, num):
    # square_avg is RMSprop's, averaged with rho: its debiased root is the gradient's RMS.
    return _rms(entry, group, num, "square_avg", num(group.get("rho"), "rho"))


def _sgd(what, entry, group, num):
    buf = num.tensor(entry, "momentum_buffer")
    return Derivation((buf,), partial(om.momentum_update, lr=num.lr(group)),
                      tuple(buf.shape))


def _adafactor(what, entry, group, num):
    if isinstance(entry.get("row_var"), StoredTensor):
        r, c = num.tensor(entry, "row_var"), num.tensor(entry, "col_var")
        return Derivation((r, c), om.adafactor_rms, (*r.shape[:-1], c.shape[-1]))
    v = num.tensor(entry, "variance")
    return Derivation((v,), om.stored_rms, tuple(v.shape))


def _hf_adafactor(what, entry, group, num):
    if what == "update":
        m = num.tensor(entry, "exp_avg")
        return Derivation((m,), om.as_update, tuple(m.shape))
    if isinstance(entry.get("exp_avg_sq_row"), StoredTensor):
        r, c = num.tensor(entry, "exp_avg_sq_row"), num.tensor(entry, "exp_avg_sq_col")
        return Derivation((r, c), om.hf_adafactor_rms, (*r.shape, c.shape[-1]))
    v = num.tensor(entry, "exp_avg_sq")
    return Derivation((v,), om.stored_rms, tuple(v.shape))


_NEEDS_GRAD = "its last step needs the last gradient itself, which the state does not hold"
# The end of the name of an Adam whose param groups differ in amsgrad (each measured by its
# own rule; ``source/previous.py`` refuses such a pair).
SOME_AMSGRAD = " (AMSGrad in some groups)"
_FACTORED = ("gradient RMS from its second-moment estimate, factored into row and column "
             "averages for a matrix")


def identify(opt: OptimizerState) -> Kind:
    """The optimizer that wrote ``opt``, from its state keys and its groups' hyperparameters."""
    keys: dict[str, None] = {}
    for entry in opt.state.values():
        keys.update(dict.fromkeys(entry))
    tensor_keys = tuple(k for k in keys if k != "step")
    hyper: set[str] = set()
    for group in opt.param_groups:
        hyper.update(group)
    groups = opt.param_groups

    def every(test) -> bool:
        return bool(groups) and all(test(g) for g in groups)

    def kind(name, refusals, derive, **more):
        return Kind(name, tensor_keys, refusals, derive, **more)

    if keys.keys() & {"exp_avg_sq_row", "exp_avg_sq"} and "exp_avg" not in keys \
            or {"scale_parameter", "relative_step"} <= hyper:
        beta1 = every(lambda g: g.get("beta1") is not None)
        return kind("Adafactor (transformers)", {
            "exp_avg": "its exp_avg averages the scaled updates, not the gradients",
            "grad_rms": None,
            "update": None if beta1 else "without beta1 " + _NEEDS_GRAD}, _hf_adafactor,
            explains={"grad_rms": _FACTORED})
    if keys.keys() & {"row_var", "col_var", "variance"} or "beta2_decay" in hyper:
        return kind("Adafactor", {"exp_avg": "it keeps no first moment", "grad_rms": None,
                                  "update": _NEEDS_GRAD}, _adafactor,
                    explains={"grad_rms": _FACTORED})
    if "mu_product" in keys or "momentum_decay" in hyper:
        return kind("NAdam", {"exp_avg": None, "grad_rms": None, "update": _NEEDS_GRAD},
                    _nadam)
    if "exp_inf" in keys:
        return kind("Adamax", {"exp_avg": None, "update": None,
                               "grad_rms": "its exp_inf is an infinity norm, not a second "
                                           "moment"}, _adamax)
    if "sum" in keys or "lr_decay" in hyper:
        return kind("Adagrad", {"exp_avg": "it keeps no first moment", "grad_rms": None,
                                "update": _NEEDS_GRAD}, _adagrad, state_when_built=True,
                    explains={"grad_rms": "gradient RMS over all its steps, "
                                          "sqrt((sum - initial_accumulator_value) / step)"})
    if "acc_delta" in keys or "rho" in hyper:
        return kind("Adadelta", {"exp_avg": "it keeps no first moment (its acc_delta "
                                            "averages the squared steps)",
                                 "grad_rms": None, "update": _NEEDS_GRAD}, _adadelta)
    if {"eta", "mu", "ax"} <= keys.keys() or {"lambd", "t0"} <= hyper:
        return kind("ASGD", {"exp_avg": "it keeps no first moment (its ax averages the weights)",
                             "grad_rms": "it keeps no second moment", "update": _NEEDS_GRAD},
                    None)
    if "old_dirs" in keys or "history_size" in hyper:
        # Its state is the first parameter's alone: flat vectors over every parameter.
        return kind("LBFGS", {
            "exp_avg": "it keeps no first moment", "grad_rms": "it keeps no second moment",
            "update": "one step() takes up to max_iter iterations, and its state holds the "
                      "last one's direction alone"}, None)
    if {"prev", "step_size"} <= keys.keys() or "etas" in hyper:
        return kind("Rprop", {"exp_avg": "it keeps no first moment (its prev is the last "
                                         "gradient, zeroed where its sign flipped)",
                              "grad_rms": "it keeps no second moment", "update": None}, _rprop)
    if "square_avg" in keys or {"alpha", "centered"} <= hyper:
        centered = every(lambda g: bool(g.get("centered")))
        momentum = every(lambda g: _positive(g.get("momentum")))
        return kind("RMSprop", {
            "exp_avg": None if centered else "uncentered, it keeps no first moment",
            "grad_rms": None,
            "update": None if momentum else "without momentum " + _NEEDS_GRAD}, _rmsprop,
            explains={"exp_avg": "gradient average grad_avg / (1 - alpha^step), each "
                                 "parameter's own step",
                      "grad_rms": "gradient RMS, sqrt(square_avg / (1 - alpha^step))"})
    trust = bool(hyper & _TRUST_RATIO)
    if {"exp_avg", "exp_avg_sq"} <= keys.keys() and trust:
        # LAMB (DeepSpeed's, apex's, timm's, torch-optimizer's) keeps Adam's moments but
        # scales Adam's step by a layer's trust ratio |w| / |step|, taken from the
        # weights before the step: the saved weights are those after it.
        return kind("LAMB", {
            "exp_avg": "its moments' averaging and step count are its own",
            "grad_rms": "its moments' averaging and step count are its own",
            "update": "its step is Adam's scaled by a trust ratio of the weights before the "
                      "step, which the checkpoint does not hold"}, None)
    if hyper & {"ns_coefficients", "ns_steps"}:
        # torch.optim.Muon keeps SGD's momentum_buffer, but steps by its orthogonalisation.
        return kind("Muon", {
            "exp_avg": "its momentum is an average kept without a step count to debias it",
            "grad_rms": "it keeps no second moment",
            "update": "its step orthogonalises the momentum (Newton-Schulz iterations in "
                      "bfloat16), which gradclip does not recompute"}, None)
    if {"nesterov", "dampening"} <= hyper or ("momentum_buffer" in keys
                                              and not hyper - _TORCH_GROUP):
        if every(lambda g: not _positive(g.get("momentum"))):
            why = "without momentum SGD keeps no state"
        elif not every(lambda g: _positive(g.get("momentum"))):
            # Their parameters stepped by lr * grad and keep no state: leaving them out
            # would report the other groups' step as the whole.
            why = "some groups use no momentum, whose step needs the last gradient"
        elif every(lambda g: bool(g.get("nesterov"))):
            why = "with Nesterov momentum " + _NEEDS_GRAD
        elif every(lambda g: not g.get("nesterov")):
            why = None
        else:
            why = "some groups use Nesterov momentum, whose step needs the last gradient"
        # LARS (timm's; apex's LARC and torchlars wrap SGD alike) scales the gradient by
        # its trust ratio before SGD's momentum: its step is still lr * buffer.
        return kind("LARS" if trust else "SGD", {
            "exp_avg": "its momentum buffer is a sum, not an average",
            "grad_rms": "it keeps no second moment", "update": why}, _sgd)
    if {"exp_avg", "exp_avg_sq"} <= keys.keys():
        if "maximize" in hyper and not hyper & {"weight_decay", "amsgrad"}:
            # torch.optim.SparseAdam's groups hold lr, betas, eps and maximize alone. Its
            # moments are Adam's, debiased by the parameter's step, but a step moves only
            # the rows its sparse gradient holds (by lr * m_hat / (sqrt(v_hat) +
            # eps / sqrt(1 - beta2^t))), and the state does not record which.
            return kind("SparseAdam", {
                "exp_avg": None, "grad_rms": None,
                "update": "its last step moved only the rows its last (sparse) gradient "
                          "held, which the state does not record"}, _adam)
        if "amsgrad" not in hyper and "decoupled_weight_decay" in hyper:
            return kind("RAdam", dict.fromkeys(QUANTITIES), _radam)
        decoupled = every(lambda g: bool(g.get("decoupled_weight_decay")))
        amsgrad = (" (AMSGrad)" if every(lambda g: bool(g.get("amsgrad"))) else
                   SOME_AMSGRAD if any(g.get("amsgrad") for g in groups) else "")
        return kind(("AdamW" if decoupled else "Adam") + amsgrad, dict.fromkeys(QUANTITIES),
                    _adam)
    held = ", ".join(map(str, tensor_keys)) or "none"  # raw: a refusal's, escaped where shown
    return kind("an unknown optimizer", {q: f"gradclip knows no rule for its state keys ({held})"
                                         for q in QUANTITIES}, None)


# Hyperparameters of trust-ratio optimizers: DeepSpeed's LAMB (max_coeff, min_coeff),
# apex's (use_nvlamb), timm's LAMB and LARS (trust_clip, always_adapt), torch-optimizer's
# (clamp_value).
_TRUST_RATIO = {"max_coeff", "min_coeff", "use_nvlamb", "trust_clip", "always_adapt",
                "clamp_value"}

# What every torch.optim param group holds besides an optimizer's own settings
# (schedulers add initial_lr): a momentum_buffer beside only these is SGD's.
_TORCH_GROUP = {"params", "lr", "initial_lr", "momentum", "weight_decay", "maximize", "foreach",
                "differentiable", "fused", "param_names"}


def _off(value) -> bool:
    """A switch stored as False (or 0)."""
    return isinstance(value, (bool, int)) and not value


def _positive(value) -> bool:
    return is_number(value) and value > 0


def stepped(kind: Kind, entry: dict | None) -> bool:
    """Whether ``kind`` has stepped the parameter whose state is ``entry``: torch.optim makes
    a parameter's state at its first step with a gradient, Adagrad when it is built (a
    parameter that never got a gradient keeps step 0)."""
    if not entry:
        return False
    if not kind.state_when_built:
        return True
    step = entry.get("step")
    if isinstance(step, StoredTensor):
        step = step.read()
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    return not (isinstance(step, (int, float)) and step == 0)


def derive(kind: Kind, what: str, opt: OptimizerState, name: str, entry: dict,
           group: dict) -> Derivation:
    """Parameter ``name``'s ``what`` under ``kind``; ``Refusal`` where its group's settings
    leave it undetermined (an SGD group with Nesterov momentum among plain ones, a stored
    lr of 0: ``Numbers.lr``)."""
    if not kind.gives(what):
        raise Refusal(kind.why_not(what))
    return kind.derive(what, entry, group, Numbers(opt, name))


def holds(kind: Kind) -> str:
    """What ``kind`` keeps per parameter, for people: ``AdamW (exp_avg, exp_avg_sq)``."""
    keys = ", ".join(map(str, kind.keys)) or "empty"  # raw: said in refusals, escaped where shown
    return f"{kind.name} state ({keys})"
