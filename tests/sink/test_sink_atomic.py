"""atomic_write: the target is whole-old or whole-new, never half, and no litter is left."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from gradclip_cli.errors import OutputError
from gradclip_cli.sink.atomic import atomic_write


def write_bytes(data: bytes):
    return lambda file: file.write(data)


def test_creates_the_target_and_nothing_else(tmp_path):
    target = tmp_path / "out.pt"
    atomic_write(target, write_bytes(b"new"))
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["out.pt"]


def test_replaces_with_a_new_file_never_rewriting_the_old_one(tmp_path):
    target = tmp_path / "out.pt"
    target.write_bytes(b"old")
    old_inode = target.stat().st_ino
    with open(target, "rb") as still_open:
        atomic_write(target, write_bytes(b"new"))
        assert still_open.read() == b"old"  # readers of the old file are undisturbed
    assert target.read_bytes() == b"new"
    assert target.stat().st_ino != old_inode


class Boom(Exception):
    pass


def _fail_midway(exception: BaseException):
    def write(file):
        file.write(b"half of it")
        raise exception

    return write


@pytest.mark.parametrize(
    "exception, words",
    [
        (Boom("serializer broke"), "serializer broke"),
        (KeyboardInterrupt(), "interrupted"),
        (OSError(errno.ENOSPC, "No space left on device"), "no space left"),
        (OSError(errno.EROFS, "Read-only file system"), "read-only"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "quota"),
    ],
    ids=["error", "interrupt", "disk-full", "read-only", "quota"],
)
@pytest.mark.parametrize("target_exists", [False, True])
def test_failure_leaves_target_untouched_and_no_temp_file(
    tmp_path, exception, words, target_exists
):
    target = tmp_path / "out.pt"
    if target_exists:
        target.write_bytes(b"original")
    with pytest.raises(OutputError) as caught:
        atomic_write(target, _fail_midway(exception))
    message = str(caught.value)
    assert message.startswith(f"{target}: ") and words in message and "\n" not in message
    assert caught.value.exit_code == 3
    if target_exists:
        assert target.read_bytes() == b"original"
        assert os.listdir(tmp_path) == ["out.pt"]
    else:
        assert os.listdir(tmp_path) == []


def test_system_exit_is_cleaned_up_but_passed_through(tmp_path):
    with pytest.raises(SystemExit):
        atomic_write(tmp_path / "out.pt", _fail_midway(SystemExit(2)))
    assert os.listdir(tmp_path) == []


def test_missing_folder_is_an_output_error(tmp_path):
    target = tmp_path / "no" / "such" / "out.pt"
    with pytest.raises(OutputError, match="does not exist") as caught:
        atomic_write(target, write_bytes(b"x"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "no").exists()


def test_target_that_is_a_directory_is_an_output_error(tmp_path):
    target = tmp_path / "out.pt"
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    with pytest.raises(OutputError, match="directory"):
        atomic_write(target, write_bytes(b"x"))
    assert (target / "keep").read_bytes() == b"k"
    assert os.listdir(tmp_path) == ["out.pt"]


def test_folder_that_refuses_new_files_is_an_output_error(tmp_path, monkeypatch):
    # We run as root, so a read-only folder would not stop us; simulate it.
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    with pytest.raises(OutputError, match="permission denied"):
        atomic_write(tmp_path / "out.pt", write_bytes(b"x"))
    assert os.listdir(tmp_path) == []


def test_failed_rename_removes_the_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "out.pt"
    target.write_bytes(b"original")

    def refuse(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr("os.replace", refuse)
    with pytest.raises(OutputError):
        atomic_write(target, write_bytes(b"new"))
    assert target.read_bytes() == b"original" and os.listdir(tmp_path) == ["out.pt"]


def test_mode_is_copied_from_mode_from(tmp_path):
    source = tmp_path / "in.pt"
    source.write_bytes(b"in")
    os.chmod(source, 0o640)
    target = tmp_path / "out.pt"
    atomic_write(target, write_bytes(b"x"), mode_from=source)
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_existing_target_keeps_its_mode_without_mode_from(tmp_path):
    target = tmp_path / "out.pt"
    target.write_bytes(b"old")
    os.chmod(target, 0o604)
    atomic_write(target, write_bytes(b"new"))
    assert stat.S_IMODE(target.stat().st_mode) == 0o604


def test_new_target_gets_the_umask_default_not_the_temp_files_0600(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "out.pt", write_bytes(b"x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.pt").stat().st_mode) == 0o640
