"""Checkpoints holding several optimizers: all of them are measured, or none.

A GAN trained with Lightning keeps a generator's and a discriminator's
optimizer in ``optimizer_states``; a script may save ``optimizer_g`` and
``optimizer_d`` side by side, or torch's Muon for the matrices beside AdamW
for the rest. Measuring the first alone reports a part as the total (what
gradclip did). Each optimizer's ids map to names by the order of its own
parameters, known here by construction; references are float64 from the raw
files (``torch.load``).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from tests.cli.support import rel_err

TOL = 1e-6
BETAS = (0.5, 0.9)


class _Parts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                             torch.nn.Linear(6, 5))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(),
                                                 torch.nn.Linear(7, 1))


@pytest.fixture(scope="session")
def lightning_gan(tmp_path_factory) -> Path:
    """A real ``lightning`` GAN: manual optimization, two Adam optimizers, 3 steps each."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class GAN(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            parts = _Parts()
            self.generator, self.discriminator = parts.generator, parts.discriminator

        def training_step(self, batch, _):
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            noise = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(3))
            fake = self.generator(noise)
            loss_d = self.discriminator(real).sub(1).square().mean() \
                + self.discriminator(fake.detach()).square().mean()
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            opt_d.step()
            loss_g = self.discriminator(fake).sub(1).square().mean()
            opt_g.zero_grad()
            self.manual_backward(loss_g)
            opt_g.step()

        def configure_optimizers(self):
            return [torch.optim.Adam(self.generator.parameters(), lr=1e-2, betas=BETAS),
                    torch.optim.Adam(self.discriminator.parameters(), lr=2e-2, betas=BETAS)]

    torch.manual_seed(4)
    data = TensorDataset(torch.randn(24, 5))
    out = tmp_path_factory.mktemp("lightning_gan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_epochs=1, limit_train_batches=3, accelerator="cpu", devices=1,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=out)
        trainer.fit(GAN(), DataLoader(data, batch_size=8))
        trainer.save_checkpoint(out / "gan.ckpt")
    return out / "gan.ckpt"


def _reference(weights: dict, states: list[tuple[dict, str]]) -> dict[str, tuple]:
    """name -> (exp_avg_hat, update) in float64: optimizer ``i`` holds the parameters of
    module prefix ``states[i][1]``, in that module's order."""
    out = {}
    for state, prefix in states:
        names = [n for n in weights if n.startswith(prefix)]
        group = state["param_groups"][0]
        b1, b2 = group["betas"]
        for pid, name in zip(group["params"], names, strict=True):
            s = state["state"][pid]
            t = float(s["step"])
            m, v = s["exp_avg"].double(), s["exp_avg_sq"].double()
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            out[name] = (m_hat, group["lr"] * m_hat / (v_hat.sqrt() + group["eps"]))
    return out


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def test_lightning_gan_measures_both_optimizers(gradclip, lightning_gan):
    saved = torch.load(lightning_gan, weights_only=True)
    states = saved["optimizer_states"]
    assert len(states) == 2
    ref = _reference(saved["state_dict"], [(states[0], "generator."),
                                           (states[1], "discriminator.")])
    assert len(ref) == 8
    for what, k in (("exp_avg", 0), ("update", 1)):
        doc = gradclip("inspect", lightning_gan, "--what", what, "--format", "json").json()
        assert doc["what"] == what
        assert sorted(t["name"] for t in doc["tensors"]) == sorted(ref)
        assert rel_err(doc["total_norm"], _norm(r[k] for r in ref.values())) <= TOL
        for row in doc["tensors"]:
            assert rel_err(row["norm"], _norm([ref[row["name"]][k]])) <= TOL, row["name"]
    auto = gradclip("inspect", lightning_gan, "--format", "json").json()
    assert auto["what"] == "exp_avg" and len(auto["tensors"]) == 8


def _trained(make_optimizers, steps: int = 2):
    torch.manual_seed(0)
    model = _Parts()
    opts = make_optimizers(model)
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        model.discriminator(model.generator(x)).square().mean().backward()
        for opt in opts:
            opt.step()
    return model, opts


def test_side_by_side_entries_are_one_total(gradclip, tmp_path):
    model, (g, d) = _trained(lambda m: [
        torch.optim.AdamW(m.generator.parameters(), lr=1e-2, betas=BETAS),
        torch.optim.AdamW(m.discriminator.parameters(), lr=1e-3, betas=BETAS)])
    path = tmp_path / "gan.pt"
    torch.save({"model": model.state_dict(), "optimizer_g": g.state_dict(),
                "optimizer_d": d.state_dict()}, path)
    ref = _reference(model.state_dict(), [(g.state_dict(), "generator."),
                                          (d.state_dict(), "discriminator.")])
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "exp_avg" and len(doc["tensors"]) == 8
    assert "'optimizer_g' and 'optimizer_d' entries" in doc["measured"]["evidence"]
    assert rel_err(doc["total_norm"], _norm(r[0] for r in ref.values())) <= TOL
    # One of them, asked for by name, is measured alone.
    one = gradclip("inspect", path, "--key", "optimizer_d", "--format", "json").json()
    assert sorted(t["name"] for t in one["tensors"]) == sorted(
        n for n in ref if n.startswith("discriminator."))


def test_optimizers_of_different_kinds_are_refused(gradclip, tmp_path):
    """Muon for the matrices, AdamW for the rest: no one rule measures both, and half of
    the model is not its total."""
    model, (muon, adamw) = _trained(lambda m: [
        torch.optim.Muon([p for p in m.parameters() if p.dim() == 2], lr=0.02),
        torch.optim.AdamW([p for p in m.parameters() if p.dim() != 2], lr=1e-3)])
    path = tmp_path / "muon_adamw.pt"
    torch.save({"model": model.state_dict(), "optimizer": muon.state_dict(),
                "optimizer_adamw": adamw.state_dict()}, path)
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "weights"
    result = gradclip("inspect", path, "--what", "exp_avg")
    assert result.code == 3
    line = result.err_lines[0]
    assert "it holds 2 optimizers of different kinds (Muon, AdamW)" in line, line
    # Muon's state gives no quantity; AdamW's, asked for by its key, is measured alone.
    assert line.endswith("available: --what weights, --key optimizer_adamw"), line
    alone = gradclip("inspect", path, "--what", "exp_avg", "--key", "optimizer_adamw",
                     "--format", "json")
    assert alone.code == 0, alone.err
    assert len(alone.json()["tensors"]) == len(adamw.state_dict()["state"])


def test_the_same_optimizer_saved_twice_is_refused(gradclip, tmp_path):
    """A second copy of the optimizer (a script's 'best' beside 'last') holds the same
    parameters again: never counted twice."""
    model, (adam,) = _trained(lambda m: [torch.optim.Adam(m.named_parameters(), lr=1e-2)])
    path = tmp_path / "twice.pt"
    torch.save({"model": model.state_dict(), "optimizer": adam.state_dict(),
                "optimizer_best": adam.state_dict()}, path)
    result = gradclip("inspect", path, "--what", "exp_avg")
    assert result.code == 3
    assert "two of its 2 optimizers hold parameter generator.0.weight" in result.err_lines[0]


def _offers(line: str) -> list[list[str]]:
    """The flag sets a refusal offers ("available: --key a, --key b --what update")."""
    listed = line.rsplit("available: ", 1)[1]
    return [offer.split() for offer in listed.split(", ")]


@pytest.mark.parametrize("make_d, d_gives", [
    (lambda p: torch.optim.AdamW(p, lr=1e-3, betas=BETAS), "exp_avg"),
    (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), "update"),
], ids=["adam-adamw", "adam-sgd"])
@pytest.mark.parametrize("with_model", [True, False], ids=["model", "no-model"])
def test_optimizers_of_different_kinds_offer_each_by_its_key(gradclip, tmp_path, make_d,
                                                             d_gives, with_model):
    """A GAN's optimizer_g and optimizer_d of different kinds: the refusal offered
    nothing (or the weights alone), though --key names each optimizer, which is measured
    alone. The refusal lists each --key (with the --what it gives where --what exp_avg
    is not one), and following each offer succeeds, measuring that optimizer alone."""
    model, (g, d) = _trained(lambda m: [
        torch.optim.Adam(m.generator.parameters(), lr=1e-2, betas=BETAS),
        make_d(m.discriminator.parameters())])
    path = tmp_path / "gan.pt"
    saved = {"optimizer_g": g.state_dict(), "optimizer_d": d.state_dict()}
    torch.save({**({"model": model.state_dict()} if with_model else {}), **saved}, path)
    result = gradclip("inspect", path, "--what", "exp_avg")
    assert result.code == 3, result.err
    line = result.err_lines[-1]
    assert "it holds 2 optimizers of different kinds" in line, line
    offers = _offers(line)
    want_d = ["--key", "optimizer_d"] + ([] if d_gives == "exp_avg" else ["--what", d_gives])
    assert ["--key", "optimizer_g"] in offers and want_d in offers, line
    weights = model.state_dict()
    for offer in offers:
        args = offer if "--what" in offer else ["--what", "exp_avg", *offer]
        run = gradclip("inspect", path, *args, "--format", "json")
        assert run.code == 0, (offer, run.err)
        doc = run.json()
        if "--key" not in offer:
            continue  # the weights
        key = offer[offer.index("--key") + 1]
        assert doc["what"] == args[args.index("--what") + 1]
        state = saved[key]
        assert len(doc["tensors"]) == len(state["state"])
        if doc["what"] == "exp_avg":
            prefix = "generator." if key == "optimizer_g" else "discriminator."
            ref = _reference(weights, [(state, prefix)])
            assert rel_err(doc["total_norm"], _norm(r[0] for r in ref.values())) <= TOL
