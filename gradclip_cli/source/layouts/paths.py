"""Names read from a checkpoint's own files, turned into paths that stay inside its folder.

An index's ``weight_map`` or a DCP storage path is data written by whoever made
the checkpoint. Opening it as given would let ``../../etc/passwd``, an
absolute path or a symlink read files the user never pointed gradclip at, so
every such name goes through ``inside`` first.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.json_text import parse_json
from gradclip_cli.source.files.small_file import (
    check_inside,
    excerpt,
    read_head,
    read_small_file,
)

# An index or trainer_state.json larger than this is not one (a 70B model's
# index is about 100 KB): refuse it before parsing rather than read gigabytes.
MAX_JSON_BYTES = 64 << 20


def inside(folder: Path, name: object, *, named_by: Path) -> Path:
    """The file ``name`` (relative, '/'-separated) in ``folder``; ``InputError`` if it leaves.

    Refused: non-strings, empty names, absolute paths, ``..`` parts, and
    names whose resolved path (symlinks followed) lies outside the folder's
    resolved path. ``named_by`` is the file that gave the name, for the message.
    """
    # Control characters have no place in a shard's name, and would break the
    # one-line message that names the file.
    if not isinstance(name, str) or not name or not name.isprintable():
        shown = excerpt(name) if isinstance(name, str) else f"a {type(name).__name__}"
        raise InputError(f"{named_by}: names a file {shown}, not a relative path")
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or os.path.isabs(name) or ".." in parts or "\\" in name:
        raise InputError(
            f"{named_by}: names {excerpt(name)}, outside its folder; refused")
    candidate = folder.joinpath(*parts)
    real_folder = Path(os.path.realpath(folder))
    real = Path(os.path.realpath(candidate))
    if real != real_folder and real_folder not in real.parents:
        raise InputError(
            f"{named_by}: {excerpt(name)} leads outside its folder "
            f"(to {real}); refused")
    return candidate


# A tag file (DeepSpeed's ``latest``, ``latest_universal``) names one folder.
MAX_TAG_BYTES = 4096


def tagged_folder(parent: Path, name: str) -> tuple[str, Path]:
    """The tag that ``parent/name`` holds (a folder's name: data, checked as any name
    is, ``inside``) and the path it names in ``parent``."""
    file = parent / name
    raw = read_small_file(file, limit=MAX_TAG_BYTES, what="a checkpoint tag", folder=parent)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InputError(f"{file}: not a checkpoint tag: not UTF-8 text") from None
    return tag, inside(parent, tag, named_by=file)


def read_json(path: Path, *, what: str, folder: Path | None = None) -> Any:
    """Parse a small JSON file (``files.small_file``'s rule: a regular file, bounded, its
    real path inside ``folder`` when given); ``InputError`` naming it when it is missing,
    huge, special or not JSON (``files.json_text``)."""
    raw = read_small_file(path, limit=MAX_JSON_BYTES, what=what, folder=folder)
    return parse_json(raw, where=str(path), what=what)


def member(folder: Path, name: str) -> Path:
    """``folder/name``, a file a layout opens by its fixed name (``optimizer.pt``,
    ``meta.pt``): ``InputError`` when its real path leaves the folder."""
    path = folder / name
    check_inside(path, folder, what=name)
    return path


def json_head_keys(path: Path, limit: int = 4096) -> str:
    """The file's first bytes as text (for cheap recognition), or '' when unreadable or
    not a regular file (a FIFO is never opened)."""
    try:
        return read_head(path, limit).decode("utf-8", errors="replace")
    except InputError:
        return ""
