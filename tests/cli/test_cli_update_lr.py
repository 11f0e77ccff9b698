"""``--what update`` and the learning rate a checkpoint stores.

Every common training loop (the Hugging Face Trainer, Lightning, torchtitan, a
plain ``LambdaLR`` loop) steps its scheduler right after ``optimizer.step()``,
so the ``lr`` a checkpoint's param groups store is the next step's, and the one
the last step used is in no checkpoint (a ``LambdaLR``'s lambda is not saved).
Where a group whose parameters have state stores lr 0 (a linear or cosine
schedule's end), the update is not determined: exit 3 naming the group, and
every flag offered works. Elsewhere the update is taken at the stored lr,
compared here with float64 math on the saved state, and with the change torch
made scaled by the two lrs (which says which lr is used).

Each case is a real torch.optim loop with a real scheduler, saved with
``torch.save({"model", "optimizer"})``. The Trainer's own run is in
``test_cli_trend_run_folder.py``; autopsy's in ``test_cli_autopsy.py``.
"""

from __future__ import annotations

import pytest
import torch

from .support import ref_norm, rel_err
from .test_cli_optimizer_state import Net

TOL = 1e-9  # float64 state: the only differences are rounding
STEPS = 4


def linear_decay(total: int):
    """The Trainer's default schedule (no warmup): 1 at step 0, exactly 0 at ``total``."""
    return lambda step: max(0.0, (total - step) / total)


def train(path, model, make_optimizer, lambdas, steps: int = STEPS):
    """``steps`` optimizer steps, each followed by ``scheduler.step()`` (the order every
    trainer uses); saves model and optimizer. Returns the lr each group's last step used
    and the change torch made to every parameter in that step."""
    opt = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    named = list(model.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        used = [float(g["lr"]) for g in opt.param_groups]
        before = {n: p.detach().clone() for n, p in named}
        opt.step()
        scheduler.step()
    taken = {n: before[n] - p.detach() for n, p in named}
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return used, taken


def offers(error: str) -> list[list[str]]:
    """The flags a refusal offers (``available: --what a, --what b``), each as arguments."""
    assert "available: " in error, error
    return [flag.split() for flag in error.split("available: ", 1)[1].split(", ")]


def refused(gradclip, *args) -> str:
    """Run a command that must refuse (exit 3, one JSON error); its message."""
    result = gradclip(*args, "--format", "json")
    assert result.code == 3, result.out
    doc = result.json()
    assert doc["schema"] == "gradclip.error/1" and doc["exit_code"] == 3
    return doc["error"]


def adam_update(state: dict, lr: float, beta1: float, beta2: float, eps: float) -> torch.Tensor:
    """torch.optim.Adam's step from its saved state, in float64."""
    step = float(state["step"])
    m_hat = state["exp_avg"].double() / (1 - beta1 ** step)
    v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** step)
    return lr * m_hat / (v_hat.sqrt() + eps)


# Every torch.optim optimizer whose update the lr scales, with what else its state gives.
LR_SCALED = {
    "AdamW": (lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), ["exp_avg", "grad_rms"]),
    "Adam": (lambda m: torch.optim.Adam(m.parameters(), lr=0.01), ["exp_avg", "grad_rms"]),
    "RAdam": (lambda m: torch.optim.RAdam(m.parameters(), lr=0.01), ["exp_avg", "grad_rms"]),
    "Adamax": (lambda m: torch.optim.Adamax(m.parameters(), lr=0.01), ["exp_avg"]),
    "SGD": (lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), []),
    "RMSprop": (lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9),
                ["grad_rms"]),
}


@pytest.mark.parametrize("name", list(LR_SCALED))
def test_a_schedule_run_to_its_end_leaves_the_update_undetermined(gradclip, tmp_path, name):
    make, others = LR_SCALED[name]
    path = tmp_path / "end.pt"
    used, _ = train(path, Net(), make, linear_decay(STEPS))
    saved = torch.load(path, weights_only=True)["optimizer"]["param_groups"]
    assert saved[0]["lr"] == 0 and used[0] > 0  # the premise: the last step used lr > 0
    error = refused(gradclip, "inspect", path, "--what", "update")
    assert error.startswith(f"{path}: --what update: {name}")
    assert "param group 0 " in error and "stores lr 0" in error
    assert "last step used is not in the checkpoint" in error
    offered = offers(error)
    assert offered == [["--what", w] for w in [*others, "weights"]]
    for flags in offered:  # each offer works, and measures what it says
        result = gradclip("inspect", path, *flags, "--format", "json")
        assert result.code == 0, result.err
        assert result.json()["what"] == flags[1]


