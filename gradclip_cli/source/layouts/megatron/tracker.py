"""Which folders are Megatron's iterations (``is_dist_ckpt``, ``is_legacy``), and the tracker,
``latest_checkpointed_iteration.txt``, that names the newest (its number, or ``release``).
A layout built on Megatron's ``torch_dist`` folders (NeMo 2's ``weights/``) uses
``is_dist_ckpt`` on its own folder and comes before ``megatron`` in ``LAYOUTS``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.dcp_metadata import METADATA_NAME
from gradclip_cli.source.files.small_file import excerpt, read_small_file

from ..paths import inside, json_head_keys

TRACKER = "latest_checkpointed_iteration.txt"
COMMON, JSON = "common.pt", "metadata.json"  # a torch_dist iteration's own files
FILE = "model_optim_rng.pt"  # a legacy rank's file, in its mp_rank_XX/
DISTRIBUTED = "distrib_optim.pt"  # beside it, the distributed optimizer's state
RANK = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){1,2})?")


def is_dist_ckpt(path: Path) -> bool:
    """A ``torch_dist`` iteration folder (cheap: names and ``metadata.json``'s keys)."""
    return (
        os.path.isfile(path / COMMON)
        and os.path.isfile(path / METADATA_NAME)
        and "sharded_backend" in json_head_keys(path / JSON)
    )


def is_legacy(path: Path) -> bool:
    """A folder of ``mp_rank_XX/model_optim_rng.pt`` (cheap: names only)."""
    try:
        return any(RANK.fullmatch(n) and os.path.isfile(path / n / FILE) for n in os.listdir(path))
    except OSError:
        return False


def iteration_folder(path: Path) -> tuple[Path, Path | None]:
    """The iteration folder: ``path`` itself, or the one its tracker names (inside it)."""
    tracker = path / TRACKER
    if not os.path.isfile(tracker):
        return path, None
    text = (
        read_small_file(tracker, limit=64, what="Megatron's tracker file", folder=path)
        .decode("utf-8", errors="replace")
        .strip()
    )
    if text == "release":
        name = "release"
    elif text.isdigit():
        name = f"iter_{int(text):07d}"
    else:
        raise InputError(f"{tracker}: names {excerpt(text)}, not an iteration number or 'release'")
    folder = inside(path, name, named_by=tracker)
    if not os.path.isdir(folder) or not (is_dist_ckpt(folder) or is_legacy(folder)):
        raise InputError(
            f"{tracker}: names iteration {text}, but {name}/ is not a Megatron (torch_dist or "
            "legacy) checkpoint folder inside it"
        )
    return folder, tracker
