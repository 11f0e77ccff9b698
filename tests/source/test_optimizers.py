"""Each optimizer's quantities from its saved state, checked against the optimizer itself.

Every case runs a real optimizer (torch.optim, transformers' Adafactor) for a
few steps in float64 and keeps every gradient it was given. Then:

* ``update``: the step the saved state implies is compared with the change
  the optimizer made to the parameters in its last step (decoupled weight
  decay taken out);
* ``exp_avg`` and ``grad_rms``: compared with the debiased exponential
  averages of the recorded gradients, computed here from the gradients alone
  (never from the optimizer's state);
* a quantity the state does not determine is a ``Refusal`` naming why.
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from gradclip_cli.source import optimizers
from gradclip_cli.source.layouts.torch_optim import optimizer_state

STEPS = 4
TOL = 1e-10  # float64 throughout: the only differences are rounding


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 3)).double()


def _run(make, steps: int = STEPS):
    """Train ``steps`` steps; the state, each parameter's gradients, and its last change."""
    model = _model()
    opt = make(model.parameters())
    params = list(model.parameters())
    grads: list[list[torch.Tensor]] = [[] for _ in params]
    before = None
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        for i, p in enumerate(params):
            grads[i].append(p.grad.detach().clone())
        before = [p.detach().clone() for p in params]
        opt.step()
    after = [p.detach().clone() for p in params]
    state = optimizer_state(opt.state_dict(), None, "test")
    return state, params, grads, before, after


def _derived(state, what: str) -> list[torch.Tensor]:
    kind = optimizers.identify(state)
    out = []
    for group in state.param_groups:
        for pid in group["params"]:
            d = optimizers.derive(kind, what, state, str(pid), state.state[pid], group)
            out.append(d.compute(*(t.read() for t in d.reads)))
    return out


def _ema(values: list[torch.Tensor], beta: float) -> torch.Tensor:
    """The debiased exponential average ``sum (1-b) b^(t-k) x_k / (1 - b^t)``."""
    t = len(values)
    total = sum((1 - beta) * beta ** (t - 1 - k) * v for k, v in enumerate(values))
    return total / (1 - beta**t)


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        scale = float(w.abs().max())
        assert float((g - w).abs().max()) <= TOL * max(scale, 1e-300), (g, w)


ADAM_LIKE = {
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.9)),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1),
    "AdamW (AMSGrad)": lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.9), amsgrad=True,
                                                   weight_decay=0.1),
    "Adam (L2)": lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01, betas=(0.8, 0.9)),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01, betas=(0.8, 0.9)),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "RMSprop (momentum)": lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, momentum=0.8),
    "RMSprop (centered, momentum)": lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9,
                                                                  momentum=0.8, centered=True),
    # Its step sizes grow and shrink over the steps; a sign flip zeroes an element's step.
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01, etas=(0.4, 1.3), maximize=True),
}
DECOUPLED = {"AdamW": 0.1, "AdamW (AMSGrad)": 0.1}


@pytest.mark.parametrize("name", list(ADAM_LIKE))
def test_update_is_the_step_torch_took(name):
    state, params, _, before, after = _run(ADAM_LIKE[name])
    kind = optimizers.identify(state)
    assert kind.name == name.split(" (")[0] + (" (AMSGrad)" if "AMSGrad" in name else "")
    wd = DECOUPLED.get(name, 0.0)
    taken = [b * (1 - 0.01 * wd) - a for b, a in zip(before, after)]
    _close(_derived(state, "update"), taken)


def test_radam_rectification_starts_after_step_five():
    # beta2 = 0.9: rho_inf = 19, rho_t > 5 from step 5 on; before that the step is
    # SGD with momentum; both must match what torch did.
    for steps in (3, 7):
        state, _, _, before, after = _run(ADAM_LIKE["RAdam"], steps)
        _close(_derived(state, "update"), [b - a for b, a in zip(before, after)])
    assert optimizers.om.radam_rectification(0.9, 4) is None
    assert optimizers.om.radam_rectification(0.9, 7) is not None


