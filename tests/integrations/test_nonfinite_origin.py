"""``GradMonitor(locate_nonfinite=True)``: where a NaN began, on real models.

A NaN is injected into a known layer's forward output (the origin names that
module) or into the gradient flowing back through a known layer (it names
that layer's parameter), and one arises by itself in backward (the derivative
of ``sqrt`` at 0). The references are independent of the monitor: the module
is the one the test corrupts, and the accumulation order is recorded by the
test's own post-accumulate-grad hooks.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks import host_ops
from gradclip_cli import GradMonitor
from tests.cli.conftest import gradclip  # noqa: F401
from tests.cli.support import REPO, logical_lines

transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, bos_token_id=None, eos_token_id=None,
                                     loss_type="ForCausalLM")
    return transformers.GPT2LMHeadModel(config)


TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


class AccumulationOrder:
    """The test's own record of the order autograd accumulates gradients in."""

    def __init__(self, model: torch.nn.Module):
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.order: list[str] = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._seen)

    def _seen(self, p):
        name = self.names[id(p)]
        if name not in self.order:
            self.order.append(name)

    def first_nonfinite(self, model) -> str:
        grads = dict(model.named_parameters())
        return next(n for n in self.order if not torch.isfinite(grads[n].grad).all())


def gpt2_step(model, monitor, step):
    model.zero_grad()
    loss = model(TOKENS, labels=TOKENS).loss
    loss.backward()
    return monitor.step(step)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_nan_made_in_a_forward_names_that_module(tmp_path, gradclip):  # noqa: F811
    model = tiny_gpt2()
    order = AccumulationOrder(model)
    culprit = model.transformer.h[1].mlp.c_fc
    corrupt = {"on": False}

    def nan_out(module, args, output):
        if corrupt["on"]:
            output = output.clone()
            output[0, 3, 5] = math.nan
        return output

    culprit.register_forward_hook(nan_out)
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log, None, locate_nonfinite=True) as monitor:
        for step in range(3):
            assert gpt2_step(model, monitor, step)["nonfinite_origin"] is None
        corrupt["on"] = True
        record = gpt2_step(model, monitor, 3)
        first_nonfinite = order.first_nonfinite(model)
        corrupt["on"] = False
        after = gpt2_step(model, monitor, 4)
    assert record["nonfinite"]["nan"] > 0
    # The NaN reaches the loss, so every gradient is NaN: the forward half locates it.
    assert record["nonfinite_origin"] == {"forward": "transformer.h.1.mlp.c_fc",
                                          "backward": first_nonfinite}
    assert after["nonfinite_origin"] is None  # the flags start afresh each step
    assert [r.get("nonfinite_origin") for r in lines(log)] == [None, None, None,
                                                              record["nonfinite_origin"], None]
    # trend shows it: in its JSON, and in the verdict people read.
    result = gradclip("trend", log, "--format", "json", "--fail-on", "any")
    assert result.code == 1
    points = result.json()["points"]
    assert [p["nonfinite_origin"] for p in points] == [None, None, None,
                                                      record["nonfinite_origin"], None]
    table = gradclip("trend", log, "--fail-on", "any")
    verdict = logical_lines(table.out)[-1]
    assert verdict.startswith("FAIL") and "forward output of transformer.h.1.mlp.c_fc" in verdict


def test_a_nan_made_in_backward_names_the_first_parameter_it_reached(tmp_path,
                                                                   gradclip):  # noqa: F811
    model = tiny_gpt2()
    order = AccumulationOrder(model)
    layer = model.transformer.h[0].mlp.c_proj

    def nan_grad(module, grad_output):
        g = grad_output[0].clone()
        g[0, 2, 7] = math.nan
        return (g,)

    with GradMonitor(model, tmp_path / "grads.jsonl", None, locate_nonfinite=True) as monitor:
        assert gpt2_step(model, monitor, 0)["nonfinite_origin"] is None
        handle = layer.register_full_backward_pre_hook(nan_grad)
        record = gpt2_step(model, monitor, 1)
        handle.remove()
    origin = record["nonfinite_origin"]
    assert origin["forward"] is None  # the forward was clean
    assert origin["backward"] in ("transformer.h.0.mlp.c_proj.weight",
                                  "transformer.h.0.mlp.c_proj.bias")
    assert origin["backward"] == order.first_nonfinite(model)
    # Later layers' gradients stayed finite; they were accumulated before it.
    names = dict(model.named_parameters())
    assert torch.isfinite(names["transformer.h.2.mlp.c_proj.weight"].grad).all()
    assert order.order.index("transformer.h.2.mlp.c_proj.weight") < order.order.index(
        origin["backward"])
    table = gradclip("trend", tmp_path / "grads.jsonl")
    verdict = logical_lines(table.out)[-1]
    assert table.code == 1 and verdict.startswith("FAIL")
    assert f"began: forward clean, first non-finite gradient {origin['backward']}" in verdict


class SqrtNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.root = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        # sqrt(y * (y > 0)) is finite forward; where y < 0 its derivative is
        # sqrt'(0) * 0 = inf * 0 = NaN (torch.relu's backward would mask it instead).
        y = self.root(torch.relu(self.embed(x)))
        return self.head(torch.sqrt(y * (y > 0)))


def test_a_nan_from_the_derivative_of_sqrt_at_zero_names_the_layer_below_it(tmp_path):
    torch.manual_seed(3)
    model = SqrtNet()
    order = AccumulationOrder(model)
    with GradMonitor(model, tmp_path / "grads.jsonl", None, group_by="tensor",
                     locate_nonfinite=True) as monitor:
        x = torch.randn(16, 4)
        model(x).sum().backward()
        record = monitor.step(0)
    assert record["nonfinite"]["nan"] > 0
    assert torch.isfinite(model.head.weight.grad).all()
    assert record["nonfinite_origin"] == {"forward": None, "backward": "root.weight"} or \
        record["nonfinite_origin"] == {"forward": None, "backward": "root.bias"}
    assert record["nonfinite_origin"]["backward"] == order.first_nonfinite(model)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.act = torch.nn.GELU()
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.act(self.embed(x)))


def test_micro_batches_and_evaluation_forwards(tmp_path):
    model = Mlp()
    bad = {"on": False, "calls": 0}

    def inf_out(module, args, output):
        bad["calls"] += 1
        return output * math.inf if bad["on"] else output

    model.embed.register_forward_hook(inf_out)
    x = torch.rand(8, 4) + 1
    with GradMonitor(model, tmp_path / "grads.jsonl", None, locate_nonfinite=True) as monitor:
        # An evaluation forward without gradients that goes non-finite is not a step's.
        bad["on"] = True
        with torch.no_grad():
            model(x)
        bad["on"] = False
        model(x).sum().backward()
        assert monitor.step(0)["nonfinite_origin"] is None
        # Two micro-batches: the second one goes wrong, and the step still knows where.
        model.zero_grad()
        model(x).sum().backward()
        bad["on"] = True
        model(x).sum().backward()
        bad["on"] = False
        record = monitor.step(1)
    assert record["nonfinite_origin"]["forward"] == "embed"


def test_without_the_option_lines_are_unchanged_and_bad_values_are_refused(tmp_path):
    model = Mlp()
    model(torch.rand(2, 4) + 1).sum().backward()
    record = GradMonitor(model, tmp_path / "a.jsonl", None).step(0)
    assert "nonfinite_origin" not in record
    with pytest.raises(ValueError, match="locate_nonfinite must be True or False"):
        GradMonitor(model, tmp_path / "b.jsonl", None, locate_nonfinite=1)


def test_trend_refuses_a_malformed_origin_naming_the_line(tmp_path, gradclip):  # noqa: F811
    log = tmp_path / "grads.jsonl"
    good = {"schema": "gradclip.monitor/1", "step": 0, "total_norm": 1.0, "groups": {},
            "nonfinite": {"nan": 0, "posinf": 0, "neginf": 0}}
    log.write_text(json.dumps(good) + "\n"
                   + json.dumps({**good, "step": 1, "nonfinite_origin": ["x"]}) + "\n")
    result = gradclip("trend", log)
    assert result.code == 3
    assert len(result.err_lines) == 1 and f"{log}:2" in result.err
    assert "nonfinite_origin" in result.err and "Traceback" not in result.err


def test_on_an_accelerator_hooks_read_nothing_and_a_clean_step_reads_once(tmp_path):
    # The accelerator path on meta (benchmarks/host_ops.py): forward flags stay on
    # the device, and a clean logged step reads back its norms alone, as without them.
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8)).to("meta")
    x = torch.empty(4, 64, device="meta")
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None, locate_nonfinite=True)
    with host_ops.foreach_on_meta():
        with host_ops.HostOpCounter() as counter:
            model(x).sum().backward()
        assert counter.reads == 0
        for p in model.parameters():
            p.grad = torch.empty_like(p)
        with host_ops.HostOpCounter() as counter:
            record = monitor.step(0)
        assert counter.reads == 1 and record["nonfinite_origin"] is None
        with host_ops.HostOpCounter() as counter:
            model(x).sum()
        assert counter.reads == 0


