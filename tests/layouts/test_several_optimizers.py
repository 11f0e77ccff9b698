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


def _lightning_gan(out: Path, make_d, checkpoint_every: int | None = None) -> Path:
    """A real ``lightning`` GAN in ``out``: manual optimization, Adam for the generator and
    ``make_d`` for the discriminator, 3 steps each, saved by the Trainer as ``gan.ckpt``
    (and, with ``checkpoint_every``, by ``ModelCheckpoint`` every that many steps)."""
    L = pytest.importorskip("lightning")
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
                    make_d(self.discriminator.parameters())]

    torch.manual_seed(4)
    data = TensorDataset(torch.randn(24, 5))
    saving = checkpoint_every is not None
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(
        dirpath=out / "checkpoints", every_n_train_steps=checkpoint_every, save_top_k=-1)
    ] if saving else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_epochs=1, limit_train_batches=3, accelerator="cpu", devices=1,
                            logger=False, enable_checkpointing=saving, callbacks=callbacks,
                            enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=out)
        trainer.fit(GAN(), DataLoader(data, batch_size=8))
        trainer.save_checkpoint(out / "gan.ckpt")
    return out / "gan.ckpt"


@pytest.fixture(scope="session")
def lightning_gan(tmp_path_factory) -> Path:
    """A real ``lightning`` GAN: manual optimization, two Adam optimizers, 3 steps each."""
    return _lightning_gan(tmp_path_factory.mktemp("lightning_gan"),
                          lambda p: torch.optim.Adam(p, lr=2e-2, betas=BETAS))


@pytest.fixture(scope="session")
def lightning_gan_sgd(tmp_path_factory) -> Path:
    """A real ``lightning`` GAN of two kinds: Adam for the generator, SGD with momentum for
    the discriminator; ``ModelCheckpoint`` saved it every 2 steps too (``checkpoints/``)."""
    return _lightning_gan(tmp_path_factory.mktemp("lightning_gan_sgd"),
                          lambda p: torch.optim.SGD(p, lr=2e-2, momentum=0.9),
                          checkpoint_every=2)


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


def _lightning_references(path: Path) -> dict[str, tuple[dict[str, torch.Tensor], int]]:
    """Per ``--key`` of a Lightning GAN of Adam (generator) and SGD with momentum
    (discriminator): ``{what: name -> float64 tensor}`` that optimizer alone gives,
    from the raw file: Adam's bias-corrected ``exp_avg`` and its step, SGD's
    ``lr * momentum_buffer`` (torch.optim.SGD's step without Nesterov)."""
    saved = torch.load(path, weights_only=True)
    weights = saved["state_dict"]
    adam, sgd = saved["optimizer_states"]
    adam_ref = _reference(weights, [(adam, "generator.")])
    names = [n for n in weights if n.startswith("discriminator.")]
    group = sgd["param_groups"][0]
    sgd_update = {name: group["lr"] * sgd["state"][pid]["momentum_buffer"].double()
                  for pid, name in zip(group["params"], names, strict=True)}
    return {"optimizer_states.0": {"exp_avg": {n: r[0] for n, r in adam_ref.items()},
                                   "update": {n: r[1] for n, r in adam_ref.items()}},
            "optimizer_states.1": {"update": sgd_update}}


