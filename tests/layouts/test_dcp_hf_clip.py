"""``clip`` of DCP's Hugging Face layout: each piece scaled in its own file, the set switched whole.

The gradients are a real 2-rank FSDP2 step saved by
``HuggingFaceStorageWriter(save_distributed=True)`` (``dcp_hf_ranks.py``):
sharded pieces in two files, ``2.bias`` replicated (the same piece in both
files) and an int64 tensor that is not a gradient. Every expected number is
computed here in float64 from the original shard files (a repeated piece
counted once), and the clipped folder is read back by torch's own
``HuggingFaceStorageReader`` through ``dcp.load``, by the safetensors
library file by file, and by ``gradclip inspect``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from gradclip_cli.source.layouts import dcp_hf
from gradclip_cli.source.layouts.dcp_folder import piece_name
from tests.cli.support import load_safetensors, rel_err

from .kill_clip import kill_during_clip

TOL = 1e-6
EPS = torch.finfo(torch.float32).eps
REPLICATED = "2.bias"


def _files(folder: Path) -> dict[str, tuple[dict[str, torch.Tensor], dict]]:
    """Every shard file of ``folder``: its tensors and its header metadata."""
    return {f.name: load_safetensors(f) for f in sorted(folder.glob("*.safetensors"))}


def _whole(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor put together from its pieces (``DCP_SHARDING_INFO``), floating point in
    float64; a piece found twice must hold the same values and is placed once."""
    pieces: dict[str, dict[tuple, torch.Tensor]] = {}
    for tensors, metadata in _files(folder).values():
        info = json.loads(metadata["DCP_SHARDING_INFO"])
        for name, tensor in tensors.items():
            at = tuple(info[name]["saved_offsets"])
            seen = pieces.setdefault(name, {})
            if at in seen:
                assert torch.equal(seen[at], tensor), (name, at)
            seen[at] = tensor
    whole = {}
    for name, found in pieces.items():
        size = [max(o[d] + t.shape[d] for o, t in found.items()) for d in range(len(next(
            iter(found.values())).shape))]
        dtype = next(iter(found.values())).dtype
        out = torch.zeros(size, dtype=torch.float64 if dtype.is_floating_point else dtype)
        for at, tensor in found.items():
            out[tuple(slice(o, o + n) for o, n in zip(at, tensor.shape))] = tensor
        whole[name] = out
    return whole


def _norm(tensors) -> float:
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm())


def _dcp_load(folder: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``folder`` read by torch's own reader into tensors shaped like ``like`` (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = {name: torch.full(t.shape, -7, dtype=torch.float32 if t.is_floating_point()
                              else t.dtype) for name, t in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)))
    return state


def _digests(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
            for n in sorted(os.listdir(folder))}


@pytest.fixture
def grads(dcp_hf_grads, tmp_path) -> Path:
    folder = tmp_path / "grads"
    shutil.copytree(dcp_hf_grads, folder)
    return folder


def test_fixture_holds_sharded_and_replicated_pieces(dcp_hf_grads):
    files = _files(dcp_hf_grads)
    assert len(files) == 2
    (first, meta0), (second, meta1) = files.values()
    assert torch.equal(first[REPLICATED], second[REPLICATED])  # the same piece twice
    assert json.loads(meta1["DCP_SHARDING_INFO"])["2.weight"]["saved_offsets"] == [2, 0]
    assert not first["counts"].is_floating_point()
    reference = torch.load(dcp_hf_grads.parent / "grads_reference.pt", weights_only=True)
    whole = _whole(dcp_hf_grads)
    assert set(whole) == {*reference, "counts"}
    for name, grad in reference.items():
        assert torch.equal(whole[name], grad.double()), name


