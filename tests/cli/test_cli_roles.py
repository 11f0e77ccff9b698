"""Roles from evidence, end to end, on checkpoints torch.optim and torch.save write.

A small CNN with BatchNorm (buffers: running statistics and an int64 counter)
is trained a few steps in float64 by each optimizer; its ``torch.save`` of
``{"model": state_dict, "optimizer": state_dict}`` is inspected. Every number
is checked against float64 computed here from what torch did (the gradients
it was given, the change it made to the parameters), never from gradclip.
"""

from __future__ import annotations

import pytest
import torch

from .support import ref_norm, rel_err, walk_refusals

STEPS = 3
TOL = 1e-6
LR = 0.01


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3)).double()


OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=LR),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.1),
    "AdamW-amsgrad": lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.1, amsgrad=True),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=LR),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=LR, betas=(0.9, 0.9)),  # rectified by step 3?
    "Adamax": lambda p: torch.optim.Adamax(p, lr=LR),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=LR),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=LR),
    "RMSprop-momentum-centered": lambda p: torch.optim.RMSprop(p, lr=LR, momentum=0.9,
                                                               centered=True),
    "SGD": lambda p: torch.optim.SGD(p, lr=LR),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=LR),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=LR),
    "Adadelta": lambda p: torch.optim.Adadelta(p, rho=0.95),
}
# What each gives (docs/reference/optimizers.md), beside weights.
GIVES = {
    "Adam": {"exp_avg", "grad_rms", "update"}, "AdamW": {"exp_avg", "grad_rms", "update"},
    "AdamW-amsgrad": {"exp_avg", "grad_rms", "update"}, "NAdam": {"exp_avg", "grad_rms"},
    "RAdam": {"exp_avg", "grad_rms", "update"}, "Adamax": {"exp_avg", "update"},
    "Adagrad": {"grad_rms"}, "RMSprop": {"grad_rms"},
    "RMSprop-momentum-centered": {"exp_avg", "grad_rms", "update"}, "SGD": set(),
    "SGD-momentum": {"update"}, "SGD-nesterov": set(), "Adafactor": {"grad_rms"},
    "Rprop": {"update"}, "Adadelta": {"grad_rms"},
}


