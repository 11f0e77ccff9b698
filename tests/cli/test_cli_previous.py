"""``gradclip inspect CURR --previous PREV``, end to end, on checkpoints real runs wrote.

The gradients each optimizer step used are saved by the runs themselves
(``save_grads`` just before ``optimizer.step()``); every number compared with
comes from them in float64 (``ref_norm``), never from gradclip.
"""

from __future__ import annotations

import json

import pytest
import torch

from gradclip_cli.source.previous import CHECK_BOUND
from tests.json_schemas import assert_valid
from tests.previous_runs import (
    TRAINER_MAX_GRAD_NORM,
    TRAINER_STEPS,
    Net,
    train,
    train_lightning_pair,
    train_trainer_pair,
)

from .support import ref_norm, rel_err

optim = torch.optim


def _adam_l2(m):
    return optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def adam_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("adam_l2"), _adam_l2, steps=4)


def _assert_matches(doc, grads, tol):
    assert doc["what"] == "grads"
    assert rel_err(doc["total_norm"], ref_norm(grads.values(), 2)) <= tol
    rows = {row["name"]: row for row in doc["tensors"]}
    assert set(rows) == set(grads)
    for name, g in grads.items():
        assert rel_err(rows[name]["norm"], ref_norm([g], 2)) <= tol, name


def test_reconstructed_gradients_match_the_saved_ones(gradclip, adam_run):
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", adam_run.checkpoint(3),
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert_valid(doc)
    _assert_matches(doc, adam_run.grads(4), 1e-5)
    measured = doc["measured"]
    assert measured["evidence"] == (
        f"reconstructed from the Adam states of steps 3 and 4 in {adam_run.checkpoint(3)} "
        f"and {adam_run.checkpoint(4)}")
    check = measured["cross_check"]
    assert 0 <= check["max_units"] <= check["bound_units"] == CHECK_BOUND
    assert check["unit"] == 2.0**-24 and check["check"] == "exp_avg_sq"
    # ratio: the gradient over the weights it was taken at (PREV's).
    weights = torch.load(adam_run.checkpoint(3), weights_only=True)["model"]
    group = next(g for g in doc["groups"] if g["name"] == "a.weight")
    assert rel_err(group["ratio"], ref_norm([adam_run.grads(4)["a.weight"]], 2)
                   / ref_norm([weights["a.weight"]], 2)) <= 1e-5


def test_table_says_what_was_reconstructed_and_the_check(gradclip, adam_run):
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", adam_run.checkpoint(3))
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    assert "gradients of optimizer step 4 as the optimizer saw them" in text
    assert "reconstructed from the Adam states of steps 3 and 4" in text
    assert "from exp_avg (float32 state, computed in float64)" in text
    assert "minus weight_decay * the weights of" in text  # Adam's L2 decay
    assert "cross-check: exp_avg_sq agrees" in text and f"bound is {CHECK_BOUND:g} units" in text


def test_a_finding_on_reconstructed_gradients_names_them(gradclip, adam_run):
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", adam_run.checkpoint(3),
                      "--max-norm", "1e-6", "--format", "json")
    assert result.code == 1
    assert result.json()["status"] == "exceeded"