def test_held_pieces_are_named_as_dcp_chunks_are(dcp_hf_grads):
    """Clip holds each piece as a gradient of its own, named as a DCP folder's chunks are
    (``dcp_folder.piece_name``): a tensor in one piece by its name, another by
    ``name[offsets]``."""
    contents = dcp_hf.open(dcp_hf_grads, key=None, trust_pickle=False, verify=False)
    held = dcp_hf.write_back(contents).gradients
    assert "2.weight[2,0]" in held and REPLICATED in held  # sharded; one piece, kept once
    for name, tensor in contents.gradients.items():
        for piece in tensor.pieces:
            label = name if len(tensor.pieces) == 1 else \
                f"{name}[{','.join(str(o) for o in piece.offsets)}]"
            assert piece_name(name, tensor, piece) == label
            assert torch.equal(held[label].held, piece.held), label


def _check_clipped(original: dict, out: Path, scaled) -> None:
    """Every file of ``out`` is the original's with its gradients ``scaled`` (float64 in,
    the exact result out): same tensors, dtypes, shapes and metadata; other tensors and
    the two copies of the replicated piece byte for byte."""
    written = _files(out)
    assert list(written) == list(original)
    for name, (tensors, metadata) in original.items():
        new_tensors, new_metadata = written[name]
        assert new_metadata == metadata, name  # DCP_SHARDING_INFO and the rest, exactly
        assert sorted(new_tensors) == sorted(tensors), name
        for key, tensor in tensors.items():
            new = new_tensors[key]
            assert (new.dtype, new.shape) == (tensor.dtype, tensor.shape), (name, key)
            if not tensor.is_floating_point():
                assert torch.equal(new, tensor), (name, key)
                continue
            exact = scaled(tensor.double())
            assert bool(((new.double() - exact).abs() <= EPS * exact.abs()).all()), (name, key)
    copies = [tensors[REPLICATED] for tensors, _ in written.values()]
    assert torch.equal(copies[0].view(torch.uint8), copies[1].view(torch.uint8))


