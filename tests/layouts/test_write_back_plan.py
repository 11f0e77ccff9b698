"""A layout's ``WriteBackPlan`` as data: asserted without writing anything.

Each checkpoint is written by its own library (``torch.save``,
``huggingface_hub``, ``dcp.save``); the plan is checked against what that
library says it wrote (the index's ``weight_map``, DCP's own ``.metadata``
and the stored bytes), and the folder is unchanged after planning.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
import zlib
from pathlib import Path

import torch

from gradclip_cli.source.interface import FileWrite, WriteBack, WriteBackPlan
from gradclip_cli.source.layouts import open_checkpoint, write_back


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"h.0.w": torch.randn(10, 4, generator=g), "h.0.b": torch.randn(7, generator=g),
            "h.1.w": torch.randn(300, generator=g).half()}


def test_a_single_file_is_one_file_written_whole(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"grads": _grads(), "step": 3}, path)
    contents = open_checkpoint(path)
    back = write_back(contents)
    assert back == WriteBack(WriteBackPlan(None, (FileWrite(path, "torch-zip",
                                                            tuple(_grads())),)))
    assert back.plan.copies("h.0.w") == ()
    assert "FileWrite(path=" in repr(back.plan)  # printable
    assert os.listdir(tmp_path) == ["g.pt"]


def test_an_hf_sharded_set_is_its_shards_written_whole(tmp_path):
    from huggingface_hub import save_torch_state_dict

    folder = tmp_path / "set"
    folder.mkdir()
    save_torch_state_dict(_grads(), folder, max_shard_size=200)
    before = _digests(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    contents = open_checkpoint(folder)
    gradients = contents.gradients
    back = write_back(contents)
    expected = tuple(
        FileWrite(folder / shard, "safetensors",
                  tuple(n for n in contents.gradients if index["weight_map"][n] == shard))
        for shard in shards)
    assert back == WriteBack(WriteBackPlan(folder, expected))
    assert sorted(n for f in back.plan.files for n in f.tensors) == sorted(_grads())
    assert contents.gradients is gradients
    assert _digests(folder) == before


def test_a_dcp_folder_is_its_chunks_bytes_written_over(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    folder = tmp_path / "dcp"
    grads = _grads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"grads": grads, "step": 3}, storage_writer=FileSystemWriter(folder))
    before = _digests(folder)
    contents = open_checkpoint(folder)
    gradients = contents.gradients
    back = write_back(contents)
    plan = back.plan
    assert plan.folder == folder and plan.tensor_count == len(grads)
    # DCP's own record of where each tensor's blob lies
    blobs = {index.fqn: info for index, info in
             FileSystemReader(folder).read_metadata().storage_data.items()}
    files = {folder / blobs[f"grads.{n}"].relative_path for n in grads}
    assert [f.path for f in plan.files] == sorted(files)
    for file in plan.files:
        assert file.format is None and file.copies == ()
        assert file.tensors == tuple(s.tensor for s in file.storages)
        data = file.path.read_bytes()
        for storage in file.storages:
            blob = blobs[f"grads.{storage.tensor}"]
            assert folder / blob.relative_path == file.path
            assert blob.offset <= storage.data_start
            assert storage.data_start + storage.nbytes <= blob.offset + blob.length
            stored = data[storage.data_start:storage.data_start + storage.nbytes]
            original = grads[storage.tensor]
            assert storage.nbytes == original.numel() * original.element_size()
            assert stored == original.contiguous().view(torch.uint8).numpy().tobytes()
            for at in storage.crc_positions:
                assert data[at:at + 4] == struct.pack("<L", zlib.crc32(stored))
    assert sorted(s.tensor for f in plan.files for s in f.storages) == sorted(grads)
    # the held gradients are the chunks themselves; nothing of contents changed
    assert {n: torch.equal(t.held, grads[n]) for n, t in back.gradients.items()} == \
        {n: True for n in grads}
    assert contents.gradients is gradients and all(t.held is None for t in gradients.values())
    assert _digests(folder) == before


def test_chunks_of_one_tensor_are_named_by_their_offsets(dcp_checkpoint):
    """FSDP2 on two ranks: a gradient in two chunks is two held gradients, counted once."""
    from torch.distributed.checkpoint import FileSystemReader

    contents = open_checkpoint(dcp_checkpoint)
    back = write_back(contents)
    meta = FileSystemReader(dcp_checkpoint).read_metadata()
    expected = []
    for fqn, entry in meta.state_dict_metadata.items():
        if fqn.startswith("grads.") and hasattr(entry, "chunks"):  # a tensor, not bytes
            name = fqn.removeprefix("grads.")
            expected += [name if len(entry.chunks) == 1 else
                         f"{name}[{','.join(map(str, c.offsets))}]" for c in entry.chunks]
    assert sorted(back.gradients) == sorted(expected)
    assert sorted(s.tensor for f in back.plan.files for s in f.storages) == sorted(expected)
    assert back.plan.tensor_count == len(contents.gradients) < len(expected)
