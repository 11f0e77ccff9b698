"""Releasing mapped pages never changes what a tensor holds, and never touches
memory that is not mapped from the checkpoint's file."""

from __future__ import annotations

import sys

import pytest
import torch

from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files.pages import PageReleaser

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only")


def resident_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@linux
def test_released_tensors_read_back_unchanged(tmp_path):
    g = torch.Generator().manual_seed(0)
    grads = {f"l.{i}": torch.randn(256, 1024, generator=g) for i in range(8)}
    path = tmp_path / "g.pt"
    torch.save(grads, path)
    ckpt = load_checkpoint(path)
    releaser = PageReleaser(path)
    assert releaser._ranges, "the zip checkpoint should be mapped from its file"
    tensors = list(ckpt.root.values())
    sums = [float(t.double().sum()) for t in tensors]  # touch every page
    before = resident_kb()
    releaser.release(tensors)
    assert resident_kb() < before - 4 * 1024  # about 8 MiB went back
    for t, s, (name, want) in zip(tensors, sums, grads.items()):
        assert torch.equal(t, want), name
        assert float(t.double().sum()) == s


@linux
def test_memory_not_mapped_from_the_file_is_left_alone(tmp_path):
    path = tmp_path / "g.pt"
    torch.save({"w": torch.ones(1 << 20)}, path)
    load_checkpoint(path)
    anonymous = torch.full((1 << 20,), 7.0)  # heap memory: DONTNEED would zero it
    PageReleaser(path).release([anonymous])
    assert bool((anonymous == 7.0).all())


def test_legacy_files_are_not_mapped(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.full((1 << 18,), 3.0)}, path, _use_new_zipfile_serialization=False)
    ckpt = load_checkpoint(path)
    PageReleaser(path).release(list(ckpt.root.values()))
    assert bool((ckpt.root["w"] == 3.0).all())


@linux
def test_the_readers_own_mapping_is_known_without_proc_maps_while_it_lives(tmp_path,
                                                                          monkeypatch):
    import gc

    from gradclip_cli.source.files import pages

    path = tmp_path / "g.pt"
    torch.save({"w": torch.full((1 << 20,), 5.0)}, path)
    ckpt = load_checkpoint(path)

    def no_proc(_path):
        raise AssertionError("read /proc/self/maps for a mapping gradclip made itself")

    monkeypatch.setattr(pages, "_file_mappings", no_proc)
    w = ckpt.root["w"]
    releaser = PageReleaser(path)
    [(lo, hi)] = releaser._ranges
    assert lo <= w.data_ptr() and w.data_ptr() + w.nbytes <= hi
    releaser.release([w])
    assert bool((w == 5.0).all())
    # Once the checkpoint's tensors are gone the mapping is gone: its range is
    # forgotten, and heap memory that may reuse the addresses is left alone.
    del ckpt, w
    gc.collect()
    assert pages._registered(path) == []
    monkeypatch.setattr(pages, "_file_mappings", lambda _path: [])
    anonymous = torch.full((1 << 20,), 7.0)
    PageReleaser(path).release([anonymous])
    assert bool((anonymous == 7.0).all())
