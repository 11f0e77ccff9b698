"""GradMonitor in a plain training loop: the log, the spike rule, dumps, clipping, ranks."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from gradclip_cli import GradMonitor, save_grads
from gradclip_cli import clip_grad_norm_ as gradclip_clip_grad_norm_
from gradclip_cli.core.spikes import FEW_SERIES, SpikeDetector
from tests.cli.support import REPO, as_float, ref_norm
from tests.core.spike_reference import group_z
from tests.core.test_elements import layouts, ref_distinct_norm

from .support import assert_norms_match, culprit, inspect_dump, read_log, reference_norms

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


class Tiny(torch.nn.Module):
    """A language-model-shaped module: embedding, two blocks, a head tied to the embedding."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.wte = torch.nn.Embedding(16, 8, dtype=dtype)
        self.h = torch.nn.ModuleList(torch.nn.Linear(8, 8, dtype=dtype) for _ in range(2))
        self.lm_head = torch.nn.Linear(8, 16, bias=False, dtype=dtype)
        self.lm_head.weight = self.wte.weight


# Steady sizes that repeat every 5 steps: once the history holds one cycle, no
# step is more than 1.5 standard deviations from the mean, so only an injected
# spike can cross z = 2.5, whatever the noise of a random series would do.
CYCLE = [1.0, 1.1, 0.9, 1.05, 0.95]


def fill_grads(model: torch.nn.Module, step: int, spike: dict[str, float] | None = None) -> None:
    """Gradients as after a backward pass, of steady size; ``spike`` scales some."""
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(1000 * step + i)
        grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
        grad *= CYCLE[step % 5] * (spike or {}).get(name, 1.0) / grad.norm()
        p.grad = grad.to(p.device, p.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_line_holds_the_float64_norms_of_that_step(tmp_path, dtype):
    model = Tiny(dtype)
    log = tmp_path / "logs" / "grads.jsonl"
    with GradMonitor(model, log, tmp_path / "spikes") as monitor:
        want = []
        for step in range(6):
            fill_grads(model, step)
            want.append(reference_norms(model))
            record = monitor.step(step)
            assert record is not None and record["step"] == step
    records = read_log(log)
    assert [r["step"] for r in records] == list(range(6))
    for step, (record, (total, groups)) in enumerate(zip(records, want)):
        # The head is tied to the embedding: it counts once, under the first name.
        assert list(groups) == ["wte", "h.0", "h.1"]
        assert_norms_match(record, total, groups)
        assert record["norm_type"] == 2.0
        assert record["nonfinite"] == {"nan": 0, "posinf": 0, "neginf": 0}
        assert (record["z"] is None) == (step < 5)  # 5 earlier points before a judgement
        assert record["spike"] is False and record["dump"] is None


@pytest.mark.parametrize("p", [1.0, 3.0, math.inf])
def test_other_norm_types_and_group_rules(tmp_path, p):
    model = Tiny()
    fill_grads(model, 0)
    record = GradMonitor(model, tmp_path / "g.jsonl", None, norm_type=p, group_by="tensor").step()
    grads = {n: q.grad for n, q in model.named_parameters()}
    assert record["norm_type"] == (p if math.isfinite(p) else "inf")
    assert math.isclose(as_float(record["total_norm"]), ref_norm(list(grads.values()), p),
                        rel_tol=1e-6)
    assert list(record["groups"]) == list(grads)
    for name, grad in grads.items():
        assert math.isclose(record["groups"][name], ref_norm([grad], p), rel_tol=1e-6)


def test_every_logs_only_the_steps_it_names_and_appends(tmp_path):
    model = Tiny()
    log = tmp_path / "grads.jsonl"
    log.write_text('{"earlier": "run"}\n')
    monitor = GradMonitor(model, log, None, every=4)
    returned = []
    for step in range(10):
        fill_grads(model, step)
        returned.append(monitor.step())  # steps counted by the monitor: 0, 1, 2, ...
    monitor.close()
    assert [r is not None for r in returned] == [s % 4 == 0 for s in range(10)]
    lines = log.read_text().splitlines()
    assert lines[0] == '{"earlier": "run"}'
    assert [json.loads(line)["step"] for line in lines[1:]] == [0, 4, 8]


def test_a_step_without_gradients_is_not_logged_and_said_once(tmp_path):
    monitor = GradMonitor(Tiny(), tmp_path / "grads.jsonl", tmp_path / "spikes", every=2)
    with pytest.warns(UserWarning, match=r"no parameter .* gradient at step 0.*after backward"):
        assert monitor.step(0) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert monitor.step(1) is None  # not a step to log: nothing is looked at
        assert monitor.step(2) is None  # said once
        monitor.clip_grad_norm_(1.0, 4)
    assert not (tmp_path / "grads.jsonl").exists()


def test_clip_grad_norm_without_gradients_says_so_once(tmp_path):
    monitor = GradMonitor(Tiny(), tmp_path / "grads.jsonl", None)
    with pytest.warns(UserWarning, match=r"no parameter .* gradient at step 3"):
        total = monitor.clip_grad_norm_(1.0, 3)
    assert float(total) == 0.0
    assert not (tmp_path / "grads.jsonl").exists()


def test_the_spike_names_the_layer_and_its_dump_shows_it(tmp_path, gradclip):
    model = Tiny()
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", tmp_path / "spikes")
    for step in range(40):
        fill_grads(model, step, {"h.1.weight": 1e4} if step in (10, 30) else None)
        monitor.step(step)
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records if r["spike"]] == [10, 30]
    early, spike = records[10], records[30]
    assert early["spike_groups"] == spike["spike_groups"] == ["h.1"]
    assert spike["z"] > 2.5 and early["z"] > 2.5
    assert all(r["z"] is None for r in records[:5]) and records[5]["z"] is not None
    # Step 10 has 9 points of history, fewer than warmup (25): flagged, not dumped.
    assert early["dump"] is None
    dump = tmp_path / "spikes" / "step-30.pt"
    assert spike["dump"] == str(dump) and monitor.dumps == [dump]
    assert sorted(os.listdir(tmp_path / "spikes")) == ["step-30.pt"]
    assert torch.load(dump, weights_only=True)["step"] == 30
    report = inspect_dump(gradclip, dump)
    assert culprit(report) == "h.1"
    assert math.isclose(as_float(report["total_norm"]), as_float(spike["total_norm"]),
                        rel_tol=1e-6)


