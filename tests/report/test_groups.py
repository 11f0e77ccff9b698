"""The one group reduction (``report/groups.py``) against float64 computed here.

Each group's norm is the p-norm of its members' elements as one vector, the
total that of every element; counts of NaN, +inf and -inf are per group and
in all. The reference is plain float64 torch over the concatenated values.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradclip_cli.core import tensor_power_sums
from gradclip_cli.report import NonFinite, parse_group_by
from gradclip_cli.report.groups import group_sums, nonfinite_counts
from tests.cli.support import rel_err

NAMES = [
    "embed.weight", "h.0.attn.weight", "h.1.attn.weight", "h.0.mlp.weight", "h.1.mlp.bias",
    "h.0.mlp.bias", "head.weight",
]  # fmt: skip


def _tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes far apart, so a group's norm is not its largest member's by luck.
    return [
        (torch.randn(3 + i, 5, generator=g) * 10.0 ** (3 * i - 9)).to(dtype)
        for i in range(len(NAMES))
    ]


def _reference(tensors: list[torch.Tensor], p: float) -> float:
    flat = torch.cat([t.double().reshape(-1) for t in tensors])
    return float(torch.linalg.vector_norm(flat, ord=p))


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, 0.5, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_group_norms_and_total_match_float64(p, dtype):
    tensors = _tensors(0, dtype)
    members = [parse_group_by("layer")(n) for n in NAMES]
    grouped = group_sums(members, tensor_power_sums(tensors, p))
    # Groups in the order their first member appears, members anywhere after.
    assert grouped.names == ["embed", "h.0", "h.1", "head"]
    assert grouped.index.tolist() == [0, 1, 2, 1, 2, 1, 3]
    for g, name in enumerate(grouped.names):
        mine = [t for t, m in zip(tensors, members) if m == name]
        assert rel_err(float(grouped.groups.norm[g]), _reference(mine, p)) <= 1e-6, name
    assert rel_err(float(grouped.total.norm[0]), _reference(tensors, p)) <= 1e-6


def test_other_sums_reduce_into_the_same_groups():
    grads, weights = _tensors(1), _tensors(2)
    members = [parse_group_by("module")(n) for n in NAMES]
    grouped = group_sums(members, tensor_power_sums(grads, 2.0))
    by_weight = grouped.reduce(tensor_power_sums(weights, 2.0))
    for g, name in enumerate(grouped.names):
        mine = [w for w, m in zip(weights, members) if m == name]
        assert rel_err(float(by_weight.norm[g]), _reference(mine, 2.0)) <= 1e-6, name


def test_nonfinite_counts_per_group_and_in_all():
    tensors = _tensors(3)
    tensors[1][0, :2] = math.nan  # h.0
    tensors[3][1, 0] = math.inf  # h.0
    tensors[4][0, 1] = -math.inf  # h.1
    tensors[4][2, 2] = -math.inf
    members = [parse_group_by("layer")(n) for n in NAMES]
    sums = tensor_power_sums(tensors, 2.0)
    grouped = group_sums(members, sums)
    assert nonfinite_counts(grouped.groups) == [
        NonFinite(),
        NonFinite(2, 1, 0),
        NonFinite(0, 0, 2),
        NonFinite(),
    ]
    assert nonfinite_counts(grouped.total) == [NonFinite(2, 1, 2)]
    assert nonfinite_counts(sums)[4] == NonFinite(0, 0, 2)
    assert math.isnan(float(grouped.groups.norm[1])) and math.isinf(float(grouped.groups.norm[2]))
    clean = [t for t, m in zip(tensors, members) if m in ("embed", "head")]
    finite = [float(grouped.groups.norm[0]), float(grouped.groups.norm[3])]
    assert rel_err(math.hypot(*finite), _reference(clean, 2.0)) <= 1e-6


def test_no_pieces_no_groups():
    grouped = group_sums([], tensor_power_sums([], 2.0))
    assert grouped.names == [] and len(grouped.groups) == 0
    assert float(grouped.total.norm[0]) == 0.0
    assert nonfinite_counts(grouped.total) == [NonFinite()]
