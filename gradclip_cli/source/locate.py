"""Finding the gradient mapping inside a loaded checkpoint (the contract's ``--key`` rule).

With a key: follow the dotted path through nested mappings. Without: a single
top-level mapping named ``grads``, ``gradients`` or ``grad``; else the whole
file when it is a flat mapping of name -> tensor; else an error listing the
candidate keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.interface import GradientSelection

GRADIENT_KEYS = ("grads", "gradients", "grad")
_MAX_CANDIDATES = 8
_MAX_DEPTH = 6  # how deep to look for candidate keys in an error message


def select_gradients(
    root: Any, key: str | None, *, path: Path | str | None = None
) -> GradientSelection:
    """Return the gradient tensors of ``root``, chosen by ``key`` or by the default rule.

    Nested mappings (and lists) inside the chosen mapping are flattened with
    dotted names; entries that are not floating-point tensors are listed in
    ``skipped``. ``path``, when given, names the file in error messages.
    """
    where = f"{path}: " if path is not None else ""
    if key is not None:
        key_path = _follow(root, key, where)
    else:
        key_path = _default_key_path(root, where)
    mapping = _at(root, key_path)
    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    seen: set[str] = set()
    for name, value in _leaves(mapping, ()):
        if name in seen:
            # {"a.b": x, "a": {"b": y}} flattens to one name twice; never merge silently.
            raise InputError(f"{where}two gradient entries flatten to the same name {name!r}")
        seen.add(name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            tensors[name] = value
        else:
            skipped.append(name)
    if not tensors:
        under = f"under {'.'.join(key_path)!r}" if key_path else "in the file"
        raise InputError(
            f"{where}no floating-point gradients found {under} "
            f"({len(skipped)} entries, none a floating-point tensor)"
        )
    return GradientSelection(key_path=key_path, tensors=tensors, skipped=skipped)


def _follow(root: Any, key: str, where: str) -> tuple[str, ...]:
    """Resolve a dotted key; a part may itself contain dots (``"model.grads"`` as one key)."""
    parts = [part for part in key.split(".") if part]
    if not parts:
        raise InputError(f"{where}--key {key!r} is empty")
    node, key_path = root, ()
    while parts:
        # Prefer the longest run of parts that names one entry.
        for take in range(len(parts), 0, -1):
            name = ".".join(parts[:take])
            match = _lookup(node, name)
            if match is not None:
                node, key_path, parts = match[1], (*key_path, match[0]), parts[take:]
                break
        else:
            found = ".".join(key_path) or "the top level"
            raise InputError(
                f"{where}--key {key!r}: no entry {parts[0]!r} at {found}; "
                f"candidates: {_candidate_text(root)}"
            )
    if not isinstance(node, Mapping):
        raise InputError(
            f"{where}--key {key!r} leads to a {type(node).__name__}, not a mapping of gradients; "
            f"candidates: {_candidate_text(root)}"
        )
    return key_path


def _lookup(node: Any, name: str) -> tuple[str, Any] | None:
    if not isinstance(node, Mapping):
        return None
    for entry, value in node.items():
        if str(entry) == name:
            return str(entry), value
    return None


def _default_key_path(root: Any, where: str) -> tuple[str, ...]:
    if not isinstance(root, Mapping):
        raise InputError(
            f"{where}the checkpoint holds a {type(root).__name__}, not a mapping of gradients"
        )
    named = [str(k) for k, v in root.items() if str(k) in GRADIENT_KEYS and isinstance(v, Mapping)]
    if len(named) == 1:
        return (named[0],)
    if len(named) > 1:
        raise InputError(
            f"{where}several gradient mappings ({', '.join(named)}); choose one with --key; "
            f"candidates: {_candidate_text(root)}"
        )
    if _is_flat(root):
        return ()
    raise InputError(
        f"{where}no gradients found: no top-level 'grads', 'gradients' or 'grad' mapping and "
        f"the file is not a flat name -> tensor mapping; candidates for --key: "
        f"{_candidate_text(root)}"
    )


def _is_flat(mapping: Mapping) -> bool:
    """Holds tensors and nothing nested (scalars such as a step counter are tolerated)."""
    values = list(mapping.values())
    return any(isinstance(v, torch.Tensor) for v in values) and not any(
        isinstance(v, (Mapping, list, tuple)) for v in values
    )


def _at(root: Any, key_path: tuple[str, ...]) -> Any:
    node = root
    for part in key_path:
        node = _lookup(node, part)[1]
    return node


def _leaves(node: Any, prefix: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    items: Any = node.items() if isinstance(node, Mapping) else enumerate(node)
    for entry, value in items:
        name = (*prefix, str(entry))
        if isinstance(value, (Mapping, list, tuple)) and value:
            yield from _leaves(value, name)
        else:
            yield ".".join(name), value


def candidate_keys(root: Any) -> list[str]:
    """Dotted paths of the mappings in ``root`` that directly hold tensors, in file order."""
    found: list[str] = []

    def walk(node: Any, prefix: tuple[str, ...], depth: int) -> None:
        if not isinstance(node, Mapping) or depth > _MAX_DEPTH:
            return
        if prefix and any(isinstance(v, torch.Tensor) for v in node.values()):
            found.append(".".join(prefix))
        for entry, value in node.items():
            walk(value, (*prefix, str(entry)), depth + 1)

    walk(root, (), 0)
    return found


def _candidate_text(root: Any) -> str:
    keys = candidate_keys(root)
    if not keys:
        return "none (no mapping in the file holds tensors)"
    shown = ", ".join(keys[:_MAX_CANDIDATES])
    more = len(keys) - _MAX_CANDIDATES
    return shown + (f" (and {more} more)" if more > 0 else "")
