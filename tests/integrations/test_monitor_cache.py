"""What GradMonitor keeps between steps never changes what it logs.

The monitor keeps the model's parameter list, the groups and the log line's
keys while the model stays the same, judges all groups at once, and writes
its line without ``json`` walking the groups. Each test holds one of those to
what the plain way gives: the model as ``named_parameters()`` lists it now,
one ``SpikeDetector`` per group, ``json.dumps`` of the returned record.
"""

from __future__ import annotations

import json
import math

import torch

from gradclip_cli import GradMonitor
from gradclip_cli.core.spikes import SpikeDetector
from tests.core.spike_reference import group_z

from .support import assert_norms_match, read_log, reference_norms
from .test_monitor import Tiny, fill_grads


def lines(path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def train(model: torch.nn.Module, steps: int, seed: int = 0):
    """A real short run: next-token loss on random tokens, SGD; yields after backward."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        tokens = torch.randint(0, 16, (4, 9))
        hidden = model.wte(tokens[:, :-1])
        for layer in model.h:
            hidden = torch.tanh(layer(hidden))
        loss = torch.nn.functional.cross_entropy(
            model.lm_head(hidden).flatten(0, 1), tokens[:, 1:].flatten()
        )
        opt.zero_grad()
        loss.backward()
        yield step
        opt.step()


def test_each_line_is_json_dumps_of_its_record_on_a_real_run(tmp_path):
    model = Tiny()
    # A name json escapes (non-ASCII, a quote) as a group of its own.
    model.add_module('caf\u00e9"', torch.nn.Linear(8, 8))
    # One the line's %-template must keep as it is.
    model.add_module("100%s %%d", torch.nn.Linear(8, 8))
    log = tmp_path / "grads.jsonl"
    records = []
    with GradMonitor(model, log, None, group_by="module") as monitor:
        for step in train(model, 40):
            model.get_submodule("100%s %%d").weight.grad = torch.randn(8, 8)
            extra = model.get_submodule('caf\u00e9"')
            extra.weight.grad = torch.randn(8, 8) * (30.0 if step == 33 else 1e-2)
            if step == 36:
                extra.weight.grad[1, 2] = -math.inf  # not in the forward pass: this step only
            if step == 38:
                model.h[0].weight.grad[0, 0] = math.nan  # the weights, and later steps, go NaN
            if step % 2:
                records.append(monitor.step(step))
            else:
                monitor.clip_grad_norm_(1.0, step)
                records.append(read_log(log)[-1])
    written = lines(log)
    assert len(written) == 40
    for line, record in zip(written, records):
        assert line == json.dumps(record, allow_nan=False).encode()
    assert read_log(log)[36]["nonfinite"] == {"nan": 0, "posinf": 0, "neginf": 1}
    assert read_log(log)[36]["groups"]['caf\u00e9"'] == "inf"
    assert read_log(log)[38]["groups"]["h.0"] == "nan"
    assert read_log(log)[33]["spike_groups"] == ['caf\u00e9"']
    assert "100%s %%d" in read_log(log)[0]["groups"]


def test_spikes_are_judged_as_one_detector_per_group_would(tmp_path):
    model = Tiny()
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log, None, warmup=10) as monitor:
        for step in train(model, 45, seed=1):
            if step in (20, 38):
                model.h[1].weight.grad *= 40  # a spike in one layer
            if step == 30:
                model.wte.weight.grad.zero_()  # a layer whose norm drops to 0
            monitor.step(step)
    records = read_log(log)
    detectors: dict[str, SpikeDetector] = {}
    total = SpikeDetector(warmup=10)
    for record in records:
        # The step's groups are judged at once, against the groups' threshold.
        threshold = group_z(2.5, len(record["groups"]))
        groups = [
            g
            for g, norm in record["groups"].items()
            if detectors.setdefault(g, SpikeDetector(warmup=10))
            .update(float(norm), threshold)
            .spike
        ]
        judged = total.update(float(record["total_norm"]))
        assert record["spike_groups"] == groups, record["step"]
        assert record["z"] == judged.z and record["spike"] == (judged.spike or bool(groups))
    assert "h.1" in records[20]["spike_groups"] and "h.1" in records[38]["spike_groups"]


def test_a_changed_model_is_measured_as_it_is_now(tmp_path):
    model = Tiny()
    log = tmp_path / "grads.jsonl"

    def untie(m):
        m.lm_head.weight = torch.nn.Parameter(m.wte.weight.detach().clone())

    def rename(m):
        children = list(m._modules.items())
        m._modules.clear()
        m._modules.update(("blocks" if k == "h" else k, v) for k, v in children)

    def share(m):  # one parameter under a second name: listed once, under the first
        m.h[1].register_parameter("also", m.h[0].bias)

    changes = [
        lambda m: None,
        lambda m: m.add_module("extra", torch.nn.Linear(8, 3)),  # a parameter added
        lambda m: setattr(m.h[0].bias, "grad", None),  # a gradient gone
        lambda m: setattr(m.h[1], "weight", torch.nn.Parameter(torch.ones(8, 8))),
        lambda m: delattr(m.h[1], "bias"),  # a parameter removed
        untie,
        share,
        lambda m: m.h.__setitem__(0, torch.nn.Linear(8, 8)),  # a submodule replaced
        lambda m: m._parameters.__setitem__("scale", torch.nn.Parameter(torch.ones(2))),
        lambda m: m.h[0]._parameters.pop("bias"),  # straight through the dict
        # A dict replaced by another with the same content, then that one changed.
        lambda m: setattr(m.h[1], "_parameters", dict(m.h[1]._parameters)),
        lambda m: m.h[1]._parameters.__setitem__("weight", torch.nn.Parameter(torch.ones(8, 8))),
        # A parameter set in a dict that was empty (a leaf's _modules).
        lambda m: m.h[1]._modules.__setitem__("inner", torch.nn.Linear(2, 2)),
        lambda m: setattr(m, "extra", None),
        rename,  # the same objects, in the same order, under another name
    ]
    with GradMonitor(model, log, None) as monitor:
        for step, change in enumerate(changes):
            fill_grads(model, step)
            change(model)
            if step == 2:  # the change took a gradient away: keep it gone
                assert model.h[0].bias.grad is None
            total, groups = reference_norms(model)
            record = monitor.step(step)
            assert_norms_match(record, total, groups)
            fill_grads(model, step)  # and once more, unchanged
            assert_norms_match(monitor.step(step), *reference_norms(model))
        # A wholly other model given to the monitor is the one measured.
        other = Tiny()
        fill_grads(other, 0, {"wte.weight": 3.0})
        monitor.model = other
        assert_norms_match(monitor.step(99), *reference_norms(other))


def test_steps_not_logged_clip_the_parameters_the_model_has_now(tmp_path):
    model = Tiny()
    with GradMonitor(model, tmp_path / "grads.jsonl", None, every=1000) as monitor:
        fill_grads(model, 0)
        monitor.clip_grad_norm_(1e9, 0)  # logged: the parameters are listed
        model.add_module("extra", torch.nn.Linear(8, 8))
        fill_grads(model, 1, {"extra.weight": 100.0})
        want = math.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
        total = monitor.clip_grad_norm_(1.0, 1)
        assert math.isclose(float(total), want, rel_tol=1e-6)
        after = math.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
        assert math.isclose(after, 1.0, rel_tol=1e-5)


def test_a_model_that_lists_its_own_parameters_is_asked_every_step(tmp_path):
    class Chosen(Tiny):
        """Lists only the parameters whose names hold ``self.chosen``."""

        chosen = "h."

        def named_parameters(self, *args, **kwargs):
            for name, p in super().named_parameters(*args, **kwargs):
                if self.chosen in name:
                    yield name, p

    model = Chosen()
    with GradMonitor(model, tmp_path / "grads.jsonl", None) as monitor:
        for step, chosen in enumerate(["h.", "h.", "wte", "h.1"]):
            model.chosen = chosen
            fill_grads(model, step)
            record = monitor.step(step)
            assert_norms_match(record, *reference_norms(model))
            assert all(chosen in name for name, _ in model.named_parameters())