@pytest.mark.parametrize("layers", [4, 70])
def test_spikes_are_named_in_few_or_many_groups_and_in_groups_that_appear_later(
    tmp_path, layers
):
    # Half the layers get gradients from step 8 on: with 70 layers the groups
    # then outgrow plain floats (FEW_SERIES) and move, history and all, into tensors.
    model = torch.nn.Module()
    model.h = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(layers))
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None)
    last = f"h.{layers - 1}"
    for step in range(40):
        fill_grads(model, step, {f"{last}.weight": 1e4} if step in (15, 33) else None)
        if step < 8:
            for layer in model.h[layers // 2:]:
                layer.weight.grad = layer.bias.grad = None
        monitor.step(step)
    assert (monitor._group_detectors.many is None) == (layers <= FEW_SERIES)
    detectors: dict[str, SpikeDetector] = {}  # the rule, one series a group, from the log
    records = read_log(tmp_path / "grads.jsonl")
    for r in records:
        # The step's groups are judged at once, against the groups' threshold.
        threshold = group_z(2.5, len(r["groups"]))
        want = [g for g, v in r["groups"].items()
                if detectors.setdefault(g, SpikeDetector()).update(v, threshold).spike]
        assert r["spike_groups"] == want, r["step"]
    assert records[15]["spike_groups"] == records[33]["spike_groups"] == [last]
    assert len(records[7]["groups"]) == layers // 2 and len(records[8]["groups"]) == layers


def test_nonfinite_gradients_are_counted_and_dumped(tmp_path, gradclip):
    model = Tiny()
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", tmp_path / "spikes")
    fill_grads(model, 0)
    model.h[0].bias.grad[[1, 2]] = torch.tensor([math.nan, -math.inf])
    model.h[1].weight.grad[0, 0] = math.inf
    record = monitor.step(7)
    assert record["total_norm"] == "nan"
    assert record["groups"]["h.0"] == "nan" and record["groups"]["h.1"] == "inf"
    assert isinstance(record["groups"]["wte"], float)
    assert record["nonfinite"] == {"nan": 1, "posinf": 1, "neginf": 1}
    assert record["z"] is None and record["spike"] is False
    assert record["dump"] == str(tmp_path / "spikes" / "step-7.pt")
    report = inspect_dump(gradclip, tmp_path / "spikes" / "step-7.pt")
    assert report["nonfinite"] == {"nan": 1, "posinf": 1, "neginf": 1}
    assert culprit(report) == "h.0"
    assert read_log(tmp_path / "grads.jsonl") == [record]


def test_max_dumps_keeps_the_first_ones(tmp_path):
    model = Tiny()
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", tmp_path / "spikes", max_dumps=2)
    fill_grads(model, 0)
    model.h[0].weight.grad.fill_(math.nan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dumps = [monitor.step(step)["dump"] for step in range(5)]
    assert dumps == [str(tmp_path / "spikes" / f"step-{s}.pt") for s in (0, 1)] + [None] * 3
    assert sorted(os.listdir(tmp_path / "spikes")) == ["step-0.pt", "step-1.pt"]
    assert len(caught) == 1 and "max_dumps" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller's line

    nothing = GradMonitor(model, tmp_path / "other.jsonl", tmp_path / "none", max_dumps=0)
    assert nothing.step(0)["dump"] is None
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_grad_norm_logs_and_clips_as_the_drop_in(tmp_path, dtype, max_norm):
    model, twin = Tiny(dtype), Tiny(dtype)
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None, every=2)
    for step in range(4):
        fill_grads(model, step)
        fill_grads(twin, step)
        total_ref, _ = reference_norms(model)
        got = monitor.clip_grad_norm_(max_norm, step)
        want = gradclip_clip_grad_norm_(twin.parameters(), max_norm)
        assert got.dtype == want.dtype and got.shape == () and got.device == want.device
        assert math.isclose(float(got), total_ref, rel_tol=1e-6)
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
        if max_norm < total_ref:
            assert math.isclose(reference_norms(model)[0], max_norm, rel_tol=1e-2)
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [0, 2]


@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_sparse_gradients_are_measured_clipped_and_dumped(tmp_path, gradclip, p):
    # nn.Embedding(sparse=True) on a real run: its gradient is an uncoalesced
    # sparse COO tensor (a token seen twice is two entries). Logged norms are
    # its dense values' norms, clipping scales the gradient itself (not a
    # coalesced copy), on logged steps and on the others, and a NaN in it dumps.
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(16, 4, sparse=True)
    model.head = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", tmp_path / "spikes", norm_type=p,
                          every=2)

    def dense_norms():
        grads = {n: q.grad.to_dense().double() for n, q in model.named_parameters()}
        every = torch.cat([g.flatten() for g in grads.values()])
        return float(torch.linalg.vector_norm(every, p)), grads

    for step in range(6):
        opt.zero_grad()
        tokens = torch.tensor([[1, 5, 5, 9], [2, 2, 2, 7]])
        model.head(model.emb(tokens)).square().sum().backward()
        assert model.emb.weight.grad.is_sparse and not model.emb.weight.grad.is_coalesced()
        if step == 4:
            model.emb.weight.grad._values()[0, 0] = math.nan
        total, grads = dense_norms()
        got = monitor.clip_grad_norm_(0.5, step)
        if step == 4:
            assert math.isnan(float(got))
            continue
        assert math.isclose(float(got), total, rel_tol=1e-6)
        coef = min(1.0, 0.5 / (total + 1e-6))
        for name, q in model.named_parameters():
            torch.testing.assert_close(q.grad.to_dense().double(), grads[name] * coef,
                                       rtol=1e-6, atol=0)
        opt.step()
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4]
    assert records[2]["groups"]["emb"] == "nan" and records[2]["nonfinite"]["nan"] == 1
    assert records[2]["dump"] is not None
    result = gradclip("inspect", records[2]["dump"], "--format", "json", "--allow-nonfinite")
    assert result.code == 0 and result.json()["nonfinite"]["nan"] == 1