class Run:
    """One training run: the checkpoint, and float64 references from what torch did."""

    def __init__(self, name: str, folder):
        model = _cnn()
        opt = OPTIMIZERS[name](model.parameters())
        named = list(model.named_parameters())
        self.grads: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
        for step in range(STEPS):
            opt.zero_grad()
            x = torch.randn(4, 2, 6, 6, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            for n, p in named:
                self.grads[n].append(p.grad.detach().clone())
            before = {n: p.detach().clone() for n, p in named}
            opt.step()
        decay = {"AdamW": 0.1, "AdamW-amsgrad": 0.1}.get(name, 0.0)
        self.update = {n: before[n] * (1 - LR * decay) - p.detach() for n, p in named}
        self.state = model.state_dict()
        self.params = dict(named)
        self.path = folder / f"{name}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, self.path)
        self.opt = opt.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("optimizers")
    return {name: Run(name, folder) for name in OPTIMIZERS}


def _ema(values, beta):
    t = len(values)
    return sum((1 - beta) * beta ** (t - 1 - k) * v for k, v in enumerate(values)) / (1 - beta**t)


def _reference(run: Run, name: str, what: str) -> dict[str, torch.Tensor]:
    g = run.grads
    if what == "update":
        return run.update
    if name == "Adagrad":
        return {n: torch.stack([x * x for x in v]).mean(0).sqrt() for n, v in g.items()}
    if name == "Adafactor":  # its factored estimate, from the state torch saved (float64)
        out = {}
        for pid, n in enumerate(g):
            s = run.opt["state"][pid]
            out[n] = ((s["row_var"] @ s["col_var"]) / s["row_var"].mean(-2, keepdim=True)).sqrt() \
                if "row_var" in s else s["variance"].sqrt()
        return out
    b1, b2 = (0.9, 0.9) if name == "RAdam" else (0.9, 0.999)
    if name.startswith("RMSprop"):
        b1 = b2 = 0.99
    if name == "Adadelta":
        b2 = 0.95
    if what == "exp_avg":
        return {n: _ema(v, b1) for n, v in g.items()}
    if name == "AdamW-amsgrad":  # v_hat is the running maximum of the (biased) v
        out = {}
        for n, v in g.items():
            ema = top = torch.zeros_like(v[0])
            for x in v:
                ema = b2 * ema + (1 - b2) * x * x
                top = torch.maximum(top, ema)
            out[n] = (top / (1 - b2 ** len(v))).sqrt()
        return out
    return {n: _ema([x * x for x in v], b2).sqrt() for n, v in g.items()}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("what", ["exp_avg", "grad_rms", "update"])
def test_each_optimizer_gives_its_own_quantities(gradclip, runs, name, what):
    run = runs[name]
    result = gradclip("inspect", run.path, "--what", what, "--format", "json")
    if what not in GIVES[name]:
        assert result.code == 3, result.out
        assert what in result.err and "available:" in result.err
        return
    assert result.code == 0, result.err
    doc = result.json()
    reference = _reference(run, name, what)
    # BatchNorm's buffers are no parameters: the state maps onto the parameters alone.
    assert [t["name"] for t in doc["tensors"]] == list(run.params)
    assert rel_err(doc["total_norm"], ref_norm(reference.values(), 2)) <= TOL
    for row in doc["tensors"]:
        assert rel_err(row["norm"], ref_norm([reference[row["name"]]], 2)) <= TOL, row["name"]
        weight = ref_norm([run.params[row["name"]].detach()], 2)
        assert rel_err(row["ratio"], ref_norm([reference[row["name"]]], 2) / weight) <= TOL


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_auto_measures_moments_else_weights(gradclip, runs, name):
    doc = gradclip("inspect", runs[name].path, "--format", "json").json()
    assert doc["what"] == ("exp_avg" if "exp_avg" in GIVES[name] else "weights")


def test_weights_are_the_parameters_buffers_apart(gradclip, runs):
    run = runs["Adam"]
    doc = gradclip("inspect", run.path, "--what", "weights", "--format", "json").json()
    assert [t["name"] for t in doc["tensors"]] == list(run.params)
    assert rel_err(doc["total_norm"], ref_norm([p.detach() for p in run.params.values()],
                                                2)) <= TOL
    assert "3 buffers apart" in doc["measured"]["explain"]
    assert "buffers, not weights: 1.running_mean, 1.running_var, 1.num_batches_tracked" \
        in doc["description"]
    assert doc["roles"] == {"weight": 6, "buffer": 3, "optimizer state": 12}


def test_a_model_state_dict_alone_is_weights_and_says_why(gradclip, runs, tmp_path):
    run = runs["Adam"]
    path = tmp_path / "weights.pt"
    torch.save(run.state, path)
    result = gradclip("inspect", path)
    assert result.code == 0, result.err
    assert "measured: model weights, 3 buffers apart (a state_dict: torch's _metadata)" \
        in result.out
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "weights"
    assert doc["measured"]["evidence"] == "a state_dict: torch's _metadata"
    assert rel_err(doc["total_norm"], ref_norm([p.detach() for p in run.params.values()],
                                                2)) <= TOL
    refused = gradclip("inspect", path, "--what", "grads")
    assert refused.code == 3
    assert refused.err_lines == [
        f"gradclip: {path}: --what grads: the file is a model's weights (a state_dict: torch's "
        "_metadata), not gradients; available: --what weights"]
    clip = gradclip("clip", path, "--max-norm", "0.1")
    assert clip.code == 3 and not list(tmp_path.glob("*.clipped*"))
    assert "clip changes saved gradients only" in clip.err and "--what" not in clip.err


@pytest.mark.parametrize("evidence", ["buffers", "name", "config"])
def test_other_evidence_of_weights(gradclip, tmp_path, evidence):
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.randn(3, 2), "a.bias": torch.randn(3)}
    name = "t.safetensors"
    if evidence == "buffers":
        tensors["bn.running_mean"] = torch.zeros(3)
    elif evidence == "name":
        name = "model.safetensors"
    else:
        (tmp_path / "config.json").write_text("{}")
    save_file(tensors, tmp_path / name)
    doc = gradclip("inspect", tmp_path / name, "--format", "json").json()
    assert doc["what"] == "weights", doc["measured"]
    expected = ref_norm([tensors["a.weight"], tensors["a.bias"]], 2)
    assert rel_err(doc["total_norm"], expected) <= TOL  # buffers are never weights
    assert gradclip("inspect", tmp_path / name, "--what", "grads").code == 3