def test_first_step_pairs_with_the_model_before_any_step(gradclip, adam_run):
    # Saved before the first step, the optimizer holds its groups and no state: the
    # moments were zeros.
    result = gradclip("inspect", adam_run.checkpoint(1), "--previous", adam_run.checkpoint(0),
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    _assert_matches(result.json(), adam_run.grads(1), 1e-5)


def test_first_step_with_groups_that_split_the_model_order(gradclip, tmp_path):
    """Weights with L2 decay in one group, biases without in another (the common split):
    before the first step the groups hold no state to place them by shape, and the
    parameters are the ones CURR's groups hold."""
    def make(m):
        return optim.Adam([{"params": [m.a.weight, m.b.weight], "weight_decay": 0.3},
                           {"params": [m.a.bias, m.b.bias], "weight_decay": 0.0}], lr=1e-2)

    run = train(tmp_path, make, steps=2)
    for step in (1, 2):
        result = gradclip("inspect", run.checkpoint(step), "--previous",
                          run.checkpoint(step - 1), "--group-by", "tensor", "--format", "json")
        assert result.code == 0, result.err
        _assert_matches(result.json(), run.grads(step), 1e-5)


# ----------------------------------------------------------------- refusals


def _refused(result, code, *needles):
    assert result.code == code, (result.code, result.out, result.err)
    assert result.out == ""
    assert len(result.err_lines) == 1, result.err
    assert "Traceback" not in result.err
    for needle in needles:
        assert str(needle) in result.err, (needle, result.err)


def test_previous_measures_grads_only(gradclip, adam_run):
    for what in ("exp_avg", "update", "weights"):
        result = gradclip("inspect", adam_run.checkpoint(4), "--previous",
                          adam_run.checkpoint(3), "--what", what)
        _refused(result, 2, "--previous", f"--what {what}")


def test_steps_not_consecutive(gradclip, adam_run):
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", adam_run.checkpoint(2))
    _refused(result, 3, adam_run.checkpoint(4), adam_run.checkpoint(2),
             "2 optimizer steps apart", "weighted sum of those 2 gradients",
             "no single step's gradient")


def test_steps_in_the_wrong_order(gradclip, adam_run):
    result = gradclip("inspect", adam_run.checkpoint(3), "--previous", adam_run.checkpoint(4))
    _refused(result, 3, "give the earlier checkpoint as --previous")


def test_the_same_step_twice(gradclip, adam_run):
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", adam_run.checkpoint(4))
    _refused(result, 3, "no optimizer step between them")


def test_other_betas(gradclip, tmp_path):
    def change(step, opt):
        if step == 3:
            opt.param_groups[0]["betas"] = (0.8, 0.999)

    run = train(tmp_path, _adam_l2, steps=3, before_step=change)
    result = gradclip("inspect", run.checkpoint(3), "--previous", run.checkpoint(2))
    _refused(result, 3, "betas differs", "(0.9, 0.999)", "(0.8, 0.999)", run.checkpoint(2))


def test_a_learning_rate_schedule_does_not_matter(gradclip, tmp_path):
    def change(step, opt):
        opt.param_groups[0]["lr"] = 1e-2 / step

    run = train(tmp_path, _adam_l2, steps=3, before_step=change)
    result = gradclip("inspect", run.checkpoint(3), "--previous", run.checkpoint(2),
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    _assert_matches(result.json(), run.grads(3), 1e-5)


def test_other_parameter_shapes(gradclip, tmp_path):
    wide = train(tmp_path / "wide", _adam_l2, steps=3)
    narrow_model = Net(0, hidden=8)
    opt = _adam_l2(narrow_model)
    narrow_model(torch.randn(4, 12)).sum().backward()
    opt.step()
    opt.step()
    path = tmp_path / "narrow.pt"
    torch.save({"model": narrow_model.state_dict(), "optimizer": opt.state_dict()}, path)
    result = gradclip("inspect", wide.checkpoint(3), "--previous", path)
    _refused(result, 3, "has shape", "[8, 12]", "[16, 12]", path)


@pytest.mark.parametrize("split", [False, True], ids=["one-group", "decay-groups"])
def test_other_parameter_shapes_before_the_first_step(gradclip, tmp_path, split):
    """PREV saved before any step holds no state to compare shapes by: its weights do."""
    def make(m):
        if split:
            return optim.AdamW([{"params": [m.a.weight, m.b.weight], "weight_decay": 0.1},
                                {"params": [m.a.bias, m.b.bias], "weight_decay": 0.0}])
        return optim.AdamW(m.parameters())

    wide = train(tmp_path / "wide", make, steps=1)
    narrow = Net(0, hidden=8)
    path = tmp_path / "narrow-0.pt"
    torch.save({"model": narrow.state_dict(), "optimizer": make(narrow).state_dict()}, path)
    result = gradclip("inspect", wide.checkpoint(1), "--previous", path)
    _refused(result, 3, "has shape", "[8, 12]", "[16, 12]", path)


def test_other_parameter_names(gradclip, tmp_path, adam_run):
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    opt = _adam_l2(model)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 12)).sum().backward()
        opt.step()
    path = tmp_path / "sequential.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", path)
    _refused(result, 3, "the parameters differ", "a.weight", path)


