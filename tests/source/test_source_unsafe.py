"""Malicious pickles are refused and their payload never runs."""

from __future__ import annotations

import builtins
import os
import pickle
from pathlib import Path

import pytest
import torch

from gradclip_cli.errors import UnsafeCheckpointError
from gradclip_cli.source import load_checkpoint


class SystemPayload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class ExecPayload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _bare_pickle(payload, path: Path, protocol: int) -> None:
    path.write_bytes(pickle.dumps({"grads": payload}, protocol=protocol))


def _torch_zip(payload, path: Path, protocol: int) -> None:
    torch.save({"grads": payload}, path)


def _torch_legacy(payload, path: Path, protocol: int) -> None:
    torch.save({"grads": payload}, path, _use_new_zipfile_serialization=False)


def _text_protocol(payload, path: Path, protocol: int) -> None:
    # The classic hand-written exploit: GLOBAL os.system, REDUCE.
    path.write_bytes(f"cos\nsystem\n(S'touch {payload.marker}'\ntR.".encode())


@pytest.mark.parametrize("payload_type", [SystemPayload, ExecPayload])
@pytest.mark.parametrize(
    "write, protocol",
    [
        (_bare_pickle, 2),
        (_bare_pickle, 4),
        (_bare_pickle, 5),
        (_torch_zip, 2),
        (_torch_legacy, 2),
        (_text_protocol, 0),
    ],
)
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, payload_type, write, protocol):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    write(payload_type(marker), path, protocol)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_checkpoint(path)
    assert not marker.exists(), "the payload ran"
    message = str(refused.value)
    assert message.startswith(str(path)) and "--trust-pickle" in message
    assert "\n" not in message
    assert refused.value.exit_code == 3


def test_verify_does_not_run_the_payload_either(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    torch.save({"grads": SystemPayload(marker)}, path)
    with pytest.raises(UnsafeCheckpointError):
        load_checkpoint(path, verify=True)
    assert not marker.exists()