@pytest.mark.parametrize("every", [1, 2])
def test_gradients_sharing_elements_count_and_scale_them_once(tmp_path, every):
    # Two gradients that are overlapping views of one buffer (not a tie): each
    # shared element counts once, in the first one's group, and is scaled once,
    # as the drop-ins do, on logged steps and on the others.
    def model_and_buffer():
        model = torch.nn.Module()
        model.a = torch.nn.Parameter(torch.zeros(6))
        model.b = torch.nn.Parameter(torch.zeros(6))
        buffer = torch.arange(1.0, 11.0)
        model.a.grad, model.b.grad = buffer[:6], buffer[4:]
        return model, buffer

    model, buffer = model_and_buffer()
    twin, twin_buffer = model_and_buffer()
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None, group_by="tensor", every=every)
    for step in range(2):
        want_total = float(buffer.double().norm())
        got = monitor.clip_grad_norm_(5.0, step)
        assert math.isclose(float(got), want_total, rel_tol=1e-6)
        drop_in = gradclip_clip_grad_norm_(twin.parameters(), 5.0)
        assert math.isclose(float(drop_in), float(got), rel_tol=1e-6)
        torch.testing.assert_close(buffer, twin_buffer, rtol=1e-6, atol=0)
        assert math.isclose(float(buffer.double().norm()), 5.0, rel_tol=1e-5)
    record = read_log(tmp_path / "grads.jsonl")[0]
    first = torch.arange(1.0, 11.0, dtype=torch.float64)
    assert math.isclose(record["total_norm"], float(first.norm()), rel_tol=1e-6)
    assert math.isclose(record["groups"]["a"], float(first[:6].norm()), rel_tol=1e-6)
    assert math.isclose(record["groups"]["b"], float(first[6:].norm()), rel_tol=1e-6)


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("name", [n for n, _ in layouts() if n != "separate storages"])
def test_every_sharing_layout_is_measured_and_clipped_as_the_drop_in(tmp_path, name, p):
    # The core's layouts of views that share storage (ties, transposes,
    # overlaps, expansions, self-overlap), each view a parameter's gradient:
    # the logged total is the norm of the distinct elements, and a logged
    # clip leaves the storage as the drop-in leaves a copy of it.
    def model_of(tensors):
        model = torch.nn.Module()
        for i, t in enumerate(tensors):
            param = torch.nn.Parameter(torch.zeros(t.shape))
            param.grad = t
            model.register_parameter(f"p{i}", param)
        return model

    tensors = dict(layouts())[name]
    copies = copy.deepcopy(tensors)  # keeps which of them share storage
    want = ref_distinct_norm(tensors, p)
    monitor = GradMonitor(model_of(tensors), tmp_path / "grads.jsonl", None, norm_type=p,
                          group_by="tensor")
    assert math.isclose(as_float(monitor.step(0)["total_norm"]), want, rel_tol=1e-6)
    max_norm = want / 3
    got = monitor.clip_grad_norm_(max_norm, 1)
    assert math.isclose(float(got), want, rel_tol=1e-6)
    assert math.isclose(float(gradclip_clip_grad_norm_(model_of(copies).parameters(), max_norm,
                                                       p)), want, rel_tol=1e-6)
    for a, b in zip(tensors, copies):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert math.isclose(ref_distinct_norm(tensors, p), max_norm, rel_tol=1e-5)


