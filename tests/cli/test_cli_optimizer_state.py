"""torch.optim checkpoints beyond one plain param group, end to end.

Each case trains a small float64 model a few steps with a real torch.optim
optimizer (param groups with their own settings, a layer that never gets a
gradient, sparse gradients) and saves ``{"model", "optimizer"}`` with
``torch.save``. ``inspect --what Q`` is compared with float64 references
computed here: the change torch made to the parameters in its last step for
``update``, the optimizer's documented formula on the saved state (or the
gradients it was given) for ``exp_avg`` and ``grad_rms``; or it is refused,
exit 3 naming the optimizer, where the state does not determine ``Q``.
"""

from __future__ import annotations

import pytest
import torch

from .support import ref_norm, rel_err

TOL = 1e-9  # float64 throughout: the only differences are rounding


class Net(torch.nn.Module):
    """Two layers in use and, with ``unused``, one that never gets a gradient."""

    def __init__(self, unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(4, 3)
        self.unused = torch.nn.Linear(3, 3) if unused else None
        self.double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train(path, model, make, steps: int = 4, batch=None):
    """Step ``make(model)`` ``steps`` times; the gradients of each step and the last change."""
    opt = make(model)
    named = [(n, p) for n, p in model.named_parameters()]
    grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        x = batch(g) if batch else torch.randn(8, 5, dtype=torch.float64, generator=g)
        model(x).square().sum().backward()
        for n, p in named:
            if p.grad is not None:
                grads[n].append(p.grad.detach().clone())
        before = {n: p.detach().clone() for n, p in named}
        opt.step()
    taken = {n: before[n] - p.detach() for n, p in named}
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return opt.state_dict(), grads, taken


def test_sgd_groups_without_momentum_leave_the_update_undetermined(gradclip, tmp_path):
    # A group with momentum 0 keeps no state: its step was lr * grad, which the
    # checkpoint does not hold, so the total over the other groups is no total.
    path = tmp_path / "sgd.pt"
    _train(path, Net(), lambda m: torch.optim.SGD(
        [{"params": m.a.parameters(), "momentum": 0.0}, {"params": m.b.parameters()}],
        lr=0.01, momentum=0.9))
    result = gradclip("inspect", path, "--what", "update", "--format", "json")
    assert result.code == 3, result.out
    assert "SGD" in result.err and "momentum" in result.err


def test_sgd_groups_with_their_own_momentum_and_lr(gradclip, tmp_path):
    path = tmp_path / "sgd.pt"
    _, _, taken = _train(path, Net(), lambda m: torch.optim.SGD(
        [{"params": m.a.parameters(), "momentum": 0.5, "lr": 0.1, "dampening": 0.2},
         {"params": m.b.parameters()}], lr=0.01, momentum=0.9, weight_decay=0.1))
    doc = gradclip("inspect", path, "--what", "update", "--format", "json").json()
    assert rel_err(doc["total_norm"], ref_norm(taken.values(), 2)) <= TOL
    for row in doc["tensors"]:
        assert rel_err(row["norm"], ref_norm([taken[row["name"]]], 2)) <= TOL, row["name"]


def _sparse_batch(g):
    return torch.randint(0, 10, (3,), generator=g)


def test_sparse_adam_moves_only_the_rows_of_its_last_gradient(gradclip, tmp_path):
    # SparseAdam steps only the rows the last (sparse) gradient holds, which
    # its state does not record: Adam's step on the whole table is not its step.
    path = tmp_path / "sparse.pt"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True)).double()
    state, _, taken = _train(path, model, lambda m: torch.optim.SparseAdam(m.parameters(),
                                                                          lr=0.01),
                             batch=_sparse_batch)
    result = gradclip("inspect", path, "--what", "update", "--format", "json")
    assert result.code == 3, result.out
    assert "SparseAdam" in result.err
    # Its moments are Adam's, debiased by the parameter's step as its own rule does.
    entry, (b1, b2) = state["state"][0], state["param_groups"][0]["betas"]
    t = entry["step"]
    for what, want in (("exp_avg", entry["exp_avg"] / (1 - b1**t)),
                       ("grad_rms", (entry["exp_avg_sq"] / (1 - b2**t)).sqrt())):
        doc = gradclip("inspect", path, "--what", what, "--format", "json").json()
        assert rel_err(doc["total_norm"], ref_norm([want], 2)) <= TOL, what
        assert "SparseAdam" in doc["measured"]["explain"]