class Outer(torch.nn.Module):
    """Returns its child's output object, changed in place on the chosen step."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.poison = False

    def forward(self, x):
        y = self.inner(x)
        if self.poison:
            y.mul_(math.inf)  # the same tensor object, changed after inner returned it
        return y


def test_an_output_changed_in_place_by_its_parent_names_the_parent(tmp_path):
    model = torch.nn.Sequential(Outer(), torch.nn.Linear(4, 1))
    with GradMonitor(model, tmp_path / "grads.jsonl", None, locate_nonfinite=True) as monitor:
        model(torch.rand(3, 4) + 1).sum().backward()
        assert monitor.step(0)["nonfinite_origin"] is None
        model[0].poison = True
        model.zero_grad()
        model(torch.rand(3, 4) + 1).sum().backward()
        record = monitor.step(1)
    assert record["nonfinite_origin"]["forward"] == "0"


class LayerDrop(torch.nn.Module):
    """A stack whose layers a step may skip (LayerDrop, stochastic depth): a layer's
    first forward and first gradient can come steps after the others'."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.embed = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 1)
        self.skip: set[int] = set()

    def forward(self, x):
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                h = torch.tanh(layer(h))
        return self.head(h)


class ForwardOrder:
    """The test's own record of which modules' outputs held a non-finite value, in the
    order they finished this step's forward."""

    def __init__(self, model: torch.nn.Module):
        self.finished: list[tuple[str, bool]] = []
        for name, module in model.named_modules():
            module.register_forward_hook(
                lambda m, a, out, name=name: self.finished.append(
                    (name, not torch.isfinite(out).all())))

    def first_nonfinite(self) -> str:
        return next(name for name, bad in self.finished if bad)


def test_a_layer_first_run_on_a_later_step_is_named_where_it_ran(tmp_path):
    model = LayerDrop()
    culprit = model.layers[1]
    corrupt = {"on": False}
    culprit.register_forward_hook(
        lambda m, a, out: out * math.nan if corrupt["on"] else out)
    order = ForwardOrder(model)
    x = torch.rand(3, 4)
    with GradMonitor(model, tmp_path / "grads.jsonl", None, locate_nonfinite=True) as monitor:
        model.skip = {1}  # dropped on the first steps: it finishes first at step 2
        for step in range(2):
            model.zero_grad()
            model(x).sum().backward()
            assert monitor.step(step)["nonfinite_origin"] is None
        model.skip, corrupt["on"] = set(), True
        model.zero_grad()
        order.finished.clear()
        model(x).sum().backward()
        record = monitor.step(2)
    assert order.first_nonfinite() == "layers.1"  # its output, before layers.2's and head's
    assert record["nonfinite_origin"]["forward"] == "layers.1"


def test_a_layer_first_given_a_gradient_on_a_later_step_is_named_where_it_was(tmp_path):
    model = LayerDrop()
    order = AccumulationOrder(model)

    def nan_grad(module, grad_output):
        return (grad_output[0] * math.nan,)

    x = torch.rand(3, 4)
    with GradMonitor(model, tmp_path / "grads.jsonl", None, locate_nonfinite=True) as monitor:
        model.skip = {1}
        model(x).sum().backward()
        assert monitor.step(0)["nonfinite_origin"] is None
        model.skip = set()
        model.layers[1].register_full_backward_pre_hook(nan_grad)
        model.zero_grad()
        order.order.clear()
        model(x).sum().backward()
        record = monitor.step(1)
    assert record["nonfinite_origin"]["forward"] is None
    # layers.2 and head were accumulated first and stayed finite; layers.1 is where it began.
    assert order.first_nonfinite(model) in ("layers.1.weight", "layers.1.bias")
    assert record["nonfinite_origin"]["backward"] == order.first_nonfinite(model)


