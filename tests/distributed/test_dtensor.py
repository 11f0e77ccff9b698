"""The drop-ins on DTensor gradients, 2 and 4 gloo ranks on the CPU.

Every rank must return the same total, equal (to 1e-6 relative, the
contract's accuracy) to the float64 norm of every gradient's
``full_tensor()``. One spawned group per world size runs all its checks.
"""

from __future__ import annotations

import json
import math

import pytest

from tests import gloo

from .dtensor_ranks import run_rank

RTOL = 1e-6


def _spawn(world: int, tmp_path_factory) -> list[dict]:
    outdir = tmp_path_factory.mktemp(f"dtensor{world}")
    gloo.spawn(run_rank, world, str(outdir), nprocs=world)
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _spawn(2, tmp_path_factory)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _spawn(4, tmp_path_factory)


def _check(ranks: list[dict], check: str, key: str) -> tuple[float, float]:
    """(ours, reference) after asserting every rank returned the same total."""
    for r in ranks:
        assert "error" not in r[check], r[check]["error"]
    totals = {r[check][key][0] for r in ranks}
    assert len(totals) == 1, f"{check} {key}: ranks disagree: {totals}"
    ours, ref = ranks[0][check][key][:2]
    assert math.isfinite(ours) and ours == pytest.approx(ref, rel=RTOL), (check, key)
    return ours, ref


@pytest.mark.parametrize("p", ["p=2.0", "p=1.0", "p=3.0", "p=inf"])
def test_fsdp2_sharded_gradients(two, p):
    assert two[0]["fsdp2"]["placements"] == ["(Shard(dim=0),)"]
    _check(two, "fsdp2", p)


def test_fsdp2_beyond_float32(two):
    ours, ref = _check(two, "fsdp2", "huge")
    assert ref > 1e31  # its squares overflow a float32 sum


def test_fsdp2_clip_grad_norm_reaches_max_norm(two):
    before, after, max_norm = two[0]["fsdp2"]["clipped"]
    assert before == pytest.approx(two[0]["fsdp2"]["huge"][1], rel=RTOL)
    assert after == pytest.approx(max_norm, rel=1e-5)
    assert {r["fsdp2"]["clipped"][1] for r in two} == {after}


@pytest.mark.parametrize("key", ["mixed", "with_plain", "partial", "float64_path",
                                 "float64_path_inf"])
def test_shard_replicate_partial(two, four, key):
    _check(two, "placements_by_hand", key)
    _check(four, "placements_by_hand", key)


@pytest.mark.parametrize("key", ["p=2", "p=inf", "float64_path"])
def test_fsdp_times_tensor_parallel(four, key):
    assert any("Shard" in p and "," in p for p in four[0]["fsdp_tp"]["placements"])
    _check(four, "fsdp_tp", key)


def test_two_meshes_where_torch_fails(four):
    assert four[0]["two_meshes"]["torch"].startswith("raises")
    _check(four, "two_meshes", "p=2")
    _check(four, "two_meshes", "float64_path")
    before, after, max_norm = four[0]["two_meshes"]["clipped"]
    assert after == pytest.approx(max_norm, rel=1e-5)


def test_monitor_logs_fsdp2_layers_as_float64_says(two):
    """GradMonitor on FSDP2 DTensors: rank 0 logs each layer's norm of the whole gradient,
    every rank clips by the same total, and a NaN on one rank's shard is dumped whole."""
    ranks = [r["monitor_fsdp2"] for r in two]
    for r in ranks:
        assert "error" not in r, r.get("error")
    for step, (zero, one) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"])):
        assert one["groups"] is None  # rank 1 writes no log
        assert zero["total"][0] == one["total"][0], step  # the same total on every rank
        assert zero["total"][0] == pytest.approx(zero["total"][1], rel=RTOL), step
        assert set(zero["groups"]) == set(zero["references"]) == {"0", "2"}
        for layer, norm in zero["groups"].items():
            assert norm == pytest.approx(zero["references"][layer], rel=RTOL), (step, layer)
        after, max_norm = zero["after"]
        assert after == pytest.approx(max_norm, rel=1e-5), step
    for r in ranks:
        assert r["nan"]["nonfinite"]["nan"] == 1
    assert ranks[0]["nan"]["dump"].endswith("step-2.pt")
    assert ranks[0]["dump_matches"] is True