def test_adagrad_parameters_never_stepped_are_left_out(gradclip, tmp_path):
    # Adagrad makes every parameter's state (step 0) when it is built: a layer
    # that never got a gradient has had no step, like one without state.
    path = tmp_path / "adagrad.pt"
    _, grads, _ = _train(path, Net(unused=True), lambda m: torch.optim.Adagrad(
        m.parameters(), lr=0.01, initial_accumulator_value=0.1))
    result = gradclip("inspect", path, "--what", "grad_rms", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    want = {n: torch.stack([x * x for x in g]).mean(0).sqrt() for n, g in grads.items() if g}
    assert [row["name"] for row in doc["tensors"]] == list(want)
    assert rel_err(doc["total_norm"], ref_norm(want.values(), 2)) <= TOL


def test_adagrad_before_its_first_step_measures_nothing(gradclip, tmp_path):
    path = tmp_path / "adagrad.pt"
    model = Net()
    torch.save({"model": model.state_dict(),
                "optimizer": torch.optim.Adagrad(model.parameters()).state_dict()}, path)
    result = gradclip("inspect", path, "--what", "grad_rms", "--format", "json")
    assert result.code == 3, result.out
    assert "step 0" in result.err


@pytest.mark.parametrize(("name", "make", "closure"), [
    ("ASGD", lambda m: torch.optim.ASGD(m.parameters(), lr=0.01), False),
    ("LBFGS", lambda m: torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=3), True),
])
def test_refusals_name_the_optimizer(gradclip, tmp_path, name, make, closure):
    model = Net()
    opt = make(model)
    for step in range(2):
        x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))

        def loss(x=x):
            opt.zero_grad()
            out = model(x).square().sum()
            out.backward()
            return out
        opt.step(loss) if closure else (loss(), opt.step())
    path = tmp_path / "ck.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    for what in ("exp_avg", "grad_rms", "update"):
        result = gradclip("inspect", path, "--what", what)
        assert result.code == 3, (what, result.out)
        assert f"--what {what}: {name}: " in result.err, result.err


def test_amsgrad_in_some_groups_follows_each_groups_own_rule(gradclip, tmp_path):
    """torch.optim.Adam takes ``amsgrad`` per param group: each group's step reads its own
    second moment (``max_exp_avg_sq`` where the group uses AMSGrad), so every quantity is
    determined; ``update`` is the change torch made (no weight decay here)."""
    path = tmp_path / "adam.pt"
    state, _, taken = _train(path, Net(), lambda m: torch.optim.Adam(
        [{"params": m.a.parameters(), "amsgrad": True, "betas": (0.8, 0.9)},
         {"params": m.b.parameters()}], lr=0.01))
    names = [n for n, _ in Net().named_parameters()]
    groups = {i: g for g in state["param_groups"] for i in g["params"]}
    moment, rms = {}, {}
    for i, entry in state["state"].items():
        b1, b2 = groups[i]["betas"]
        t = float(entry["step"])
        second = entry["max_exp_avg_sq" if groups[i]["amsgrad"] else "exp_avg_sq"]
        moment[names[i]] = entry["exp_avg"] / (1 - b1**t)
        rms[names[i]] = (second / (1 - b2**t)).sqrt()
    assert any(not torch.equal(e["max_exp_avg_sq"], e["exp_avg_sq"])
               for e in state["state"].values() if "max_exp_avg_sq" in e)
    for what, reference in (("exp_avg", moment), ("grad_rms", rms), ("update", taken)):
        doc = gradclip("inspect", path, "--what", what, "--format", "json").json()
        assert rel_err(doc["total_norm"], ref_norm(reference.values(), 2)) <= TOL, what
        for row in doc["tensors"]:
            assert rel_err(row["norm"], ref_norm([reference[row["name"]]], 2)) <= TOL, what


@pytest.mark.parametrize("name, make, what, says, not_said", [
    ("Adagrad", lambda m: torch.optim.Adagrad(m.parameters(), lr=0.01), "grad_rms",
     "(sum - initial_accumulator_value) / step", "debiased"),
    ("RMSprop", lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, centered=True),
     "exp_avg", "grad_avg / (1 - alpha^step)", "beta1"),
    ("Adafactor", lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01), "grad_rms",
     "factored", "debiased"),
])
def test_the_measured_line_states_the_optimizers_own_rule(gradclip, tmp_path, name, make,
                                                          what, says, not_said):
    """The report says what was measured (docs/reference/optimizers.md): Adagrad's RMS is
    over all steps, RMSprop's average is ``grad_avg`` debiased with ``alpha``, Adafactor's
    second moment is a factored estimate, not Adam's debiased ``exp_avg_sq``."""
    path = tmp_path / "opt.pt"
    _train(path, Net(), make)
    result = gradclip("inspect", path, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    explain = result.json()["measured"]["explain"]
    assert explain.startswith(name) and says in explain and not_said not in explain, explain


@pytest.mark.parametrize("make", [lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                                  lambda m: torch.optim.RAdam(m.parameters(), lr=0.01)])
def test_a_negative_eps_is_corrupt_state_not_an_update(gradclip, tmp_path, make):
    """torch.optim refuses eps < 0; in a saved group it would put any size of step
    under sqrt(v_hat) + eps: the update is exit 3 naming it, the moments still measure."""
    path = tmp_path / "run.pt"
    _train(path, Net(), make, steps=2)
    saved = torch.load(path)
    saved["optimizer"]["param_groups"][0]["eps"] = -1e-8
    torch.save(saved, path)
    result = gradclip("inspect", path, "--what", "update")
    assert result.code == 3
    assert result.err_lines == [f"gradclip: {path}: the param group of a.weight has eps "
                                "-1e-08, below 0"]
    assert gradclip("inspect", path, "--what", "exp_avg").code == 0