def test_a_plain_flat_mapping_is_gradients(gradclip, tmp_path):
    path = tmp_path / "g.pt"
    grads = {"w": torch.full((3,), 2.0)}
    torch.save(grads, path)
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "grads"
    assert doc["measured"]["evidence"] == \
        "a flat name -> tensor mapping that nothing marks as weights"


def test_gradients_that_hold_buffers_contradict_themselves(gradclip, tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(3), "bn.running_var": torch.ones(3)}}, path)
    result = gradclip("inspect", path)
    assert result.code == 3
    assert result.err_lines == [
        f"gradclip: {path}: the key 'grads' says gradients, but it holds a model's buffers "
        "(bn.running_var): gradients have no running statistics"]


def test_key_naming_optimizer_state_measures_it_as_such(gradclip, runs):
    run = runs["AdamW"]
    for key in ("optimizer",):
        doc = gradclip("inspect", run.path, "--key", key, "--format", "json").json()
        assert doc["what"] == "exp_avg"
        reference = _reference(run, "AdamW", "exp_avg")
        assert rel_err(doc["total_norm"], ref_norm(reference.values(), 2)) <= TOL
        refused = gradclip("inspect", run.path, "--key", key, "--what", "grads")
        assert refused.code == 3 and "holds an optimizer's state dict" in refused.err


# What each command offers after a --key that is not gradients: inspect measures the
# entry whole; clip changes saved gradients only, and these files hold none.
_REMEDY = {
    "inspect": ": not gradients; gradclip measures it whole (gradclip inspect --key {entry})",
    "clip": ": not gradients; clip changes saved gradients only; available: none (no saved "
            "gradients found)",
}


@pytest.mark.parametrize(("key", "entry", "whole"), [
    ("optimizer.state.0", "optimizer", "an optimizer's state dict"),
    ("optimizer_states.0.state", "optimizer_states.0", "an optimizer's state dict"),
    ("nested.model.extra", "nested.model", "a model's weights (a state_dict"),
])
def test_a_key_inside_weights_or_optimizer_state_is_refused(gradclip, runs, tmp_path, key,
                                                           entry, whole):
    """Part of an optimizer's state (one parameter's moments and step) or of a model's
    weights is not gradients: exit 3, nothing written, and what it names works whole."""
    run = runs["AdamW"]
    path = tmp_path / "ck.pt"
    weights = torch.nn.BatchNorm1d(3).state_dict()
    weights["extra"] = {"w": torch.ones(2)}  # a module's extra state may be a mapping
    torch.save({"optimizer": run.opt, "optimizer_states": [run.opt],
                "nested": {"model": weights}}, path)
    before = path.read_bytes()
    for command in (["inspect"], ["clip", "--max-norm", "1e-9"]):
        result = gradclip(*command, path, "--key", key)
        assert result.code == 3 and result.out == ""
        assert len(result.err_lines) == 1
        assert result.err_lines[0].startswith(
            f"gradclip: {path}: --key {key!r} lies inside {entry!r}, {whole}")
        assert result.err_lines[0].endswith(_REMEDY[command[0]].format(entry=entry))
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
    whole_entry = gradclip("inspect", path, "--key", entry, "--format", "json")
    assert whole_entry.code == 0, whole_entry.err
    assert whole_entry.json()["what"] == ("weights" if "weights" in whole else "exp_avg")


@pytest.mark.parametrize(("key", "entry", "whole"), [
    ("per_parameter", "per_parameter.w", "an optimizer's state dict"),
    ("optimizer_states", "optimizer_states.0", "an optimizer's state dict"),
    ("nested", "nested.model", "a model's weights (a state_dict"),
])
def test_a_key_holding_weights_or_optimizer_state_is_refused(gradclip, runs, tmp_path, key,
                                                            entry, whole):
    """An entry that holds an optimizer's state dict (torchtune's optimizer_in_bwd keeps one
    per parameter) or a model's weights is not gradients: exit 3, nothing written, and
    the entry it names works whole. It was measured, and clipped, as gradients."""
    run = runs["AdamW"]
    path = tmp_path / "ck.pt"
    torch.save({"per_parameter": {"w": run.opt}, "optimizer_states": [run.opt],
                "nested": {"model": torch.nn.BatchNorm1d(3).state_dict()}}, path)
    before = path.read_bytes()
    for command in (["inspect"], ["clip", "--max-norm", "1e-9"]):
        result = gradclip(*command, path, "--key", key)
        assert result.code == 3 and result.out == ""
        assert len(result.err_lines) == 1
        assert result.err_lines[0].startswith(
            f"gradclip: {path}: --key {key!r} holds {entry!r}, {whole}")
        assert result.err_lines[0].endswith(_REMEDY[command[0]].format(entry=entry))
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
    whole_entry = gradclip("inspect", path, "--key", entry, "--format", "json")
    assert whole_entry.code == 0, whole_entry.err
    assert whole_entry.json()["what"] == ("weights" if "weights" in whole else "exp_avg")


