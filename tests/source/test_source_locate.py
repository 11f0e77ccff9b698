"""The contract's --key rule for finding the gradient mapping."""

from __future__ import annotations

import pytest
import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint, select_gradients


def grads(*names: str) -> dict[str, torch.Tensor]:
    return {name: torch.randn(2) for name in names}


def test_flat_mapping_is_the_gradients_in_order():
    root = grads("z.weight", "a.weight", "m.bias")
    selection = select_gradients(root, None)
    assert selection.key_path == () and selection.key == ""
    assert list(selection.tensors) == ["z.weight", "a.weight", "m.bias"]
    assert all(selection.tensors[name] is root[name] for name in root)  # no copies


def test_training_checkpoint_picks_grads():
    root = {
        "model": grads("w", "b"),
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1}]},
        "grads": grads("w", "b"),
        "step": 10,
    }
    selection = select_gradients(root, None)
    assert selection.key_path == ("grads",)
    assert selection.tensors["w"] is root["grads"]["w"]


@pytest.mark.parametrize("name", ["grads", "gradients", "grad"])
def test_each_conventional_name_is_found(name):
    root = {"model": grads("w"), name: grads("w"), "epoch": 1}
    assert select_gradients(root, None).key_path == (name,)


def test_dotted_key_follows_nested_mappings():
    root = {"state": {"grads": grads("w", "b"), "model": grads("w")}, "grads": grads("x")}
    selection = select_gradients(root, "state.grads")
    assert selection.key == "state.grads"
    assert selection.tensors["w"] is root["state"]["grads"]["w"]


def test_key_may_name_an_entry_that_contains_dots():
    root = {"model.grads": grads("w"), "other": grads("v")}
    assert select_gradients(root, "model.grads").key_path == ("model.grads",)


def test_key_matches_non_string_keys_by_their_text():
    root = {"shards": {0: grads("w"), 1: grads("v")}}
    assert list(select_gradients(root, "shards.1").tensors) == ["v"]


def test_missing_key_lists_candidates():
    root = {"state": {"grads": grads("w")}, "model": grads("w")}
    with pytest.raises(InputError) as caught:
        select_gradients(root, "state.gradz", path="ckpt.pt")
    message = str(caught.value)
    assert message.startswith("ckpt.pt: ") and "'gradz'" in message
    # A model's weights ("model") are never a candidate for gradients.
    assert message.endswith("candidates for --key: state.grads") and "\n" not in message


def test_key_leading_to_a_tensor_is_an_error():
    root = {"grads": grads("w")}
    with pytest.raises(InputError, match="not a mapping"):
        select_gradients(root, "grads.w")


def test_ambiguous_checkpoint_lists_candidate_keys():
    root = {"model": grads("w"), "ema": {"weights": grads("w")}, "step": 3}
    with pytest.raises(InputError) as caught:
        select_gradients(root, None, path="run.ckpt")
    message = str(caught.value)
    assert message.startswith("run.ckpt: ") and "--key" in message
    assert message.endswith("candidates for --key: ema.weights")  # "model" is weights


def test_two_gradient_mappings_are_ambiguous():
    with pytest.raises(InputError, match="grads, gradients"):
        select_gradients({"grads": grads("w"), "gradients": grads("w")}, None)


def test_a_tensor_named_grad_in_a_flat_file_is_just_a_gradient():
    root = {"grad": torch.randn(2), "w": torch.randn(3)}
    selection = select_gradients(root, None)
    assert selection.key_path == () and list(selection.tensors) == ["grad", "w"]


def test_non_floating_and_non_tensor_entries_are_skipped_and_listed():
    root = {
        "grads": {
            "w": torch.randn(2),
            "mask": torch.ones(2, dtype=torch.bool),
            "count": torch.arange(3),
            "note": "hello",
            "b": torch.randn(1).half(),
        }
    }
    selection = select_gradients(root, None)
    assert list(selection.tensors) == ["w", "b"]
    assert selection.skipped == ["mask", "count", "note"]


def test_flat_file_with_a_step_counter_skips_the_counter():
    root = {"w": torch.randn(2), "step": 7}
    selection = select_gradients(root, None)
    assert list(selection.tensors) == ["w"] and selection.skipped == ["step"]


def test_nested_gradients_are_flattened_with_dotted_names():
    root = {"grads": {"encoder": {"w": torch.randn(2)}, "heads": [torch.randn(1), torch.randn(1)]}}
    assert list(select_gradients(root, None).tensors) == ["encoder.w", "heads.0", "heads.1"]


def test_colliding_flattened_names_are_an_error():
    root = {"grads": {"a.b": torch.randn(1), "a": {"b": torch.randn(1)}}}
    with pytest.raises(InputError, match="same name"):
        select_gradients(root, None)


def test_no_floating_point_tensors_is_an_error():
    root = {"grads": {"ids": torch.arange(4), "mask": torch.ones(2, dtype=torch.bool)}}
    with pytest.raises(InputError, match="no floating-point gradients") as caught:
        select_gradients(root, None, path="g.pt")
    assert str(caught.value).startswith("g.pt: ")


def test_root_that_is_not_a_mapping_is_an_error():
    with pytest.raises(InputError, match="list"):
        select_gradients([torch.randn(2)], None)


def test_nothing_with_tensors_says_so():
    with pytest.raises(InputError, match="no mapping in the file holds gradient-shaped tensors$"):
        select_gradients({"config": {"lr": 0.1}}, None)


def test_lightning_style_checkpoint_with_grads(tmp_path):
    path = tmp_path / "epoch=3-step=100.ckpt"
    root = {
        "epoch": 3,
        "global_step": 100,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {"layer.weight": torch.randn(3, 2), "layer.bias": torch.randn(3)},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.01}]}],
        "lr_schedulers": [],
        "grads": {"layer.weight": torch.randn(3, 2), "layer.bias": torch.randn(3)},
    }
    torch.save(root, path)
    selection = select_gradients(load_checkpoint(path).root, None)
    assert selection.key_path == ("grads",)
    assert torch.equal(selection.tensors["layer.weight"], root["grads"]["layer.weight"])
