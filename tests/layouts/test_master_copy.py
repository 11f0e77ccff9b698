"""``master_copy``: the one rule by which a mixed-precision layout takes an fp32 master for
the model's 16-bit weight, checked against torch's own rounding and ``torch.equal``."""

from __future__ import annotations

import pytest
import torch

from gradclip_cli.source.layouts.master_copy import head_key, rounds_to

SIXTEEN = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", [*SIXTEEN, torch.float32])
def test_finite_values_agree_with_torch_equal(dtype):
    torch.manual_seed(0)
    master = torch.randn(7, 5)
    model = master.to(dtype)
    assert rounds_to(master, model) == torch.equal(master.to(dtype), model) is True
    nudged = model.clone()
    nudged[3, 2] = torch.nextafter(nudged[3, 2].float(), torch.tensor(10.0)).to(dtype) + 1
    assert rounds_to(master, nudged) == torch.equal(master.to(dtype), nudged) is False


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_nan_matches_nan_in_the_same_place_only(dtype):
    master = torch.tensor([1.0, float("nan"), -2.5])
    assert rounds_to(master, master.to(dtype))
    assert not torch.equal(master.to(dtype), master.to(dtype))  # what the old check did
    moved = torch.tensor([float("nan"), 1.0, -2.5], dtype=dtype)
    assert not rounds_to(master, moved)
    assert not rounds_to(master, torch.tensor([1.0, 0.0, -2.5], dtype=dtype))
    assert not rounds_to(torch.tensor([1.0, 0.0, -2.5]), master.to(dtype))


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_infinities_match_by_sign_and_overflow_rounds_to_inf(dtype):
    big = torch.finfo(dtype).max * 4.0  # finite in float32, inf once rounded
    master = torch.tensor([big, -big, float("inf")])
    assert rounds_to(master, torch.tensor([float("inf"), -float("inf"), float("inf")],
                                          dtype=dtype))
    assert not rounds_to(master, torch.tensor([-float("inf"), -float("inf"), float("inf")],
                                              dtype=dtype))


def test_other_shapes_never_match():
    assert not rounds_to(torch.zeros(6), torch.zeros(2, 3, dtype=torch.bfloat16))


def test_head_keys_meet_where_rounds_to_may_match():
    master = torch.tensor([[1.0, float("nan")], [3.0, -0.0]])
    model = master.to(torch.bfloat16)
    assert head_key(master, torch.bfloat16) == head_key(model, torch.bfloat16)
    assert head_key(master, torch.bfloat16) != head_key(master, torch.float16)
    assert head_key(master, torch.bfloat16) != head_key(master.reshape(4), torch.bfloat16)
    other = master.clone()
    other[0, 1] = 0.0  # a NaN and a zero never share a key
    assert head_key(other, torch.bfloat16) != head_key(master, torch.bfloat16)