def test_an_expanded_gradient_counts_and_scales_its_stored_element_once(tmp_path):
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(6))
    model.b = torch.nn.Parameter(torch.zeros(2))
    stored = torch.tensor([3.0])
    model.a.grad, model.b.grad = stored.expand(6), torch.tensor([4.0, 0.0])
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None)
    assert monitor.step(0)["total_norm"] == 5.0  # sqrt(3**2 + 4**2): 3 is stored once
    assert float(monitor.clip_grad_norm_(1.0, 1)) == 5.0
    assert math.isclose(float(stored), 3.0 / (5.0 + 1e-6), rel_tol=1e-6)
    assert math.isclose(float(model.b.grad[0]), 4.0 / (5.0 + 1e-6), rel_tol=1e-6)


@pytest.mark.parametrize("name", [n for n, _ in layouts()])
def test_saved_gradients_that_share_elements_inspect_to_the_logged_total(tmp_path, gradclip,
                                                                         name):
    # save_grads (what a dump writes) of gradients that share storage elements:
    # `gradclip inspect` of the file reports the total the monitor logged for
    # them, each stored element once, not the total of separate copies.
    tensors = dict(layouts())[name]
    model = torch.nn.Module()
    for i, t in enumerate(tensors):
        param = torch.nn.Parameter(torch.zeros(t.shape))
        param.grad = t
        model.register_parameter(f"p{i}", param)
    want = ref_distinct_norm(tensors, 2.0) if name != "separate storages" else ref_norm(
        [t.double() for t in tensors], 2.0)
    logged = GradMonitor(model, tmp_path / "grads.jsonl", None).step(0)["total_norm"]
    assert math.isclose(logged, want, rel_tol=1e-6)
    save_grads(model, tmp_path / "grads.pt", step=0)
    report = inspect_dump(gradclip, tmp_path / "grads.pt")
    assert math.isclose(as_float(report["total_norm"]), logged, rel_tol=1e-6)
    rows = {row["name"]: row for row in report["tensors"]}  # a tie is listed once
    for i, t in enumerate(tensors):
        if f"p{i}" in rows:
            assert rows[f"p{i}"]["shape"] == list(t.shape)
            assert math.isclose(as_float(rows[f"p{i}"]["norm"]), ref_distinct_norm([t], 2.0),
                                rel_tol=1e-6)
    # A .safetensors file cannot hold views of one copy: refused, never miscounted.
    if name in ("separate storages", "disjoint views of one buffer"):
        save_grads(model, tmp_path / "grads.safetensors")
        report = inspect_dump(gradclip, tmp_path / "grads.safetensors")
        assert math.isclose(as_float(report["total_norm"]), logged, rel_tol=1e-6)
    else:
        with pytest.raises(ValueError, match="save to a .pt path"):
            save_grads(model, tmp_path / "grads.safetensors")
        assert not (tmp_path / "grads.safetensors").exists()