@pytest.mark.parametrize("make, kind, why", [
    (lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "SGD", "keeps no step counter"),
    (lambda m: optim.Adagrad(m.parameters(), lr=0.1), "Adagrad", "sign of the gradient is lost"),
    (lambda m: optim.RMSprop(m.parameters(), lr=0.1), "RMSprop", "uncentered"),
    (lambda m: optim.Adafactor(m.parameters(), lr=0.1), "Adafactor", "factored second moment"),
    (lambda m: optim.SparseAdam(m.parameters(), lr=0.1), "SparseAdam", "sparse gradient"),
], ids=["SGD", "Adagrad", "RMSprop", "Adafactor", "SparseAdam"])
def test_optimizers_whose_pair_gives_no_gradient(gradclip, tmp_path, make, kind, why):
    if kind == "SparseAdam":
        # SparseAdam takes sparse gradients alone: an embedding with sparse=True.
        model = torch.nn.Embedding(10, 4, sparse=True)
        opt = make(model)
        paths = []
        for step in (1, 2):
            opt.zero_grad()
            model(torch.tensor([step, 3])).sum().backward()
            opt.step()
            paths.append(tmp_path / f"step-{step}.pt")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, paths[-1])
        curr, prev = paths[1], paths[0]
    else:
        run = train(tmp_path, make, steps=2)
        curr, prev = run.checkpoint(2), run.checkpoint(1)
    result = gradclip("inspect", curr, "--previous", prev)
    _refused(result, 3, f"--previous: {kind}:", why, curr, prev)


def test_two_kinds_of_optimizer(gradclip, tmp_path, adam_run):
    other = train(tmp_path, lambda m: optim.NAdam(m.parameters(), lr=1e-2), steps=3)
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", other.checkpoint(3))
    _refused(result, 3, "the optimizers differ", "Adam in", "NAdam in")


def test_states_of_another_run_fail_the_cross_check(gradclip, tmp_path, adam_run):
    other = train(tmp_path, _adam_l2, steps=3, seed=1)
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", other.checkpoint(3))
    _refused(result, 3, "exp_avg_sq disagrees", f"(bound {CHECK_BOUND:g})",
             "not one Adam step apart", adam_run.checkpoint(4), other.checkpoint(3))


def test_l2_decay_needs_the_previous_weights(gradclip, tmp_path):
    # Named parameters: the optimizer stores param_names, so a checkpoint of the
    # optimizer alone is mapped, but Adam's L2 decay needs PREV's weights.
    def make(m):
        return optim.Adam(m.named_parameters(), lr=1e-2, weight_decay=0.1)

    run = train(tmp_path, make, steps=3)
    bare = tmp_path / "optimizer-only.pt"
    torch.save({"optimizer": torch.load(run.checkpoint(2), weights_only=True)["optimizer"]},
               bare)
    result = gradclip("inspect", run.checkpoint(3), "--previous", bare)
    _refused(result, 3, "weight decay 0.1", "holds no weights", bare)
    # AdamW's decay is decoupled: the same pair without weights is determined.
    run = train(tmp_path / "w", lambda m: optim.AdamW(m.named_parameters(), lr=1e-2,
                                                  weight_decay=0.1), steps=3)
    torch.save({"optimizer": torch.load(run.checkpoint(2), weights_only=True)["optimizer"]},
               bare)
    result = gradclip("inspect", run.checkpoint(3), "--previous", bare, "--group-by", "tensor",
                      "--format", "json")
    assert result.code == 0, result.err
    _assert_matches(result.json(), run.grads(3), 1e-5)


