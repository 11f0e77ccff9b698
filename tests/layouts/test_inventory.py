"""What a layout hands over is an inventory: nobody who reads it can change it.

Real layouts, opened from the checkpoints the suite's fixtures write (a Trainer
checkpoint, a Lightning file, a DCP folder, a sharded Hugging Face set): assigning a
field, an item of a mapping or an element of a sequence raises, and
``dataclasses.replace`` gives another inventory, the first one unchanged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradclip_cli.source import roles
from gradclip_cli.source.interface import Contents, StoredTensor
from gradclip_cli.source.layouts import open_checkpoint
from gradclip_cli.source.layouts.draft import Draft

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