def test_the_update_is_taken_at_the_stored_lr_the_next_steps(gradclip, tmp_path):
    # Mid-schedule: the stored lr (0.5 of the base after 2 of 4 steps) is the one the
    # next step will use; the last step used 0.75 of it. gradclip reports the stored lr's
    # update, exactly: float64 math on the saved state, and torch's own change scaled by
    # stored / used.
    path = tmp_path / "mid.pt"
    used, taken = train(path, Net(), lambda m: torch.optim.AdamW(
        m.parameters(), lr=0.01, weight_decay=0.0), linear_decay(STEPS), steps=2)
    ckpt = torch.load(path, weights_only=True)
    group = ckpt["optimizer"]["param_groups"][0]
    stored = group["lr"]
    assert stored == pytest.approx(0.005) and used[0] == pytest.approx(0.0075)
    reference = [adam_update(s, stored, *group["betas"], group["eps"])
                 for s in ckpt["optimizer"]["state"].values()]
    doc = gradclip("inspect", path, "--what", "update", "--format", "json").json()
    assert doc["what"] == "update"
    assert rel_err(doc["total_norm"], ref_norm(reference, 2)) <= TOL
    scaled = [t * (stored / used[0]) for t in taken.values()]
    assert rel_err(doc["total_norm"], ref_norm(scaled, 2)) <= 1e-6  # torch's own rounding


def test_an_lr_stored_as_a_tensor(gradclip, tmp_path):
    # torch.optim takes a Tensor lr (for capturable and compiled steps); LambdaLR fills it.
    def make(m):
        return torch.optim.AdamW(m.parameters(), lr=torch.tensor(0.01), weight_decay=0.0)

    mid, end = tmp_path / "mid.pt", tmp_path / "end.pt"
    train(mid, Net(), make, linear_decay(STEPS), steps=2)
    ckpt = torch.load(mid, weights_only=True)
    group = ckpt["optimizer"]["param_groups"][0]
    assert isinstance(group["lr"], torch.Tensor)
    reference = [adam_update(s, float(group["lr"]), *group["betas"], group["eps"])
                 for s in ckpt["optimizer"]["state"].values()]
    doc = gradclip("inspect", mid, "--what", "update", "--format", "json").json()
    assert rel_err(doc["total_norm"], ref_norm(reference, 2)) <= TOL

    train(end, Net(), make, linear_decay(STEPS))
    error = refused(gradclip, "inspect", end, "--what", "update")
    assert "param group 0 " in error and "stores lr 0" in error


def test_the_group_at_lr_0_is_named_and_a_group_without_state_does_not_count(gradclip,
                                                                            tmp_path):
    # Three groups: a's at a constant lr, b's decayed to 0, and the unused layer's at lr 0
    # (never stepped: no state, so its lr decides nothing). The refusal names group 1.
    model = Net(unused=True)
    path = tmp_path / "groups.pt"

    def make(m):
        def named(layer):  # named: the optimizer stores param_names (b.bias and
            # unused.bias have one shape, so the model's order alone fits twice)
            return [(n, p) for n, p in m.named_parameters() if n.startswith(layer + ".")]

        return torch.optim.AdamW([{"params": named("a")},
                                  {"params": named("b"), "lr": 0.01},
                                  {"params": named("unused"), "lr": 0.0}], lr=0.01)

    train(path, model, make, [lambda s: 1.0, linear_decay(STEPS), lambda s: 1.0])
    error = refused(gradclip, "inspect", path, "--what", "update")
    assert "param group 1 (holding b.weight)" in error and "stores lr 0" in error
    for flags in offers(error):
        assert gradclip("inspect", path, *flags).code == 0
    # The same loop with b's lr constant: measured, the unused group's lr 0 aside.
    train(path, Net(unused=True), make, [lambda s: 1.0] * 3)
    doc = gradclip("inspect", path, "--what", "update", "--format", "json").json()
    assert doc["what"] == "update" and doc["total_norm"] > 0
    assert {t["name"] for t in doc["tensors"]} == {"a.weight", "a.bias", "b.weight", "b.bias"}


def test_an_lr_missing_from_a_group_leaves_the_update_undetermined(gradclip, tmp_path):
    path = tmp_path / "nolr.pt"
    train(path, Net(), lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), [lambda s: 1.0])
    ckpt = torch.load(path, weights_only=True)
    del ckpt["optimizer"]["param_groups"][0]["lr"]
    torch.save(ckpt, path)
    error = refused(gradclip, "inspect", path, "--what", "update")
    assert error.startswith(f"{path}: --what update: AdamW")
    assert "param group 0 (holding a.weight) stores no lr" in error
    assert offers(error) == [["--what", "exp_avg"], ["--what", "grad_rms"], ["--what", "weights"]]
    for flags in offers(error):
        assert gradclip("inspect", path, *flags).code == 0