@pytest.mark.parametrize("asked", ["exp_avg", "update"])
def test_lightning_optimizers_of_different_kinds_offer_each_by_its_index(
        gradclip, lightning_gan_sgd, asked):
    """A Lightning GAN with Adam for G and SGD with momentum for D keeps both in the
    ``optimizer_states`` list: the refusal offered nothing but the weights, and
    ``--key optimizer_states.0`` measured both optimizers (and was refused as the pair).
    The refusal lists ``--key optimizer_states.N`` (with the --what it gives where not
    the one asked), and each offer measures that optimizer alone, under the model's
    names, against a float64 reference."""
    refs = _lightning_references(lightning_gan_sgd)
    result = gradclip("inspect", lightning_gan_sgd, "--what", asked)
    assert result.code == 3, result.err
    assert len(result.err_lines) == 1, result.err
    line = result.err_lines[0]
    assert str(lightning_gan_sgd) in line
    assert "it holds 2 optimizers of different kinds (Adam, SGD)" in line, line
    offers = _offers(line)
    want = [["--key", "optimizer_states.0"],
            ["--key", "optimizer_states.1"] + ([] if asked == "update" else
                                               ["--what", "update"])]
    assert all(w in offers for w in want), line
    keyed = [o for o in offers if "--key" in o]
    assert len(keyed) == 2, line  # SGD gives no exp_avg, so nothing else for it
    for offer in keyed:
        args = offer if "--what" in offer else ["--what", asked, *offer]
        run = gradclip("inspect", lightning_gan_sgd, *args, "--format", "json")
        assert run.code == 0, (offer, run.err)
        doc = run.json()
        key, what = args[args.index("--key") + 1], args[args.index("--what") + 1]
        assert doc["what"] == what
        ref = refs[key][what]
        assert sorted(t["name"] for t in doc["tensors"]) == sorted(ref), offer
        assert rel_err(doc["total_norm"], _norm(ref.values())) <= TOL, offer
        for row in doc["tensors"]:
            assert rel_err(row["norm"], _norm([ref[row["name"]]])) <= TOL, row["name"]


@pytest.mark.parametrize(("key", "said"), [
    ("optimizer_states.2", "no entry '2' at optimizer_states (a list of 2: positions 0 to 1)"),
    ("optimizer_states.-1", "no entry '-1' at optimizer_states (a list of 2: positions 0 to 1)"),
    ("global_step.0", "'global_step' holds a value of type int, not a mapping or list"),
    ("optimizer_states.0\x1b[31m", "no entry '0\\x1b[31m' at optimizer_states"),
])
def test_a_lightning_key_past_the_list_or_into_a_number_is_one_line(
        gradclip, lightning_gan_sgd, key, said):
    """An index past the list's end, a negative one, or a --key into a number: exit 3,
    one line naming the file and the key (escaped as every error line is)."""
    for command in (["inspect"], ["clip", "--max-norm", "1"]):
        result = gradclip(*command, lightning_gan_sgd, "--key", key)
        assert result.code == 3, result.err
        assert result.err_lines == [result.err.strip()], result.err
        line = result.err_lines[0]
        assert "\x1b" not in line
        shown = key.replace("\x1b", "\\x1b")
        assert line.startswith(f"gradclip: {lightning_gan_sgd}: --key '{shown}': "), line
        assert said in line, line


def test_lightning_optimizers_of_different_kinds_over_time(gradclip, lightning_gan_sgd):
    """compare and trend over ModelCheckpoint's saves of the same GAN: refused as the pair
    (offering the keys), measured per optimizer by ``--key optimizer_states.N``."""
    saves = sorted((lightning_gan_sgd.parent / "checkpoints").iterdir(),
                   key=lambda p: p.stat().st_mtime_ns)
    assert len(saves) >= 2, saves
    a, b = saves[0], saves[-1]
    refused = gradclip("compare", a, b, "--what", "exp_avg")
    assert refused.code == 3, refused.err
    offers = _offers(refused.err_lines[-1])
    assert ["--key", "optimizer_states.0"] in offers, refused.err
    assert ["--key", "optimizer_states.1", "--what", "update"] in offers, refused.err
    for key, what in (("optimizer_states.0", "exp_avg"), ("optimizer_states.1", "update")):
        ref_a = _lightning_references(a)[key][what]
        ref_b = _lightning_references(b)[key][what]
        doc = gradclip("compare", a, b, "--key", key, "--what", what, "--format", "json")
        assert doc.code == 0, doc.err
        total = doc.json()["total"]
        assert rel_err(total["a"], _norm(ref_a.values())) <= TOL
        assert rel_err(total["b"], _norm(ref_b.values())) <= TOL
        trend = gradclip("trend", *saves, "--key", key, "--what", what, "--format", "json")
        assert trend.code == 0, trend.err
        points = trend.json()["points"]
        assert trend.json()["what"] == what and len(points) == len(saves)
        for point, save in zip(points, sorted(saves, key=_step_of), strict=True):
            ref = _lightning_references(save)[key][what]
            assert rel_err(point["total_norm"], _norm(ref.values())) <= TOL, save


def _step_of(path: Path) -> int:
    return torch.load(path, weights_only=True)["global_step"]
