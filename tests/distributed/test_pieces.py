"""Splitting work into pieces, and per-tensor results that do not depend on the split."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gradclip_cli.core import tensor_power_sums
from gradclip_cli.core.kernels import CHUNK
from gradclip_cli.distributed.pieces import assign, owned


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_piece_has_one_owner_and_runs_are_contiguous(world):
    rng = random.Random(world)
    sizes = [rng.choice([0, 4, 400, 40_000, 4_000_000]) for _ in range(200)]
    owners = assign(sizes, world)
    assert len(owners) == len(sizes)
    assert owners == sorted(owners)  # contiguous runs, in order
    assert set(owners) <= set(range(world))
    assert sorted(i for r in range(world) for i in owned(owners, r)) == list(range(len(sizes)))


def test_bytes_are_shared_within_one_piece_of_the_even_share():
    sizes = [1000 * (i % 7 + 1) for i in range(1000)]
    for world in (2, 4, 16):
        owners = assign(sizes, world)
        share = sum(sizes) / world
        for rank in range(world):
            mine = sum(sizes[i] for i in owned(owners, rank))
            assert abs(mine - share) <= max(sizes)


def test_a_piece_larger_than_a_share_goes_whole_to_one_rank():
    owners = assign([10, 1_000_000, 10], 4)
    assert owners[1] in range(4) and owners.count(owners[1]) >= 1
    assert assign([], 3) == []
    assert assign([0, 0, 0, 0], 2) == [0, 0, 1, 1]
    with pytest.raises(ValueError):
        assign([1], 0)


SHAPES = [(CHUNK * 3 + 5,), (3,), (100,), (100,), (64, 64), (300_000,), (5, 7), (100,),
          (64, 64), (1 << 14,), (100,), (3,), (0,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, 0.7, math.inf])
def test_a_tensors_sums_do_not_depend_on_its_neighbours(dtype, p):
    """What the ranks rely on: measuring any subset, with any number of threads
    or batch size, gives each tensor the bits it gets among all the others."""
    g = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(s, generator=g) * 10).to(dtype) for s in SHAPES]
    tensors[4][3, 3] = math.nan if p == 1.0 else tensors[4][3, 3]
    full = tensor_power_sums(tensors, p, workers=2)
    rng = random.Random(f"{dtype}{p}")
    for _ in range(3):
        subset = sorted(rng.sample(range(len(tensors)), rng.randint(1, len(tensors))))
        part = tensor_power_sums([tensors[i] for i in subset], p, workers=rng.choice([1, 2, 3]),
                                 batch_bytes=rng.choice([1 << 12, 64 << 20]))
        for field in ("scale", "power_sum", "max_abs", "nan", "posinf", "neginf"):
            torch.testing.assert_close(getattr(part, field), getattr(full, field)[subset],
                                       rtol=0, atol=0, equal_nan=True, msg=f"{field} {subset}")


def test_pointwise_pow_is_torchs_pow_where_torch_is_exact_and_overflows_as_it_does():
    from gradclip_cli.core.power_sums import pointwise_pow

    x = torch.tensor([0.0, 0.25, 1.0, 3.0, 1e300, math.inf], dtype=torch.float64)
    for e in (1.0, 2.0, 0.5):
        assert torch.equal(pointwise_pow(x, e), x.pow(e))
    cubed = pointwise_pow(x, 3.0)
    assert cubed[:4].tolist() == [0.0, 0.015625, 1.0, 27.0]
    assert cubed[4:].tolist() == [math.inf, math.inf]
    assert pointwise_pow(torch.zeros(0, dtype=torch.float64), 0.3).numel() == 0


def test_tiny_p_beyond_float32_is_exact():
    """p = 0.1 raises row sums to the 10th power: the overflow must turn into an
    exact recomputation, not an error."""
    sums = tensor_power_sums([torch.full((1000,), 3e38)], 0.1)
    assert float(sums.norm[0]) == pytest.approx(3e38 * 1000.0**10, rel=1e-6)