class SharedDropout(torch.nn.Module):
    """One dropout module called twice, before and after ``mid`` (a common shape:
    GPT-style models apply ``self.drop`` at several places)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.drop = torch.nn.Dropout(0.1)
        self.embed = torch.nn.Linear(4, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.drop(self.mid(self.drop(self.embed(x)))))


@pytest.mark.parametrize("culprit", ["mid", "drop"])
def test_a_module_called_twice_is_placed_by_the_call_whose_output_went_bad(tmp_path, culprit):
    # drop finishes first (its first call) and again after mid: a NaN made by mid
    # reaches drop's second call, which must not place drop ahead of mid; a NaN made
    # by drop's first call is drop's.
    model = SharedDropout()
    corrupt = {"on": False, "calls": 0}

    def nan_out(module, args, out):
        corrupt["calls"] += 1
        return out * math.nan if corrupt["on"] and corrupt["calls"] == 1 else out

    getattr(model, culprit).register_forward_hook(nan_out)
    order = ForwardOrder(model)
    x = torch.rand(3, 4)
    with GradMonitor(model, tmp_path / "grads.jsonl", None, locate_nonfinite=True) as monitor:
        model(x).sum().backward()
        assert monitor.step(0)["nonfinite_origin"] is None
        corrupt.update(on=True, calls=0)
        order.finished.clear()
        model.zero_grad()
        model(x).sum().backward()
        record = monitor.step(1)
    assert order.first_nonfinite() == culprit
    assert record["nonfinite_origin"]["forward"] == culprit


@pytest.mark.skipif(shutil.which("c++") is None, reason="inductor compiles C++ on the CPU")
def test_a_compiled_model_runs_and_names_the_module(tmp_path):
    # torch.compile traced the hooks into the graph, and aot_autograd refused their
    # in-place writes to views of one flags tensor: the training step raised.
    model = SharedDropout()
    compiled = torch.compile(model)
    x = torch.rand(3, 4)
    with GradMonitor(model, tmp_path / "grads.jsonl", None, locate_nonfinite=True) as monitor:
        records = []
        for step in range(3):
            model.zero_grad()
            with torch.no_grad():
                model.mid.bias[0] = math.nan if step == 1 else 0.0
            compiled(x).sum().backward()
            records.append(monitor.step(step)["nonfinite_origin"])
    assert records[0] is None and records[2] is None
    assert records[1]["forward"] == "mid"


def test_autopsy_of_a_non_finite_step_states_where_the_monitor_located_it(tmp_path,
                                                                         gradclip):  # noqa: F811
    # A NaN made in backward through layers.1 reaches embed below it within the same
    # step: the groups' onsets tie, and the monitor's origin is what places it.
    model = LayerDrop()
    order = AccumulationOrder(model)
    x = torch.rand(3, 4)
    log = tmp_path / "grads.jsonl"
    with GradMonitor(model, log, None, locate_nonfinite=True) as monitor:
        for step in range(3):
            model.zero_grad()
            model(x).sum().backward()
            monitor.step(step)
        handle = model.layers[1].register_full_backward_pre_hook(
            lambda module, grad_output: (grad_output[0] * math.nan,))
        model.zero_grad()
        order.order.clear()
        model(x).sum().backward()
        record = monitor.step(3)
        handle.remove()
    assert record["nonfinite_origin"]["backward"] == order.first_nonfinite(model)
    result = gradclip("autopsy", log)
    verdict = " ".join(result.out.split())  # the verdict wraps at the path's length
    assert (f"step 3: non-finite; located by the monitor: forward clean, first non-finite "
            f"gradient {order.first_nonfinite(model)}; began in") in verdict
    as_json = gradclip("autopsy", log, "--format", "json").json()
    assert f"first non-finite gradient {order.first_nonfinite(model)}" in as_json["verdict"]


DTENSOR_OUTPUT = """
import json, sys, math, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from gradclip_cli import GradMonitor
folder = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu", (1,))

class ToDTensor(torch.nn.Module):  # an output left as a DTensor (use_local_output=False)
    poison = False
    def forward(self, x):
        x = x * math.nan if self.poison else x
        return DTensor.from_local(x, mesh, [Replicate()])

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), ToDTensor())
origins = []
with GradMonitor(model, f"{folder}/grads.jsonl", None, locate_nonfinite=True) as monitor:
    for step in range(2):
        model[1].poison = step == 1
        model.zero_grad()
        model(torch.rand(3, 4)).full_tensor().sum().backward()
        origins.append(monitor.step(step)["nonfinite_origin"])
print(json.dumps(origins), flush=True)
from tests import gloo
gloo.leave()
"""


def test_a_module_whose_output_is_a_dtensor_is_watched(tmp_path):
    # A bool flag ANDed in place with a DTensor raised an AssertionError in DTensor's
    # dispatch: the forward of a tensor-parallel model keeping DTensor outputs stopped.
    proc = subprocess.run([sys.executable, "-c", DTENSOR_OUTPUT, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    origins = json.loads(proc.stdout.splitlines()[-1])
    assert origins[0] is None and origins[1]["forward"] == "1"
