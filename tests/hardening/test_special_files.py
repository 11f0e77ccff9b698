"""Paths that are not plain files, as input, as ``-o`` and as ``--output-file``.

An input that is not a regular file (or a folder a layout claims) is refused
with exit 3 and one line, without ever being opened: a FIFO would block
forever, a device gives endless or no bytes. An output path that exists and
is not a regular file is exit 3 and stays exactly what it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import torch

from .support import assert_refused, run_cli


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.full((4, 4), 0.5), "b": torch.ones(3)}, "step": 1}, path)
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FifoWatch:
    """A FIFO whose writer notes whether anyone ever opened it for reading.

    Opening a FIFO for writing blocks until a reader opens it, so ``opened``
    is set before any reader could receive a byte: after gradclip returns,
    ``opened`` False proves gradclip never opened the FIFO. The writer serves
    every open until closed, so a gradclip that does open it (and opens it
    again) gets bytes and an end of file each time, and the test cannot hang.
    """

    def __init__(self, path: Path, data: bytes = b"not a checkpoint\n"):
        os.mkfifo(path)
        self.path = path
        self.opened = False
        self._data = data
        self._closing = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            with open(self.path, "wb") as fifo:  # returns once a reader has opened it
                if self._closing:
                    return
                self.opened = True
                try:
                    fifo.write(self._data)
                except BrokenPipeError:
                    pass

    def close(self) -> None:
        self._closing = True
        # Release the writer's pending open with a reader of our own.
        descriptor = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._thread.join()
        os.close(descriptor)


@pytest.mark.parametrize("command", [["inspect"], ["clip", "--max-norm", "1"],
                                     ["inspect", "--verify"]])
def test_fifo_input_is_refused_without_opening_it(tmp_path, command):
    fifo = FifoWatch(tmp_path / "grads.pt")
    try:
        result = run_cli(command[0], fifo.path, *command[1:], "-q")
        opened = fifo.opened
    finally:
        fifo.close()
    assert_refused(result, fifo.path, "FIFO")
    assert not opened, "gradclip opened the FIFO"
    assert stat.S_ISFIFO(os.lstat(fifo.path).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["grads.pt"]  # no clipped copy


def test_dev_stdin_from_a_pipe_is_refused_as_a_pipe(ckpt):
    """``cat g.pt | gradclip inspect /dev/stdin``: a pipe is not a file (it cannot be
    mapped or read twice); today it gives a misleading "corrupt zip" line."""
    reader, writer = os.pipe()
    try:
        data = ckpt.read_bytes()
        assert len(data) < 16384  # fits in the pipe's buffer: no writer thread needed
        os.write(writer, data)
        os.close(writer)
        path = f"/dev/fd/{reader}"
        result = run_cli("inspect", path, "-q", "--format", "json")
    finally:
        os.close(reader)
    assert result.code == 3
    assert len(result.err_lines) == 1 and path in result.err_lines[0]
    assert "FIFO" in result.err_lines[0] and "zip" not in result.err_lines[0]
    assert json.loads(result.out)["schema"] == "gradclip.error/1"


def test_dev_stdin_from_a_file_is_read(ckpt):
    """``gradclip inspect /dev/stdin < g.pt`` names a regular file: that works."""
    with open(ckpt, "rb") as file:
        result = run_cli("inspect", f"/dev/fd/{file.fileno()}", "-q", "--format", "json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["num_tensors"] == 2


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
@pytest.mark.parametrize("command", [["inspect"], ["clip", "--max-norm", "1"]])
def test_character_device_input_is_refused(device, command):
    result = run_cli(command[0], device, *command[1:], "-q")
    assert_refused(result, Path(device), "character device")


def test_socket_input_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a socket's path must be short (108 bytes)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind("g.sock")
        result = run_cli("inspect", "g.sock", "-q")
    finally:
        server.close()
    assert_refused(result, Path("g.sock"), "socket")


def test_symlink_loop_and_dangling_symlink_are_refused(tmp_path):
    (tmp_path / "a.pt").symlink_to("b.pt")
    (tmp_path / "b.pt").symlink_to("a.pt")
    (tmp_path / "gone.pt").symlink_to("nowhere.pt")
    assert_refused(run_cli("inspect", tmp_path / "a.pt", "-q"), tmp_path / "a.pt", "loop")
    assert_refused(run_cli("inspect", tmp_path / "gone.pt", "-q"), tmp_path / "gone.pt",
                   "dangling")


def test_folder_input_keeps_its_message(tmp_path):
    (tmp_path / "ckpt.pt").mkdir()
    assert_refused(run_cli("inspect", tmp_path / "ckpt.pt", "-q"), tmp_path / "ckpt.pt",
                   "directory")


def test_symlink_to_a_regular_file_is_read(ckpt):
    link = ckpt.with_name("link.pt")
    link.symlink_to(ckpt.name)
    assert run_cli("inspect", link, "-q").code == 0


def test_unreadable_input_is_exit_3(ckpt):
    ckpt.chmod(0)
    try:
        if os.access(ckpt, os.R_OK):
            pytest.skip("running as root: a mode of 000 does not stop reading")
        for command in (["inspect"], ["clip", "--max-norm", "1"], ["inspect", "--verify"]):
            assert_refused(run_cli(command[0], ckpt, *command[1:], "-q"), ckpt,
                           "permission denied")
    finally:
        ckpt.chmod(0o644)


def test_refused_open_is_exit_3_even_as_root(ckpt, monkeypatch):
    """What an unreadable file does for a user who is not root, simulated."""

    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr("gradclip_cli.source.os.open", refuse)
    assert_refused(run_cli("inspect", ckpt, "-q"), ckpt, "permission denied")


# --- outputs ---------------------------------------------------------------


def _make_char_device(path: Path) -> None:
    """A node with /dev/null's numbers, so no test ever points at the real one."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError) as error:
        pytest.skip(f"cannot create a device node here: {error}")


