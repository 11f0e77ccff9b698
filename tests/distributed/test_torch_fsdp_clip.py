"""torch's FSDP2 clip_grad_norm_ test against gradclip's drop-in, on 2 and 4 gloo ranks
(torch_fsdp_clip_ranks.py runs it; this file checks what each rank recorded)."""

from __future__ import annotations

import json

import pytest

from tests import gloo

from .torch_fsdp_clip_ranks import run_rank


def _spawn(world: int, tmp_path_factory) -> list[dict]:
    outdir = tmp_path_factory.mktemp(f"torch_fsdp{world}")
    gloo.spawn(run_rank, world, str(outdir), nprocs=world)
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["1d-2-ranks", "2d-4-ranks"])
def ranks(request, tmp_path_factory):
    return _spawn(request.param, tmp_path_factory)


def test_torch_fsdp2_clip_assertions_hold(ranks):
    for r in ranks:
        result = r["clip_like_torch_tests"]
        assert "error" not in result, result.get("error")
        assert result["failures"] == []
    assert len({tuple(r["clip_like_torch_tests"]["totals"]) for r in ranks}) == 1


def test_several_meshes_give_the_first_gradients_mesh(ranks):
    if "several_meshes" not in ranks[0]:
        pytest.skip("needs 4 ranks")
    for r in ranks:
        out = r["several_meshes"]
        assert "error" not in out, out.get("error")
        assert out["mesh_is_first"] is True
        assert out["replicated"] == [True, True]
        assert out["float"] == out["full_tensor"] == pytest.approx(out["reference"], rel=1e-6)
    assert len({r["several_meshes"]["float"] for r in ranks}) == 1
