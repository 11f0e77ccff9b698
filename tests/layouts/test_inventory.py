"""What a layout hands over is an inventory: nobody who reads it can change it.

Real layouts, opened from the checkpoints the suite's fixtures write (a Trainer
checkpoint, a Lightning file, a DCP folder, a sharded Hugging Face set): assigning a
field, an item of a mapping or an element of a sequence raises, and
``dataclasses.replace`` gives another inventory, the first one unchanged. Then the
one field that says the model's order (``Contents.order``), as naming optimizer
state by shape reads it (``source/naming.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import roles
from gradclip_cli.source.interface import Contents, OptimizerState, StoredTensor
from gradclip_cli.source.layouts import open_checkpoint
from gradclip_cli.source.layouts.draft import Draft
from gradclip_cli.source.naming import Model, ids_reason, map_names

OPENED = ("trainer_run", "lightning_ckpt", "dcp_checkpoint", "sharded_pretrained")


@pytest.fixture(params=OPENED)
def contents(request) -> Contents:
    path = request.getfixturevalue(request.param)
    if request.param == "sharded_pretrained":
        path = path / "model.safetensors.index.json"
    opened = open_checkpoint(path)
    assert opened.weights, request.param  # every one holds a model
    return opened


def test_no_field_can_be_assigned(contents):
    for field in dataclasses.fields(Contents):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(contents, field.name, getattr(contents, field.name))
    for optimizer in contents.optimizers:  # an optimizer's state is no workspace either
        for field in dataclasses.fields(OptimizerState):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(optimizer, field.name, getattr(optimizer, field.name))


def test_no_mapping_takes_an_item(contents):
    name, tensor = next(iter(contents.weights.items()))
    mappings = [contents.weights, contents.evidence, contents.missing, contents.fused_weights,
                contents.gradients, contents.buffers]
    for mapping in mappings:
        if mapping is None:
            continue
        with pytest.raises(TypeError):
            mapping[name] = tensor
        with pytest.raises(TypeError):
            del mapping[next(iter(mapping), name)]
    assert contents.weights[name] is tensor and isinstance(tensor, StoredTensor)


def test_no_sequence_changes(contents):
    for sequence in (contents.description, contents.files, contents.skipped,
                     contents.optimizers, contents.shards, contents.order or ()):
        assert isinstance(sequence, tuple)
    with pytest.raises((TypeError, AttributeError)):
        contents.files[0] = contents.path
    with pytest.raises(AttributeError):
        contents.description.append("one more line")
    if contents.optimizers:
        with pytest.raises(AttributeError):
            contents.optimizers.append(contents.optimizers[0])


def test_replace_gives_another_inventory_as_read_only(contents):
    before = dict(contents.weights)
    kept = {n: t for n, t in list(before.items())[:1]}
    other = dataclasses.replace(contents, weights=kept, description=[*contents.description])
    assert dict(contents.weights) == before  # the first unchanged
    assert dict(other.weights) == kept and other.weights is not kept
    with pytest.raises(TypeError):
        other.weights["x"] = next(iter(kept.values()))
    assert isinstance(other.description, tuple)


def test_one_flat_mapping_stays_one_in_both_roles(tmp_path):
    tensors = {"w": StoredTensor("w", (2,), torch.float32, ())}
    made = Contents(path=tmp_path, kind="test", gradients=tensors, weights=tensors)
    assert made.gradients is made.weights


def test_a_draft_refuses_a_field_the_inventory_does_not_have(tmp_path):
    draft = Draft(path=tmp_path, kind="test")
    with pytest.raises(AttributeError):
        draft.gradient_error = "a field folded into missing"
    draft.missing[roles.GRADIENT] = "why"
    draft.missing[roles.OPTIMIZER_STATE] = None  # no reason: left out
    finished = draft.finish()
    assert dict(finished.missing) == {roles.GRADIENT: "why"}
    draft.missing[roles.GRADIENT] = "changed after"
    assert finished.missing[roles.GRADIENT] == "why"  # a copy: the draft is the layout's


# ----------------------------------------------------------------- the model's order


def _weights(*names: str) -> dict[str, StoredTensor]:
    return {n: StoredTensor.whole(n, torch.zeros(2, 3)) for n in names}


def test_the_order_is_the_weights_own_their_buffers_apart(tmp_path):
    draft = Draft(path=tmp_path, kind="test", weights={
        **_weights("a.weight"), "bn.running_mean": StoredTensor.whole("m", torch.zeros(3)),
        **_weights("b.weight")})
    finished = draft.finish()
    assert finished.order == ("a.weight", "b.weight")
    assert list(finished.buffers) == ["bn.running_mean"]
    assert list(finished.weights) == ["a.weight", "b.weight"]


def test_sorted_weights_give_no_order_unless_it_was_learned(tmp_path):
    sorted_names = Draft(path=tmp_path, kind="test", weights=_weights("b", "a"),
                         weights_sorted=True)
    assert sorted_names.finish().order is None
    sorted_names.order = ["b", "a"]  # learned elsewhere (a config, a framework's list)
    assert sorted_names.finish().order == ("b", "a")
    assert Draft(path=tmp_path, kind="test").finish().order is None  # no model at all


def _adam(*shapes: tuple[int, ...]) -> OptimizerState:
    state = {i: {"step": 1.0, "exp_avg": StoredTensor.whole(f"{i}.exp_avg", torch.zeros(s))}
             for i, s in enumerate(shapes)}
    return OptimizerState([{"params": list(state), "lr": 1e-3}], state)


def test_ids_stay_names_for_the_reasons_the_inventory_gives(tmp_path):
    opt = _adam((2, 3), (2, 3))
    weights = _weights("a", "b")
    cases = {
        "weights in order": (Draft(path=tmp_path, kind="t", weights=dict(weights)), None),
        "sorted": (Draft(path=tmp_path, kind="t", weights=dict(weights), weights_sorted=True),
                   "the model's weights are stored sorted by name, not in the model's order"),
        "no model": (Draft(path=tmp_path, kind="t"),
                     "no model weights beside the optimizer state to take the names from"),
        "the layout's own": (Draft(path=tmp_path, kind="t", weights=dict(weights),
                                   missing={roles.PARAMETER_NAMES: "its own cause"}),
                             "its own cause"),
    }
    for case, (draft, reason) in cases.items():
        model = Model.of(draft.finish())
        assert ids_reason(opt, model) == reason, case
        names = map_names(opt, model)
        assert names == ({0: "a", 1: "b"} if reason is None else {0: "state.0", 1: "state.1"})


def test_a_tied_name_is_no_parameter_of_its_own_in_the_order(tmp_path):
    # one storage under two names (tied embeddings): the optimizer holds it once
    shared = torch.zeros(4, 3)
    weights = {"wte": StoredTensor.whole("wte", shared),
               "head": StoredTensor.whole("head", shared),
               "ln": StoredTensor.whole("ln", torch.zeros(3))}
    opt = _adam((4, 3), (3,))
    inventory = Draft(path=tmp_path, kind="t", weights=weights).finish()
    assert inventory.order == ("wte", "head", "ln")  # the names as stored, for the report
    # counted twice, the (4, 3) state would fit "wte" and "head" alike: ambiguous
    assert map_names(opt, Model.of(inventory)) == {0: "wte", 1: "ln"}
    apart = {n: StoredTensor.whole(n, torch.zeros(4, 3)) for n in ("wte", "head")}
    with pytest.raises(InputError, match="more than one way"):
        map_names(opt, Model({**apart, "ln": weights["ln"]}, ("wte", "head", "ln")))