@pytest.mark.parametrize("name", ["Adam", "AdamW", "RAdam", "NAdam", "Adamax"])
def test_exp_avg_is_the_debiased_average_of_the_gradients(name):
    make = ADAM_LIKE.get(name) or (lambda p: torch.optim.NAdam(p, lr=0.01, betas=(0.8, 0.9)))
    state, _, grads, _, _ = _run(make)
    _close(_derived(state, "exp_avg"), [_ema(g, 0.8) for g in grads])


@pytest.mark.parametrize("name", ["Adam", "RAdam", "NAdam", "Adadelta"])
def test_grad_rms_is_the_debiased_rms_of_the_gradients(name):
    make = ADAM_LIKE.get(name) or {
        "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01, betas=(0.8, 0.9)),
        "Adadelta": lambda p: torch.optim.Adadelta(p, rho=0.9)}[name]
    state, _, grads, _, _ = _run(make)
    _close(_derived(state, "grad_rms"), [_ema([x * x for x in g], 0.9).sqrt() for g in grads])


def test_amsgrad_grad_rms_reads_the_maximum():
    state, _, grads, _, _ = _run(ADAM_LIKE["AdamW (AMSGrad)"])
    got = _derived(state, "grad_rms")
    for g, entry in zip(got, state.state.values(), strict=True):
        v_max = entry["max_exp_avg_sq"].read()
        _close([g], [(v_max / (1 - 0.9**STEPS)).sqrt()])
        assert torch.all(v_max >= entry["exp_avg_sq"].read())


def test_rmsprop_quantities():
    state, _, grads, _, _ = _run(ADAM_LIKE["RMSprop (centered, momentum)"])
    _close(_derived(state, "grad_rms"), [_ema([x * x for x in g], 0.9).sqrt() for g in grads])
    _close(_derived(state, "exp_avg"), [_ema(g, 0.9) for g in grads])


def test_adagrad_grad_rms_is_over_all_steps():
    state, _, grads, _, _ = _run(lambda p: torch.optim.Adagrad(p, lr=0.01,
                                                               initial_accumulator_value=0.5))
    want = [torch.stack([x * x for x in g]).mean(0).sqrt() for g in grads]
    _close(_derived(state, "grad_rms"), want)


def test_torch_adafactor_grad_rms_is_its_factored_estimate():
    state, params, grads, _, _ = _run(lambda p: torch.optim.Adafactor(p, lr=0.01))
    want = []
    for p, g in zip(params, grads):
        row = col = var = None
        for t, x in enumerate(g, start=1):
            w = t**-0.8  # torch's beta2 schedule: 1 - beta2_t = t^-0.8
            sq = x * x
            if x.dim() > 1:
                r, c = sq.mean(-1, keepdim=True), sq.mean(-2, keepdim=True)
                row = r if row is None else row + w * (r - row)
                col = c if col is None else col + w * (c - col)
            else:
                var = sq if var is None else var + w * (sq - var)
        want.append((row @ col / row.mean(-2, keepdim=True)).sqrt() if p.dim() > 1
                    else var.sqrt())
    _close(_derived(state, "grad_rms"), want)


def test_transformers_adafactor_update_with_beta1_is_its_exp_avg():
    transformers = pytest.importorskip("transformers.optimization")
    state, _, _, before, after = _run(lambda p: transformers.Adafactor(
        p, lr=0.01, relative_step=False, scale_parameter=False, beta1=0.9))
    assert optimizers.identify(state).name == "Adafactor (transformers)"
    _close(_derived(state, "update"), [b - a for b, a in zip(before, after)])


