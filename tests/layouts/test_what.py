"""Mapping optimizer state to names by shape (the contract's interleaving rule), and --what."""

from __future__ import annotations

import pytest
import torch

from gradclip_cli.source.naming import interleave

A, B, C = (4, 4), (4,), (8, 4)


def test_two_groups_split_the_model_order_one_way():
    # HF Trainer: matrices decayed (group 0), vectors not (group 1), each in model order.
    model = [A, B, C, B, A, B]
    groups = [[A, C, A], [B, B, B]]
    assert interleave(model, groups) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_equal_shapes_across_groups_are_ambiguous():
    assert interleave([A, A], [[A], [A]]) == "ambiguous"


def test_ambiguity_that_later_shapes_resolve_is_not_ambiguous():
    # The first A could start either group; only one choice lets C follow in group 0.
    assert interleave([A, C, A], [[A, C], [A]]) == [(0, 0), (0, 1), (1, 0)]


def test_no_fit_is_none():
    assert interleave([A, B], [[B], [C]]) is None
    assert interleave([A], [[A, A]]) is None  # more state than parameters


def test_frozen_parameters_are_skipped_only_when_there_are_spare_ones():
    assert interleave([A, C, B], [[A, B]]) == [(0, 0), None, (0, 1)]
    assert interleave([A, A, B], [[A, B]]) == "ambiguous"  # which A is frozen?


def test_ambiguity_among_stateless_parameters_alone_is_not_ambiguous():
    """torch.optim keeps a frozen parameter in its group without state (shape None): where
    only such parameters could swap places, the ones with state are placed once."""
    from gradclip_cli.source.naming import _unique_where_stateful

    model = [C, B, A, (3,), (2, 2), (2,)]  # the last two frozen, in both groups, no state
    groups = [[C, A, None], [B, (3,), None]]
    assert interleave(model, groups) == "ambiguous"
    assert _unique_where_stateful(model, groups) == [(0, 0), (1, 0), (0, 1), (1, 1), None, None]
    # Where a parameter with state could sit in two places, it stays ambiguous.
    assert _unique_where_stateful([A, A, None], [[A, None], [A]]) == "ambiguous"


def test_unknown_shapes_fit_anything():
    assert interleave([A, None], [[A], [B]]) == [(0, 0), (1, 0)]


def test_a_trainer_grouping_through_the_cli(gradclip, tmp_path):
    # A model saved in module order, an AdamW with the Trainer's two groups.
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5),
                                torch.nn.Linear(5, 2))
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and not n.startswith("1.")]
    rest = [p for n, p in named if not (n.endswith("weight") and not n.startswith("1."))]
    adam = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=0.01)
    model(torch.randn(4, 3)).square().sum().backward()
    adam.step()
    state = adam.state_dict()
    path = tmp_path / "run.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == "exp_avg"
    assert [t["name"] for t in doc["tensors"]] == [n for n, _ in named]
    ids = {id(p): i for i, p in enumerate(decay + rest)}
    for (_, param), row in zip(named, doc["tensors"]):
        m = state["state"][ids[id(param)]]["exp_avg"].double() / (1 - 0.9)
        assert abs(row["norm"] - float(m.norm())) <= 1e-6 * float(m.norm())


def test_an_ambiguous_grouping_is_measured_under_ids(gradclip, tmp_path):
    """Groups that fit the model's order two ways name no parameter: the state is measured
    under its ids and the report says why, as where there is no order at all; no name is
    guessed."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    a, b = model[0].weight, model[1].weight
    adam = torch.optim.Adam([{"params": [b, model[0].bias]}, {"params": [a, model[1].bias]}])
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    path = tmp_path / "run.pt"
    torch.save({"model": model.state_dict(), "optimizer": adam.state_dict()}, path)
    state = adam.state_dict()["state"]
    beta1 = adam.param_groups[0]["betas"][0]
    for what in ("auto", "exp_avg"):
        result = gradclip("inspect", path, "--what", what, "--format", "json")
        assert result.code == 0, result.err
        doc = result.json()
        assert doc["what"] == "exp_avg"
        assert sorted(t["name"] for t in doc["tensors"]) == [f"state.{i}" for i in range(4)]
        for t in doc["tensors"]:
            entry = state[int(t["name"].split(".")[1])]
            m = entry["exp_avg"].double() / (1 - beta1 ** float(entry["step"]))
            assert abs(t["norm"] - float(m.norm())) <= 1e-6 * float(m.norm())
    table = gradclip("inspect", path)
    assert ("optimizer state named by parameter id (state.N): the param groups fit the "
            "model's parameter order in more than one way") in " ".join(table.out.split())
    assert gradclip("inspect", path, "--what", "update").code == 0


@pytest.mark.parametrize("what", ["exp_avg", "weights", "update"])
def test_clip_takes_grads_only(gradclip, tmp_path, what):
    torch.save({"grads": {"w": torch.ones(3)}}, tmp_path / "g.pt")
    result = gradclip("clip", tmp_path / "g.pt", "--max-norm", "1", "--what", what)
    assert result.code == 2
    assert f"clip changes gradients only: --what grads, got '{what}'" in result.err


def test_unique_where_stateful_agrees_with_every_placement_enumerated():
    """Against brute force: all placements of small random cases, projected onto the items
    with state."""
    import itertools
    import random

    from gradclip_cli.source.naming import _fits, _unique_where_stateful

    def placements(model, groups):
        items = [(g, j) for g, group in enumerate(groups) for j in range(len(group))]
        for spots in itertools.permutations(range(len(model)), len(items)):
            at = dict(zip(items, spots))
            if all(at[(g, j)] < at[(g, j + 1)] for g, group in enumerate(groups)
                   for j in range(len(group) - 1)) and all(
                    _fits(model[at[item]], groups[item[0]][item[1]]) for item in items):
                yield at

    rng = random.Random(0)
    shapes = [(2,), (3,), (2, 2)]
    for _ in range(300):
        model = [rng.choice(shapes) for _ in range(rng.randint(1, 5))]
        groups = [[rng.choice(shapes + [None]) for _ in range(rng.randint(0, 2))]
                  for _ in range(rng.randint(1, 2))]
        stateful = {(g, j) for g, group in enumerate(groups)
                    for j, s in enumerate(group) if s is not None}
        found = {tuple(sorted((item, at[item]) for item in stateful))
                 for at in placements(model, groups)}
        got = _unique_where_stateful(model, groups)
        if not found:
            assert got is None, (model, groups)
        elif len(found) > 1:
            assert got == "ambiguous", (model, groups)
        else:
            (only,) = found
            assert got == [next(((item) for item, i in only if i == k), None)
                           for k in range(len(model))], (model, groups)
