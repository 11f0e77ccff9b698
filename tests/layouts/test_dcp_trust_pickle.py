"""``--trust-pickle`` opens DCP metadata that names classes outside DCP's own records.

The folder is written by ``dcp.save`` (one process, no group); its
``.metadata`` is then rewritten with torch's own classes plus an object
whose unpickling runs a command, so that the refusal (exit 3, naming the
file and ``--trust-pickle``, nothing run) and the trusted read (the same
numbers, the warning, the command run as asked) are both what a user sees.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch


class _Runs:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def folder(tmp_path) -> Path:
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {
        "grads": {"a.weight": torch.randn(6, 4, generator=g), "b.bias": torch.randn(5, generator=g)}
    }
    out = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=out, no_dist=True)
    return out


def _arm(folder: Path, marker: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(folder).read_metadata()
    meta.storage_meta = _Runs(marker)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def test_refused_then_opened_with_trust_pickle(gradclip, folder, tmp_path):
    plain = gradclip("inspect", folder, "--format", "json")
    assert plain.code == 0, plain.err
    marker = tmp_path / "ran"
    _arm(folder, marker)
    refused = gradclip("inspect", folder)
    assert refused.code == 3 and len(refused.err_lines) == 1, refused.err
    assert ".metadata" in refused.err and "--trust-pickle" in refused.err
    assert "os.system" in refused.err or "posix.system" in refused.err
    assert not marker.exists()
    trusted = gradclip("inspect", folder, "--format", "json", "--trust-pickle")
    assert trusted.code == 0, trusted.err
    assert marker.exists()  # full unpickling, as asked
    assert "loaded with --trust-pickle" in trusted.err
    assert trusted.json()["total_norm"] == plain.json()["total_norm"]


def test_trusted_metadata_is_still_checked(gradclip, folder, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(folder).read_metadata()
    meta.storage_meta = _Runs(tmp_path / "ran")
    for info in meta.storage_data.values():
        info.relative_path = "../outside.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    result = gradclip("inspect", folder, "--trust-pickle")
    assert result.code == 3, result.err
    assert "outside its folder" in result.err