@pytest.mark.parametrize("in_place", [False, True], ids=["output", "in-place"])
def test_clip_max_norm_scales_every_piece(gradclip, grads, tmp_path, in_place):
    original, before = _files(grads), _digests(grads)
    whole = _whole(grads)
    floating = {n: t for n, t in whole.items() if t.is_floating_point()}
    total = _norm(floating.values())  # the replicated piece once
    limit = total / 4
    args = ["--in-place"] if in_place else ["-o", tmp_path / "clipped"]
    result = gradclip("clip", grads, "--max-norm", limit, *args, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    out = grads if in_place else tmp_path / "clipped"
    assert doc["output"] == str(out) and doc["clipped"]
    assert doc["num_tensors"] == len(floating)  # tensors, not their pieces
    assert rel_err(doc["total_norm_before"], total) <= TOL
    coef = doc["clip_coef"]
    assert rel_err(coef, limit / (total + 1e-6)) <= TOL
    _check_clipped(original, out, lambda t: t * coef)
    loaded = _dcp_load(out, whole)  # torch's own reader
    for name, tensor in floating.items():
        exact = tensor * coef
        assert bool(((loaded[name].double() - exact).abs() <= EPS * exact.abs()).all()), name
    assert torch.equal(loaded["counts"], whole["counts"])
    check = gradclip("inspect", out, "--max-norm", limit, "--format", "json")
    assert check.code == 0 and check.json()["total_norm"] <= limit
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    if not in_place:
        assert _digests(grads) == before  # the input is untouched


def test_clip_value_clamps_every_piece(gradclip, grads, tmp_path):
    original = _files(grads)
    whole = _whole(grads)
    out = tmp_path / "clamped"
    result = gradclip("clip", grads, "--clip-value", "1", "-o", out, "--format", "json")
    assert result.code == 0, result.err
    assert result.json()["clipped"]  # |g| reaches past 1 in the fixture
    _check_clipped(original, out, lambda t: t.clamp(-1, 1))
    loaded = _dcp_load(out, whole)
    for name, tensor in whole.items():
        expected = tensor.clamp(-1, 1) if tensor.is_floating_point() else tensor
        assert torch.equal(loaded[name].to(expected.dtype), expected), name
    check = gradclip("inspect", out, "--format", "json")
    assert check.code == 0 and check.json()["max_abs"] == 1.0


def test_clip_refuses_an_existing_output(gradclip, grads, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    before = _digests(grads)
    result = gradclip("clip", grads, "--max-norm", "1", "-o", taken)
    assert result.code == 2
    assert "exists; a clipped set is written as a new folder" in result.err
    assert os.listdir(taken) == [] and _digests(grads) == before


def test_clip_of_one_file_of_the_set_is_refused(gradclip, grads, tmp_path):
    """A file holds pieces of the tensors: its norm is not the set's. Exit 2, nothing
    written; the folder it names clips (the tests above)."""
    shard = sorted(grads.glob("*.safetensors"))[0]
    before = _digests(grads)
    result = gradclip("clip", shard, "--max-norm", "1", "-o", tmp_path / "one.safetensors")
    assert result.code == 2 and result.out == ""
    assert result.err.splitlines() == [
        f"gradclip: {shard}: one shard of the set in {grads}: clip scales by the total norm "
        "of every gradient of the set, which this file alone does not hold; clip the set: "
        f"gradclip clip {grads}"]
    assert not (tmp_path / "one.safetensors").exists() and _digests(grads) == before


def _save(folder: Path, tensors: dict[str, torch.Tensor], files: int) -> None:
    """``tensors`` saved by ``dcp.save`` in this process (one rank) in DCP's HF layout,
    spread over ``files`` safetensors files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    where = {name: i * files // len(tensors) + 1 for i, name in enumerate(tensors)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(
            str(folder), save_distributed=True, fqn_to_index_mapping=where))


def test_bfloat16_rounding_still_passes_inspect(gradclip, tmp_path):
    """bf16 pieces: the coefficient is lowered where rounding would leave the total above
    --max-norm, and the written set passes inspect's check."""
    g = torch.Generator().manual_seed(3)
    folder = tmp_path / "halves"
    _save(folder, {f"h.{i}": torch.randn(257, generator=g).bfloat16() for i in range(4)}, 2)
    lowered = []
    for limit in ("0.5", "1.3", "3"):
        out = tmp_path / f"out{limit}"
        result = gradclip("clip", folder, "--max-norm", limit, "-o", out, "--format", "json")
        assert result.code == 0, result.err
        lowered.append(result.json()["coef_lowered"])
        assert gradclip("inspect", out, "--max-norm", limit).code == 0, limit
    assert any(lowered)  # torch's coefficient would have left one of them above


def test_kill_9_during_clip(tmp_path):
    """Killed while the new set is written, and after: the folder is whole, old or new."""
    folder = tmp_path / "grads"
    g = torch.Generator().manual_seed(5)
    _save(folder, {f"h.{i}.w": torch.randn(500_000, generator=g) * (i + 1)
                   for i in range(8)}, 4)  # 4 files, 16 MB
    assert len(list(folder.glob("*.safetensors"))) == 4
    seen = kill_during_clip(folder, lambda f: _norm(_whole(f).values()), half=3)
    assert seen[0].startswith("temp-appears: old set")
    assert "new set" in seen[-1]


def test_a_shard_linked_inside_the_folder_is_written_as_a_file(gradclip, grads, tmp_path):
    """A shard that is a link to a file inside the folder is read through the link; the
    clipped set holds it as a plain file (leaving it out would lose its pieces)."""
    second = sorted(grads.glob("*.safetensors"))[1]
    (grads / "store").mkdir()
    second.rename(grads / "store" / "pieces.bin")
    second.symlink_to(Path("store") / "pieces.bin")
    whole = _whole(grads)
    out = tmp_path / "clipped"
    result = gradclip("clip", grads, "--clip-value", "1", "-o", out)
    assert result.code == 0, result.err
    assert (out / second.name).is_file() and not (out / second.name).is_symlink()
    after = _whole(out)
    for name, tensor in whole.items():
        expected = tensor.clamp(-1, 1) if tensor.is_floating_point() else tensor
        assert torch.equal(after[name], expected), name