def test_json_failure_document(gradclip, adam_run):
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", adam_run.checkpoint(2),
                      "--format", "json")
    assert result.code == 3
    doc = json.loads(result.out)
    assert doc["schema"] == "gradclip.error/1" and doc["exit_code"] == 3
    assert "optimizer steps apart" in doc["error"]


def test_a_missing_previous_file(gradclip, adam_run, tmp_path):
    missing = tmp_path / "nowhere.pt"
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", missing)
    _refused(result, 3, missing)


# ----------------------------------------------------------------- frameworks


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    pytest.importorskip("transformers")
    return train_trainer_pair(tmp_path_factory.mktemp("hf_previous"))


def test_trainer_checkpoints_give_the_clipped_gradients(gradclip, trainer_run):
    # The Trainer clips before optimizer.step(): the reconstruction is the clipped
    # gradient (total norm max_grad_norm where the logged norm was above it).
    t = TRAINER_STEPS
    result = gradclip("inspect", trainer_run / f"checkpoint-{t}", "--previous",
                      trainer_run / f"checkpoint-{t - 1}", "--group-by", "tensor",
                      "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    grads = torch.load(trainer_run / f"grads-{t}.pt", weights_only=True)["grads"]
    _assert_matches(doc, grads, 1e-5)
    # The model's order (save_grads follows named_parameters), not the optimizer's two
    # groups (decayed, then not).
    assert [row["name"] for row in doc["tensors"]] == list(grads)
    assert "AdamW states of steps 2 and 3" in doc["measured"]["evidence"]
    logged = json.loads((trainer_run / "trainer_state.json").read_text())["log_history"]
    before = next(e["grad_norm"] for e in logged if e.get("step") == t and "grad_norm" in e)
    assert before > TRAINER_MAX_GRAD_NORM  # it was clipped
    assert rel_err(doc["total_norm"], TRAINER_MAX_GRAD_NORM) <= 1e-5


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    pytest.importorskip("lightning")
    return train_lightning_pair(tmp_path_factory.mktemp("pl_previous"))


def test_lightning_checkpoints(gradclip, lightning_run):
    result = gradclip("inspect", lightning_run / "step=3.ckpt", "--previous",
                      lightning_run / "step=2.ckpt", "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    grads = torch.load(lightning_run / "grads-3.pt", weights_only=True)["grads"]
    _assert_matches(result.json(), grads, 1e-5)


def test_a_parameter_without_a_gradient_that_step_is_left_out_and_named(gradclip, tmp_path):
    # torch.optim skips a parameter whose .grad is None: its step counter and moments
    # stay where they were, so that step gave it no gradient to reconstruct.
    def drop(step, opt):
        if step == 3:
            opt.param_groups[0]["params"][2].grad = None  # b.weight

    run = train(tmp_path, _adam_l2, steps=3, before_step=drop)
    result = gradclip("inspect", run.checkpoint(3), "--previous", run.checkpoint(2),
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    grads = {n: g for n, g in run.grads(3).items() if n != "b.weight"}
    _assert_matches(doc, grads, 1e-5)
    assert "no gradient at step 3 (state unchanged): b.weight" in doc["description"]


def test_markdown_and_junit_carry_the_evidence_and_the_check(gradclip, adam_run):
    for fmt in ("markdown", "junit"):
        result = gradclip("inspect", adam_run.checkpoint(4), "--previous",
                          adam_run.checkpoint(3), "--format", fmt)
        assert result.code == 0, result.err
        text = result.out.replace("\\", "")  # markdown escapes _ and :
        assert "reconstructed from the Adam states of steps 3 and 4" in text, fmt
        assert "cross-check: exp_avg_sq agrees" in text, fmt


def test_output_file_is_never_the_previous_checkpoint(gradclip, adam_run):
    before = adam_run.checkpoint(3).read_bytes()
    result = gradclip("inspect", adam_run.checkpoint(4), "--previous", adam_run.checkpoint(3),
                      "--output-file", adam_run.checkpoint(3))
    assert result.code == 2
    assert adam_run.checkpoint(3).read_bytes() == before


def test_a_non_finite_gradient_is_a_finding_not_a_refusal(gradclip, tmp_path):
    # Step 3's gradient holds a NaN (as after an overflow): torch averages it into both
    # moments, and the reconstruction reports it where it was.
    def poison(step, opt):
        if step == 3:
            opt.param_groups[0]["params"][0].grad[1, 2] = float("nan")  # a.weight

    run = train(tmp_path, _adam_l2, steps=3, before_step=poison)
    result = gradclip("inspect", run.checkpoint(3), "--previous", run.checkpoint(2),
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 1, result.err
    doc = result.json()
    assert doc["status"] == "nonfinite"
    assert doc["nonfinite"] == {"nan": 1, "posinf": 0, "neginf": 0}
    rows = {row["name"]: row for row in doc["tensors"]}
    assert rows["a.weight"]["nonfinite"]["nan"] == 1
    assert rows["b.weight"]["nonfinite"]["nan"] == 0


def test_two_ranks_print_the_one_process_report(adam_run, tmp_path):
    from tests.distributed.launch import same_under_torchrun

    jobs = [{"args": ["inspect", str(adam_run.checkpoint(4)), "--previous",
                      str(adam_run.checkpoint(3)), "--group-by", "tensor", "--format", fmt,
                      "--no-progress"]} for fmt in ("table", "json")]
    same_under_torchrun(jobs, tmp_path)


def test_a_parameter_whose_first_gradient_came_at_that_step(gradclip, tmp_path):
    # b.bias gets no gradient before step 3: torch makes its state at step 3 (its own
    # step 1), so PREV holds none for it and its moments before were zeros.
    def late(step, opt):
        if step < 3:
            opt.param_groups[0]["params"][3].grad = None  # b.bias

    run = train(tmp_path, _adam_l2, steps=3, before_step=late)
    assert 3 not in torch.load(run.checkpoint(2), weights_only=True)["optimizer"]["state"]
    result = gradclip("inspect", run.checkpoint(3), "--previous", run.checkpoint(2),
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    _assert_matches(result.json(), run.grads(3), 1e-5)


def test_a_first_gradient_at_that_step_with_groups_that_split_the_model_order(gradclip,
                                                                              tmp_path):
    """Weights with decay in one group, biases in another, and layer b without a gradient
    before step 3: PREV holds no state for b's weight and bias, so its state alone places
    them two ways; the same groups of the same ids are CURR's parameters (they were
    refused as parameters PREV's optimizer does not hold)."""
    def make(m):
        return optim.AdamW([{"params": [m.a.weight, m.b.weight], "weight_decay": 0.1},
                            {"params": [m.a.bias, m.b.bias], "weight_decay": 0.0}], lr=1e-2)

    def late(step, opt):
        if step < 3:
            for group in opt.param_groups:
                group["params"][1].grad = None  # b.weight, b.bias

    run = train(tmp_path, make, steps=3, before_step=late)
    assert set(torch.load(run.checkpoint(2), weights_only=True)["optimizer"]["state"]) == {0, 2}
    result = gradclip("inspect", run.checkpoint(3), "--previous", run.checkpoint(2),
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    _assert_matches(result.json(), run.grads(3), 1e-5)

def test_complex_parameters(gradclip, tmp_path):
    # torch's Adam views complex state as real pairs; the gradient is linear in the
    # moments, and its norm counts |z| as torch does.
    class Complex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))

        def forward(self, x):
            return (x @ self.w).abs().square().sum()

    from gradclip_cli import save_grads

    model = Complex()
    opt = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in (1, 2, 3):
        opt.zero_grad()
        model(torch.randn(5, 4, dtype=torch.complex64)).backward()
        save_grads(model, tmp_path / f"grads-{step}.pt")
        opt.step()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   tmp_path / f"step-{step}.pt")
    result = gradclip("inspect", tmp_path / "step-3.pt", "--previous", tmp_path / "step-2.pt",
                      "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    g = torch.load(tmp_path / "grads-3.pt", weights_only=True)["grads"]["w"]
    assert rel_err(doc["total_norm"], torch.linalg.vector_norm(g.to(torch.complex128)).item()) \
        <= 1e-5
    assert doc["tensors"][0]["dtype"] == "complex128"
    assert doc["measured"]["cross_check"]["max_units"] <= CHECK_BOUND


def _two_way_groups(tmp_path, make):
    """Three steps of ``make``'s optimizer over groups that fit the model's order two ways
    (every weight in one, every bias in the other; LayerNorm's weight has a bias's shape)."""
    from gradclip_cli import save_grads

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.LayerNorm(5),
                                torch.nn.Linear(5, 5))
    opt = make([{"params": [model[0].weight, model[1].weight, model[2].weight],
                 "weight_decay": 0.1},
                {"params": [model[0].bias, model[1].bias, model[2].bias],
                 "weight_decay": 0.0}])
    for step in (1, 2, 3):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        save_grads(model, tmp_path / f"grads-{step}.pt")
        opt.step()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   tmp_path / f"step-{step}.pt")


def test_l2_decay_under_parameter_ids_says_the_weights_are_unnamed(gradclip, tmp_path):
    """Adam's L2 decay needs each parameter's weights, which state named by id cannot pick
    out: exit 3 saying so (the weights are there), not that PREV holds none."""
    _two_way_groups(tmp_path, lambda groups: optim.Adam(groups, lr=1e-2))
    result = gradclip("inspect", tmp_path / "step-3.pt", "--previous", tmp_path / "step-2.pt")
    _refused(result, 3, "named by parameter id", "weight decay 0.1")
    assert "holds no weights" not in result.err


def test_groups_that_fit_the_model_order_two_ways_are_paired_by_id(gradclip, tmp_path):
    """AdamW with every weight decayed and every bias not, beside a model whose LayerNorm
    weight and biases have one shape: the groups fit its order two ways, so --what exp_avg
    measures the state under its ids (state.N); so does --previous, pairing the two states
    id by id (one run's groups), and the gradients are those the steps used."""
    _two_way_groups(tmp_path, lambda groups: optim.AdamW(groups, lr=1e-2))
    ids = dict(enumerate(["0.weight", "1.weight", "2.weight", "0.bias", "1.bias", "2.bias"]))
    alone = gradclip("inspect", tmp_path / "step-3.pt", "--what", "exp_avg", "--format", "json")
    assert alone.code == 0 and "state.0" in {t["name"] for t in alone.json()["tensors"]}
    result = gradclip("inspect", tmp_path / "step-3.pt", "--previous", tmp_path / "step-2.pt",
                      "--group-by", "tensor", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    grads = torch.load(tmp_path / "grads-3.pt", weights_only=True)["grads"]
    assert rel_err(doc["total_norm"], ref_norm(grads.values(), 2)) <= 1e-6
    rows = {row["name"]: row["norm"] for row in doc["tensors"]}
    assert set(rows) == {f"state.{i}" for i in ids}
    for i, name in ids.items():
        assert rel_err(rows[f"state.{i}"], ref_norm([grads[name]], 2)) <= 1e-5, name
    assert any("named by parameter id" in line for line in doc["description"]), doc["description"]
