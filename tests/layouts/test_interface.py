"""The layout interface: stored tensors in pieces, the registry, one total across shards."""

from __future__ import annotations

import math

import pytest
import torch

from gradclip_cli.errors import InputError
from gradclip_cli.measuring import stored_power_sums
from gradclip_cli.source.interface import Piece, StoredTensor
from gradclip_cli.source.layouts import open_checkpoint
from tests.cli.support import ref_norm, rel_err


def _pieces(full: torch.Tensor, rows: list[int]) -> StoredTensor:
    """``full`` split along dim 0 into pieces read on demand (as a DCP layout hands them)."""
    pieces, start = [], 0
    for n in rows:
        part = full[start:start + n].clone()
        pieces.append(Piece((start, 0), tuple(part.shape), lambda part=part: part))
        start += n
    return StoredTensor("w", full.shape, full.dtype, pieces)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("p", [1.0, 2.0, 3.5, math.inf])
def test_a_tensor_in_pieces_measures_as_the_whole(dtype, p):
    torch.manual_seed(0)
    full = (torch.randn(40, 7, dtype=torch.float64) * 3).to(dtype)
    split = _pieces(full, [5, 17, 1, 17])
    assert torch.equal(split.read(), full)
    assert split.held is None
    sums = stored_power_sums([split, StoredTensor.whole("b", full)], p)
    expected = ref_norm([full], p)
    for norm in sums.norm.tolist():
        assert rel_err(norm, expected) <= 1e-6


def test_pieces_batched_beyond_one_read(monkeypatch):
    # Many pieces across several batches: each piece read once, combined exactly.
    from gradclip_cli import measuring

    monkeypatch.setattr(measuring, "_BATCH_BYTES", 256)
    reads = []
    full = torch.randn(64, 8, dtype=torch.float64)
    split = _pieces(full, [4] * 16)
    counted = StoredTensor("w", split.shape, split.dtype, [
        Piece(pc.offsets, pc.shape, lambda pc=pc: reads.append(pc.offsets) or pc.read())
        for pc in split.pieces])
    sums = stored_power_sums([counted], 2.0)
    assert len(reads) == 16
    assert rel_err(float(sums.norm[0]), ref_norm([full], 2.0)) <= 1e-12


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_derived_values_computed_by_workers_keep_each_name(monkeypatch, workers):
    # Transforms (an update, a square root) are computed by the workers side by side, a
    # batch at a time: each name's power sum is still its own value's, in order.
    from gradclip_cli import measuring
    from gradclip_cli.source.interface import Derivation

    monkeypatch.setattr(measuring, "_BATCH_BYTES", 2000)
    torch.manual_seed(2)
    fulls = [torch.randn(10 + i, 6, dtype=torch.float64).abs() for i in range(9)]
    stored = [_pieces(f, [3, f.shape[0] - 3]) for f in fulls]
    derived = [Derivation((s, s), lambda a, b, k=k: a.sqrt() * (k + 1) + b, tuple(s.shape))
               for k, s in enumerate(stored)]
    sums = measuring.power_sums(derived, 2.0, workers=workers)
    for k, f in enumerate(fulls):
        expected = ref_norm([f.sqrt() * (k + 1) + f], 2.0)
        assert rel_err(float(sums.norm[k]), expected) <= 1e-12


def test_sharded_set_is_one_total_and_a_shard_alone_says_so(tmp_path):
    from huggingface_hub import save_torch_state_dict

    torch.manual_seed(1)
    state = {f"layer.{i}.weight": torch.randn(30, 30) for i in range(6)}
    save_torch_state_dict(state, tmp_path, max_shard_size=8000)
    contents = open_checkpoint(tmp_path)
    assert contents.kind == "hf-sharded"
    assert len(contents.files) == 4  # the index and three shards
    assert list(contents.gradients) == sorted(state)
    total = float(stored_power_sums(list(contents.gradients.values()), 2.0).total().norm[0])
    assert rel_err(total, ref_norm(state.values(), 2.0)) <= 1e-6
    shard = open_checkpoint(tmp_path / "model-00002-of-00003.safetensors")
    assert shard.kind == "safetensors"
    assert shard.description == (
        "covers shard model-00002-of-00003.safetensors only; the whole checkpoint is indexed "
        "by model.safetensors.index.json",)


def test_a_folder_of_no_known_layout_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InputError, match="is a directory, but not a checkpoint"):
        open_checkpoint(tmp_path)