def test_transformers_adafactor_grad_rms_is_its_factored_estimate():
    transformers = pytest.importorskip("transformers.optimization")
    state, params, grads, _, _ = _run(lambda p: transformers.Adafactor(p, lr=None))
    want = []
    for p, g in zip(params, grads):
        row = col = var = None
        for t, x in enumerate(g, start=1):
            w = t**-0.8  # its decay: beta2_t = 1 - t^-0.8, so the new share is t^-0.8
            sq = x * x + 1e-30  # its eps[0], added before averaging
            if x.dim() > 1:
                r, c = sq.mean(-1), sq.mean(-2)
                row = r if row is None else row + w * (r - row)
                col = c if col is None else col + w * (c - col)
            else:
                var = sq if var is None else var + w * (sq - var)
        want.append((row / row.mean(-1, keepdim=True)).unsqueeze(-1).mul(col.unsqueeze(-2))
                    .sqrt() if p.dim() > 1 else var.sqrt())
    _close(_derived(state, "grad_rms"), want)


REFUSED = [
    ("NAdam", lambda p: torch.optim.NAdam(p, lr=0.01), "update", "needs the last gradient"),
    ("Adamax", lambda p: torch.optim.Adamax(p, lr=0.01), "grad_rms", "infinity norm"),
    ("Adagrad", lambda p: torch.optim.Adagrad(p, lr=0.01), "update", "needs the last gradient"),
    ("RMSprop", lambda p: torch.optim.RMSprop(p, lr=0.01), "update", "needs the last gradient"),
    ("RMSprop", lambda p: torch.optim.RMSprop(p, lr=0.01), "exp_avg", "no first moment"),
    ("SGD", lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True), "update",
     "Nesterov"),
    ("SGD", lambda p: torch.optim.SGD(p, lr=0.01), "update", "keeps no state"),
    ("SGD", lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), "exp_avg", "a sum"),
    ("Adafactor", lambda p: torch.optim.Adafactor(p, lr=0.01), "update",
     "needs the last gradient"),
    ("Adadelta", lambda p: torch.optim.Adadelta(p), "update", "needs the last gradient"),
    ("Adadelta", lambda p: torch.optim.Adadelta(p), "exp_avg", "no first moment"),
    ("Rprop", lambda p: torch.optim.Rprop(p), "exp_avg", "no first moment"),
    ("Rprop", lambda p: torch.optim.Rprop(p), "grad_rms", "no second moment"),
    # Muon keeps SGD's momentum_buffer (an average, without a step count), but its
    # step is an orthogonalisation of it: never SGD's lr * buffer.
    ("Muon", lambda p: torch.optim.Muon(_matrices(p), lr=0.01, nesterov=False), "update",
     "Newton-Schulz"),
    ("Muon", lambda p: torch.optim.Muon(_matrices(p), lr=0.01), "update", "Newton-Schulz"),
    ("Muon", lambda p: torch.optim.Muon(_matrices(p), lr=0.01), "exp_avg",
     "without a step count"),
    ("Muon", lambda p: torch.optim.Muon(_matrices(p), lr=0.01), "grad_rms", "no second moment"),
]


class _Signum(torch.optim.Optimizer):
    """An optimizer gradclip has no rule for: its own state key and hyperparameter."""

    def __init__(self, params, lr=0.01, gamma=0.9):
        super().__init__(params, {"lr": lr, "gamma": gamma})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                trace = self.state[p].setdefault("trace", torch.zeros_like(p))
                trace.mul_(group["gamma"]).add_(p.grad)
                p.sub_(trace.sign(), alpha=group["lr"])


REFUSED.append(("an unknown optimizer", _Signum, "update", r"state keys \(trace\)"))


def _matrices(params):
    """Muon steps 2-D parameters only."""
    return [p for p in params if p.dim() == 2]