@pytest.mark.parametrize("clip_spikes", [False, True])
def test_clip_grad_norm_of_a_total_beyond_float32_clips_as_the_drop_in(tmp_path, clip_spikes):
    """Float32 gradients whose total (1.2e39) is beyond float32's range: the returned
    total is inf, as the drop-in's, and the gradients are clipped to ``max_norm``, as the
    drop-in clips them, not multiplied by ``max_norm / inf`` (all zero)."""
    model, twin = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    for m in (model, twin):
        m.weight.grad = torch.full((4, 4), 3e38)
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None, clip_spikes=clip_spikes)
    got = monitor.clip_grad_norm_(1.0, 0)
    want = gradclip_clip_grad_norm_(twin.parameters(), 1.0)
    assert math.isinf(float(got)) and math.isinf(float(want))
    (record,) = read_log(tmp_path / "grads.jsonl")
    assert math.isclose(as_float(record["total_norm"]), 4 * 3e38, rel_tol=1e-6)
    assert math.isclose(ref_norm([model.weight.grad], 2.0), 1.0, rel_tol=1e-6)
    torch.testing.assert_close(model.weight.grad, twin.weight.grad, rtol=1e-6, atol=0)


def test_clip_grad_norm_error_if_nonfinite_logs_first_and_changes_nothing(tmp_path):
    model = Tiny()
    fill_grads(model, 0)
    model.h[1].bias.grad[0] = math.nan
    before = [p.grad.clone() for p in model.parameters()]
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", tmp_path / "spikes")
    with pytest.raises(RuntimeError, match="non-finite"):
        monitor.clip_grad_norm_(1.0, 3, error_if_nonfinite=True)
    for a, b in zip(model.parameters(), before):
        torch.testing.assert_close(a.grad, b, equal_nan=True, rtol=0, atol=0)
    (record,) = read_log(tmp_path / "grads.jsonl")
    assert record["step"] == 3 and record["dump"] is not None