@pytest.mark.parametrize(("key", "whole"), [
    ("optimizer.state.0", "optimizer"), ("optimizer", None), ("model", None)])
def test_clip_offers_the_saved_gradients_key_alone(gradclip, runs, tmp_path, key, whole):
    """clip of a --key in (or naming) optimizer state or the weights offered
    'gradclip inspect --key optimizer', optimizer state, which clip never changes. It
    offers the --key of the gradients saved beside, and following it clips them: the
    output's total is --max-norm (float64 reference), nothing else changed."""
    run = runs["AdamW"]
    path = tmp_path / "ck.pt"
    grads = {n: torch.randn(*t.shape, generator=torch.Generator().manual_seed(i))
             for i, (n, t) in enumerate(run.params.items())}
    torch.save({"model": run.state, "optimizer": run.opt, "grads": grads}, path)
    before = path.read_bytes()
    result = gradclip("clip", path, "--key", key, "--max-norm", "0.5")
    assert result.code == 3 and result.out == ""
    assert len(result.err_lines) == 1, result.err
    line = result.err_lines[0]
    assert "inspect" not in line and "--what" not in line, line
    assert line.endswith("; clip changes saved gradients only; available: --key grads"), line
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]
    inspect = gradclip("inspect", path, "--key", key)  # inspect's own offer is unchanged
    if whole is None:
        assert inspect.code == 0, inspect.err
    else:
        assert inspect.code == 3
        assert inspect.err_lines[0].endswith(_REMEDY["inspect"].format(entry=whole))
    out = tmp_path / "out.pt"
    done = gradclip("clip", path, "--key", "grads", "--max-norm", "0.5", "-o", out,
                    "--format", "json")
    assert done.code == 0, done.err
    assert rel_err(done.json()["total_norm_before"], ref_norm(grads.values(), 2)) <= TOL
    clipped = torch.load(out, weights_only=True)
    assert rel_err(ref_norm(clipped["grads"].values(), 2), 0.5) <= 1e-5
    assert torch.equal(clipped["optimizer"]["state"][0]["exp_avg"],
                       run.opt["state"][0]["exp_avg"])


def test_key_naming_weights_is_never_clipped(gradclip, runs, tmp_path):
    run = runs["SGD"]
    path = tmp_path / "ck.pt"
    torch.save({"model_state_dict": run.state, "optimizer_state_dict": run.opt}, path)
    doc = gradclip("inspect", path, "--key", "model_state_dict", "--format", "json").json()
    assert doc["what"] == "weights"
    clip = gradclip("clip", path, "--key", "model_state_dict", "--max-norm", "0.1")
    assert clip.code == 3
    assert "--key model_state_dict holds a model's weights" in clip.err
    assert not list(tmp_path.glob("*.clipped*"))


def test_an_optimizer_state_dict_alone(gradclip, runs, tmp_path):
    # accelerate's optimizer.bin: torch.save(optimizer.state_dict()).
    run = runs["Adam"]
    path = tmp_path / "optimizer.bin"
    torch.save(run.opt, path)
    doc = gradclip("inspect", path, "--what", "update", "--format", "json").json()
    assert rel_err(doc["total_norm"], ref_norm(run.update.values(), 2)) <= TOL
    assert len(doc["tensors"]) == len(run.params)


