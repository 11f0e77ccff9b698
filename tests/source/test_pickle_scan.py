"""``files/pickle_scan``: one top-level integer of a torch file, read from its opcodes alone.

The files are written by ``torch.save`` itself, with objects the weights-only
unpickler refuses beside the integer (numpy's RNG state, as OLMo-core's
``train/rank0.pt`` holds, and a payload that would run a command).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.pickle_scan import top_level_int


class _Runs:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_beside_numpy_state_and_a_payload(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "rank0.pt"
    torch.save(
        {
            "data_loader": {"global_step": 9},
            "rng": {"numpy": np.random.get_state()},
            "payload": _Runs(marker),
            "global_step": 123456789012,
            "epoch": 2,
        },
        path,
    )
    assert top_level_int(path, "global_step") == 123456789012
    assert top_level_int(path, "epoch") == 2
    assert not marker.exists()


@pytest.mark.parametrize(
    "root",
    [
        {"nested": {"global_step": 9}},
        {"global_step": "9"},
        {"global_step": 2.0},
        {"global_step": True},
        [1, 2],
    ],
)
def test_absent_or_not_an_int_at_the_top(tmp_path, root):
    path = tmp_path / "state.pt"
    torch.save(root, path)
    assert top_level_int(path, "global_step") is None


def test_memoised_key(tmp_path):
    # The second dict reuses the key string through the memo (BINGET).
    path = tmp_path / "state.pt"
    torch.save({"a": {"global_step": 1}, "global_step": 5}, path)
    assert top_level_int(path, "global_step") == 5


@pytest.mark.parametrize("damage", ["truncated", "not a zip"])
def test_damaged_file_is_an_input_error(tmp_path, damage):
    path = tmp_path / "state.pt"
    torch.save({"global_step": 5, "w": torch.ones(4)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"garbage" * 10)
    with pytest.raises(InputError, match="state.pt"):
        top_level_int(path, "global_step")