@pytest.mark.parametrize(("name", "make", "what", "why"), REFUSED,
                         ids=[f"{r[0]}-{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_what_the_state_does_not_determine_is_refused(name, make, what, why):
    state = _run(make, 2)[0]
    kind = optimizers.identify(state)
    assert kind.name == name
    assert not kind.gives(what) and re.search(why, kind.why_not(what))
    if state.state:
        pid, entry = next(iter(state.state.items()))
        with pytest.raises(optimizers.Refusal, match=why):
            optimizers.derive(kind, what, state, "w", entry, state.param_groups[0])


def test_a_negative_second_moment_is_nan_not_its_absolute_value():
    v = torch.tensor([4.0, -4.0])
    rms = optimizers.om.debiased_rms(v, 0.999, 10)
    assert math.isfinite(rms[0]) and math.isnan(rms[1])
    update = optimizers.om.adam_update(torch.ones(2), v, lr=1e-3, beta1=0.9, beta2=0.999,
                                       eps=1e-8, step=10)
    assert math.isnan(update[1])


PIECES = {
    **ADAM_LIKE,
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01, initial_accumulator_value=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9),
}


@pytest.mark.parametrize("name", list(PIECES))
def test_transforms_computed_by_pieces_are_the_same_bits(name):
    # The measuring step computes elementwise transforms a cache-sized piece at
    # a time (measuring._by_pieces); every element must be the bits the whole
    # tensor gives, in float32 and for a tensor spanning several pieces and a tail.
    from gradclip_cli import measuring

    torch.manual_seed(1)
    big = torch.nn.Linear(700, 3 * measuring._PIECE // 700 + 1)  # > 2 pieces, with a tail
    opt = PIECES[name](big.parameters())
    for _ in range(3):
        opt.zero_grad()
        big(torch.randn(4, 700)).square().sum().backward()
        opt.step()
    state = optimizer_state(opt.state_dict(), None, "test")
    kind = optimizers.identify(state)
    compared = 0
    for what in ("exp_avg", "grad_rms", "update"):
        if not kind.gives(what):
            continue
        for group in state.param_groups:
            for pid in group["params"]:
                d = optimizers.derive(kind, what, state, str(pid), state.state[pid], group)
                reads = [t.read() for t in d.reads]
                assert all(tuple(r.shape) == d.shape for r in reads)
                whole = d.compute(*reads)
                pieces = measuring._by_pieces(d.compute, reads)
                assert pieces.dtype == whole.dtype and pieces.shape == whole.shape
                assert torch.equal(pieces, whole), (what, pid)
                compared += whole.numel() > 2 * measuring._PIECE
    assert compared


def test_deepspeed_cpu_adam_without_bias_correction_steps_undebiased():
    # DeepSpeed's own CPU Adam (a C++ op, compiled on first use) with
    # bias_correction=False steps by lr * m / (sqrt(v) + eps): Adam's debiased
    # step would be 3x to 16x off here, far beyond float32 rounding of the change.
    if not os.environ.get("GRADCLIP_SLOW"):
        pytest.skip("set GRADCLIP_SLOW=1 (DeepSpeedCPUAdam is compiled on first use)")
    adam = pytest.importorskip("deepspeed.ops.adam")
    for debias in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
        opt = adam.DeepSpeedCPUAdam(model.parameters(), lr=0.01, betas=(0.8, 0.9),
                                    bias_correction=debias, adamw_mode=True, weight_decay=0.0)
        for step in range(STEPS):
            opt.zero_grad()
            x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
            model(x).square().sum().backward()
            before = [p.detach().double() for p in model.parameters()]
            opt.step()
        taken = [b - p.detach().double() for b, p in zip(before, model.parameters())]
        state = optimizer_state(opt.state_dict(), None, "test")
        assert state.param_groups[0]["bias_correction"] is debias
        for got, want in zip(_derived(state, "update"), taken, strict=True):
            # float32 parameters: their change is exact to about 2**-24 of the weights.
            assert float((got - want).abs().max()) <= 1e-6 + 1e-4 * float(want.abs().max())
