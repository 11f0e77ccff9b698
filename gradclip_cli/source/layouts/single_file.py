"""One checkpoint file: the file readers, plus what the file's content says it is.

A plain file gives its gradients (the ``--key`` rule of ``source/locate.py``)
and, when it holds them next to the gradients, the model's weights and the
optimizer's state (``fill_from_root``, which a framework's own file, such as a
Lightning ``.ckpt``, uses too). A file that an index beside it lists as one of its shards is
opened alone, and the report says that it covers that shard only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import select_gradients
from gradclip_cli.source.interface import Checkpoint, Contents, stored

from .keys import OPTIMIZER_KEYS, WEIGHT_KEYS
from .paths import read_json
from .torch_optim import is_optimizer_state, optimizer_state


def contents_of(ckpt: Checkpoint, *, key: str | None) -> Contents:
    """A loaded file that is no framework's own (``layouts.open_file`` asks them first)."""
    path = ckpt.path
    contents = Contents(path=path, kind=ckpt.format, files=[path], checkpoint=ckpt,
                        trusted_pickle=ckpt.trusted_pickle)
    fill_from_root(contents, ckpt.root, path, key)
    index = _index_listing(path)
    if index is not None:
        contents.description.append(
            f"covers shard {visible(path.name)} only; the whole checkpoint is indexed by "
            f"{visible(index.name)}")
        contents.index = index
    return contents


def fill_from_root(contents: Contents, root: Any, path: Path, key: str | None) -> None:
    """Gradients, weights and optimizer state of a loaded file's ``root``, where it holds them."""
    try:
        selection = select_gradients(root, key, path=path)
    except InputError as error:
        if key is not None:
            raise
        contents.gradient_error = str(error)
    else:
        contents.gradients = stored(selection.tensors, path)
        contents.gradient_key = selection.key
        contents.skipped = list(selection.skipped)
    if not isinstance(root, Mapping):
        return
    for name in WEIGHT_KEYS:
        weights = root.get(name)
        if isinstance(weights, Mapping) and weights and all(
                isinstance(v, torch.Tensor) for v in weights.values()):
            contents.weights = stored({str(k): v for k, v in weights.items()}, path)
            break
    for name in OPTIMIZER_KEYS:
        if is_optimizer_state(root.get(name)):
            contents.optimizers.append(optimizer_state(root[name], path, repr(name)))
            break
    step = root.get("step", root.get("global_step"))
    if isinstance(step, int) and not isinstance(step, bool):
        contents.step = step


def _index_listing(path: Path) -> Path | None:
    """An index beside ``path`` whose ``weight_map`` lists this file, if there is one."""
    folder = path.parent
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".index.json")]
    except OSError:
        return None
    for name in sorted(names):
        candidate = folder / name
        try:
            index = read_json(candidate, what="an index", folder=folder)
        except InputError:
            continue
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if isinstance(weight_map, dict) and path.name in weight_map.values():
            return candidate
    return None