def test_names_that_look_like_markup_stay_one_json_line(tmp_path):
    model = torch.nn.Module()
    model.add_module('a"b\nc\u2028', torch.nn.Linear(2, 2))
    fill_grads(model, 0)
    GradMonitor(model, tmp_path / "grads.jsonl", None).step(0)
    (record,) = read_log(tmp_path / "grads.jsonl")
    assert list(record["groups"]) == ['a"b\nc\u2028']


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"every": 0}, "every must be"),
        ({"every": 1.5}, "every must be"),
        ({"max_dumps": -1}, "max_dumps must be"),
        ({"norm_type": 0}, "norm_type must be"),
        ({"group_by": "bogus"}, "--group-by must be"),
        ({"z": -1}, "z must be"),
        ({"alpha": 1.0}, "alpha must be"),
        ({"warmup": 0}, "warmup must be"),
    ],
)
def test_bad_options_are_refused_when_made(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        GradMonitor(Tiny(), tmp_path / "grads.jsonl", **options)


DDP_RANK = """
import json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from gradclip_cli import GradMonitor, save_grads
rank, world, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                        world_size=world)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
monitor = GradMonitor(model, f"{folder}/grads.jsonl", f"{folder}/spikes", warmup=5)
torch.manual_seed(rank)
batch = torch.randn(16, 4)  # the same each step: steady norms, so only step 7 spikes
totals, grads = [], []
for step in range(8):
    loss = model(batch).square().mean()
    if step == 7:
        loss = loss * 1e6
    loss.backward()
    totals.append(float(monitor.clip_grad_norm_(1.0, step)))
    grads.append([p.grad.double().sum().item() for p in model.parameters()])
    model.zero_grad()
print(json.dumps({"rank": rank, "totals": totals, "grads": grads}), flush=True)
dist.barrier()
os._exit(9)  # no cleanup, no flush at exit: what a killed process leaves behind
"""


def test_under_ddp_ranks_agree_rank_0_alone_writes_and_a_crash_leaves_whole_lines(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", DDP_RANK, str(rank), "2", str(tmp_path)],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 9, err
        outs.append(json.loads(out.splitlines()[-1]))
    # All-reduced gradients: both ranks measure the same totals and clip alike.
    assert outs[0]["totals"] == outs[1]["totals"]
    assert outs[0]["grads"] == outs[1]["grads"]
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(8))  # one writer: no line twice
    assert [as_float(r["total_norm"]) for r in records] == pytest.approx(outs[0]["totals"],
                                                                         rel=1e-6)
    assert records[-1]["spike"] and records[-1]["dump"] is not None
    assert os.listdir(tmp_path / "spikes") == ["step-7.pt"]


def test_the_readme_plain_loop_runs_as_shown(tmp_path, monkeypatch, gradclip):
    section = (REPO / "docs" / "guides" / "training-loop.md").read_text(encoding="utf-8")
    code = section[section.index("```python\n") + len("```python\n"):]
    code = code[: code.index("```")]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "training-loop.md", "exec"), {})
    records = read_log(tmp_path / "grads.jsonl")
    assert [r["step"] for r in records] == list(range(60))
    spike = records[50]
    assert spike["spike_groups"] == ["fc2"] and spike["dump"] == "spikes/step-50.pt"
    assert culprit(inspect_dump(gradclip, tmp_path / "spikes" / "step-50.pt")) == "fc2"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_only_logged_steps_synchronise(tmp_path):
    model, twin = Tiny().cuda(), Tiny().cuda()
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None, every=3)
    for step in range(6):
        fill_grads(model, step)
        fill_grads(twin, step)
        logged = step % 3 == 0
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(0 if logged else "error")
        try:
            if not logged:
                assert monitor.step(step) is None
            total = monitor.clip_grad_norm_(0.5, step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        want = gradclip_clip_grad_norm_(twin.parameters(), 0.5)
        assert total.device == want.device and total.dtype == want.dtype
        assert math.isclose(float(total), float(want), rel_tol=1e-6)
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    assert [r["step"] for r in read_log(tmp_path / "grads.jsonl")] == [0, 3]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_on_cuda_lines_hold_the_float64_norms_and_the_nonfinite_counts(tmp_path, dtype):
    # The accelerator's step: fused float64 norms certified on the device, one
    # read; a step with a NaN or an inf goes on to the exact path, which counts.
    model = Tiny(dtype).cuda()
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log, None) as monitor:
        for step in range(3):
            fill_grads(model, step)
            total, groups = reference_norms(model)
            assert_norms_match(monitor.step(step), total, groups)
        model.h[0].bias.grad[1] = math.nan
        model.h[1].weight.grad[0, 0] = -math.inf
        record = monitor.step(3)
    assert record["total_norm"] == "nan"
    assert record["groups"]["h.0"] == "nan" and record["groups"]["h.1"] == "inf"
    assert record["nonfinite"] == {"nan": 1, "posinf": 0, "neginf": 1}
    assert read_log(log)[-1] == record