@pytest.fixture
def no_replace(monkeypatch):
    """Records any os.replace, and stops it: a regression must not reach the target."""
    calls = []

    def guard(source, target, *args, **kwargs):
        calls.append(target)
        raise OSError(errno.EPERM, "blocked by the test")

    monkeypatch.setattr(os, "replace", guard)
    return calls


@pytest.mark.parametrize("kind", ["fifo", "char-device", "directory", "socket"])
@pytest.mark.parametrize("flag", ["-o", "--output-file", "-o-via-symlink"])
def test_output_that_is_not_a_regular_file_is_refused_and_untouched(
    tmp_path, ckpt, monkeypatch, kind, flag
):
    monkeypatch.chdir(tmp_path)
    target = Path("out")
    sockets = []
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "char-device":
        _make_char_device(target)
    elif kind == "directory":
        target.mkdir()
        (target / "keep").write_bytes(b"k")
    else:
        sockets.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        sockets[0].bind(str(target))
    before = os.lstat(target)
    given = target
    if flag == "-o-via-symlink":
        # A symlink to it: clip writes through a link to the file it names.
        Path("link").symlink_to(target)
        given, flag = Path("link"), "-o"
    input_sha = _sha(ckpt)
    try:
        for extra in ([], ["--format", "json"]):
            result = run_cli("clip", ckpt, "--max-norm", "1", flag, given, "-q", *extra)
            assert result.code == 3, (result.code, result.err)
            assert len(result.err_lines) == 1, result.err
            line = result.err_lines[0]
            assert "not a regular file" in line and "nothing was changed" in line, line
            if extra:
                doc = json.loads(result.out)
                assert doc["schema"] == "gradclip.error/1" and doc["exit_code"] == 3
        if flag == "--output-file":
            result = run_cli("inspect", ckpt, "--output-file", given, "-q")
            assert result.code == 3 and len(result.err_lines) == 1, result.err
    finally:
        for server in sockets:
            server.close()
    after = os.lstat(target)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (
        before.st_mode, before.st_ino, before.st_rdev
    )
    if kind == "directory":
        assert os.listdir(target) == ["keep"]
    assert _sha(ckpt) == input_sha
    # Nothing else was written: no clipped copy, no temporary file.
    assert sorted(os.listdir(tmp_path)) == sorted({"g.pt", "out", *(
        ["link"] if given.name == "link" else [])})


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
def test_system_devices_as_output_are_never_replaced(ckpt, no_replace, device):
    before = os.stat(device)
    for flag in ("-o", "--output-file"):
        result = run_cli("clip", ckpt, "--max-norm", "1", flag, device, "-q")
        assert result.code == 3, result.err
        assert len(result.err_lines) == 1 and device in result.err_lines[0]
        assert "character device" in result.err_lines[0]
    assert no_replace == [], "gradclip tried to replace a device"
    after = os.stat(device)
    assert (after.st_ino, after.st_rdev, stat.S_ISCHR(after.st_mode)) == (
        before.st_ino, before.st_rdev, True
    )
    assert sorted(os.listdir(ckpt.parent)) == ["g.pt"]
