"""Before ``clip`` scales gradients in place: every other entry that shares storage with one
gets its own copy, so the file written back keeps that entry's values."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gradclip_cli.source.interface import Checkpoint
from gradclip_cli.source.locate import at_key


def unshare_other_entries(ckpt: Checkpoint | None, key: str,
                          gradients: list[torch.Tensor]) -> list[str]:
    """Give every tensor of ``ckpt`` outside the gradient mapping (at ``key``) that shares
    storage with one of the held ``gradients`` its own copy.

    ``torch.save`` keeps shared storages shared, so an EMA buffer that is a
    view of ``grads.w`` would otherwise be scaled along with it. The walk
    covers nested dicts, lists and tuples outside the gradient mapping
    (iteratively: depth is the file's to choose; each container once, so a
    container that holds itself ends the walk). A tuple cannot change, so one
    holding such a tensor is rebuilt in its place. The gradient mapping's own
    containers are never entered, even where the file names them again
    elsewhere (one dict under two keys): a copy there would take the place of
    the gradient that is clipped. The names of copied entries are returned
    for the report.
    """
    if ckpt is None:
        return []  # a set of files: each shard holds gradients only where it is written
    storages = {_storage_key(t) for t in gradients if t.layout == torch.strided}
    storages.discard(None)
    if not storages:
        return []
    root = ckpt.root
    seen = _containers(at_key(root, key) if key else root)
    copies: dict[int, torch.Tensor] = {}  # id of a shared tensor -> its copy
    rebuilt: dict[int, tuple] = {}  # id of a tuple -> the one that replaces it
    copied: list[str] = []
    stack: list[tuple[tuple[str, ...], object, bool]] = [((), root, False)]
    while stack:
        path, node, children_done = stack.pop()
        if not children_done:
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((path, node, True))
            stack.extend(((*path, str(name)), child, False) for name, child in _entries(node)
                         if _entries(child) is not None)
            continue
        replaced = []
        for name, child in _entries(node):
            new = rebuilt.get(id(child), child)
            if isinstance(child, torch.Tensor) and child.layout == torch.strided \
                    and _storage_key(child) in storages:
                new = copies.setdefault(id(child), child.detach().clone())
                copied.append(".".join((*path, str(name))))
            replaced.append(new)
            if new is not child and not isinstance(node, tuple):
                node[name] = new
        if isinstance(node, tuple) and any(a is not b for a, b in zip(replaced, node)):
            rebuilt[id(node)] = tuple(replaced)
    if id(root) in rebuilt:
        ckpt.root = rebuilt[id(root)]
    return sorted(copied)


def _entries(node) -> list | None:
    """A container's ``(name, child)`` pairs (a tuple's exactly, not ``torch.Size``'s or
    another subclass's); None for anything else."""
    if isinstance(node, Mapping):
        return list(node.items())
    if isinstance(node, list) or type(node) is tuple:
        return list(enumerate(node))
    return None


def _containers(node) -> set[int]:
    """The ids of ``node`` and every container inside it."""
    found: set[int] = set()
    stack = [node]
    while stack:
        node = stack.pop()
        entries = _entries(node)
        if entries is None or id(node) in found:
            continue
        found.add(id(node))
        stack.extend(child for _, child in entries)
    return found


def _storage_key(t: torch.Tensor):
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr())