@pytest.mark.parametrize("what", ["grad_rms", "update"])
def test_a_negative_second_moment_is_nonfinite(gradclip, runs, tmp_path, what):
    run = runs["Adam"]
    opt = {"state": {k: dict(v) for k, v in run.opt["state"].items()},
           "param_groups": run.opt["param_groups"]}
    opt["state"][0]["exp_avg_sq"] = -opt["state"][0]["exp_avg_sq"]
    path = tmp_path / "corrupt.pt"
    torch.save({"model": run.state, "optimizer": opt}, path)
    result = gradclip("inspect", path, "--what", what, "--format", "json")
    assert result.code == 1
    doc = result.json()
    assert doc["status"] == "nonfinite"
    assert doc["nonfinite"]["nan"] == opt["state"][0]["exp_avg_sq"].numel()


@pytest.mark.parametrize("key", ["step", "global_step", "step_count", "iter_num", "iteration"])
def test_one_step_rule_for_inspect_and_trend(gradclip, tmp_path, key):
    for n, step in enumerate((7, 9)):
        torch.save({"grads": {"w": torch.ones(2) * (n + 1)}, key: torch.tensor(step)},
                   tmp_path / f"g{n}.pt")
    assert gradclip("inspect", tmp_path / "g0.pt", "--format", "json").json()["step"] == 7
    doc = gradclip("trend", tmp_path / "g0.pt", tmp_path / "g1.pt", "--format", "json").json()
    assert [p["step"] for p in doc["points"]] == [7, 9]


# ------------------------------------------------------------- every hint works


def test_every_refusal_offers_only_what_works(gradclip, runs, tmp_path):
    """Every refusal of inspect and clip over these checkpoints: each flag it offers
    succeeds and measures what it says; clip never offers weights or optimizer state."""
    weights = tmp_path / "weights.pt"
    torch.save(runs["Adam"].state, weights)
    nested = tmp_path / "nested.pt"
    torch.save({"state": {"g": {"w": torch.ones(3)}}, "model": runs["Adam"].state}, nested)
    opt_only = tmp_path / "optimizer.bin"
    torch.save(runs["RAdam"].opt, opt_only)
    paths = [r.path for r in runs.values()] + [weights, nested, opt_only]
    refusals, followed = walk_refusals(gradclip, paths, tmp_path)
    assert refusals > 30 and followed > 30  # the walk met many refusals and hints


def test_param_names_that_do_not_match_the_weights(gradclip, tmp_path):
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.named_parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    adam.step()
    state = adam.state_dict()
    state["param_groups"][0]["param_names"] = ["weight", "proj.bias"]
    path = tmp_path / "ck.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    result = gradclip("inspect", path, "--what", "exp_avg")
    assert result.code == 3
    assert result.err_lines == [
        f"gradclip: {path}: the optimizer's param_names name proj.bias, which the "
        "checkpoint's weights do not hold: the two disagree; available: --what weights"]
    assert gradclip("inspect", path, "--what", "weights").code == 0


@pytest.mark.parametrize("flags", [(), ("--key", "grads")])
def test_a_grads_key_holding_a_state_dict_contradicts_itself(gradclip, tmp_path, flags):
    path = tmp_path / "g.pt"
    torch.save({"grads": torch.nn.Linear(2, 2).state_dict()}, path)
    result = gradclip("inspect", path, *flags)
    assert result.code == 3
    said = "--key grads" if flags else "the key 'grads'"
    assert result.err_lines == [
        f"gradclip: {path}: {said} says gradients, but it is a model's state_dict (torch's "
        "_metadata): a module's weights, not gradients"]


def test_weights_and_optimizer_state_under_any_name_are_found_by_evidence(gradclip, runs, tmp_path):
    run = runs["Adam"]
    path = tmp_path / "ck.pt"
    torch.save({"net": run.state, "opt": run.opt}, path)
    doc = gradclip("inspect", path, "--what", "update", "--format", "json").json()
    assert doc["measured"]["evidence"] == "the 'opt' entry"
    assert rel_err(doc["total_norm"], ref_norm(run.update.values(), 2)) <= TOL
    refused = gradclip("inspect", path, "--what", "grads")
    assert refused.code == 3
    assert refused.err_lines[0].endswith(
        "it holds Adam state (exp_avg, exp_avg_sq); available: --what exp_avg, "
        "--what grad_rms, --what update, --what weights")
    weights = gradclip("inspect", path, "--what", "weights", "--format", "json").json()
    assert weights["measured"]["evidence"] == "the 'net' entry: a state_dict: torch's _metadata"
