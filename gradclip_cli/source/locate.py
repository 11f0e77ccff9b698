"""Finding the gradient mapping inside a loaded checkpoint (the contract's ``--key`` rule).

With a key: follow the dotted path through nested mappings (an integer
component indexes a list or tuple). Without: a single
top-level mapping named ``grads``, ``gradients`` or ``grad``; else the whole
file when it is a flat mapping of name -> tensor; else an error listing the
candidate keys.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source.interface import GradientSelection
from gradclip_cli.source.vocabulary import GRADIENT_KEYS, WEIGHT_KEYS

_MAX_CANDIDATES = 8
_MAX_DEPTH = 6  # how deep to look for candidate keys in an error message


def select_gradients(
    root: Any, key: str | None, *, path: Path | str | None = None
) -> GradientSelection:
    """Return the gradient tensors of ``root``, chosen by ``key`` or by the default rule.

    Nested mappings, lists and tuples inside the chosen entry are flattened
    with dotted names (a list's positions are its names); entries that are not
    floating-point tensors are listed in ``skipped``. ``path``, when given,
    names the file in error messages. Every walk keeps its own stack: a
    nesting of any depth is read without Python recursion.
    """
    where = f"{path}: " if path is not None else ""
    if key is not None:
        key_path = _follow(root, key, where)
    else:
        key_path = _default_key_path(root, where)
    container = _at(root, key_path)
    tensors: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, value in _leaves(container, where):
        if name in tensors or name in skipped:
            # {"a.b": x, "a": {"b": y}} flattens to one name twice; never merge silently.
            raise InputError(
                f"{where}two gradient entries flatten to the same name '{name}'"
            )
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            tensors[name] = value
        else:
            skipped.append(name)
    if not tensors:
        under = f"under '{_shown_key(key_path)}'" if key_path else "in the file"
        raise InputError(
            f"{where}no floating-point gradients found {under} "
            f"({len(skipped)} entries, none a floating-point tensor)"
        )
    return GradientSelection(key_path=key_path, tensors=tensors, skipped=skipped)


def at_key(root: Any, key: str, *, path: Path | str | None = None) -> Any:
    """What the dotted ``key`` names in ``root`` (the ``--key`` rule); ``InputError`` if none."""
    where = f"{path}: " if path is not None else ""
    return _at(root, _follow(root, key, where))


def names_alone(root: Any, key: str, value: Any) -> bool:
    """True where the dotted ``key`` leads to ``value`` itself in ``root``: the ``--key``
    that names it (an entry whose own name has empty parts, ``a..b``, has none)."""
    try:
        return at_key(root, key) is value
    except InputError:
        return False


def enclosing(root: Any, key: str, *, path: Path | str | None = None
              ) -> list[tuple[str, Any]]:
    """The entries the dotted ``key`` passes through on its way, outermost first: each
    one's dotted key and value (``InputError`` if ``key`` names nothing)."""
    where = f"{path}: " if path is not None else ""
    key_path = _follow(root, key, where)
    return [(_shown_key(key_path[:n]), _at(root, key_path[:n])) for n in range(1, len(key_path))]


def within(root: Any, key: str, *, path: Path | str | None = None
           ) -> Iterator[tuple[str, Any]]:
    """Every mapping nested inside what the dotted ``key`` names (not that itself), each
    with its dotted key, outermost first (``InputError`` if ``key`` names nothing)."""
    where = f"{path}: " if path is not None else ""
    start = _follow(root, key, where)
    seen: set[int] = set()
    queue = deque([(start, _at(root, start))])
    while queue:
        key_path, node = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for entry, value in _children(node):
            if isinstance(value, (Mapping, list, tuple)):
                if isinstance(value, Mapping):
                    yield _shown_key((*key_path, str(entry))), value
                queue.append(((*key_path, str(entry)), value))


def _follow(root: Any, key: str, where: str) -> tuple[str, ...]:
    """Resolve a dotted key; a part may itself contain dots (``"model.grads"`` as one key).

    An integer part indexes a list or tuple (``optimizer_states.0.state``).
    """
    parts = [part for part in key.split(".") if part]
    shown = key
    if not parts:
        raise InputError(f"{where}--key '{shown}' is empty")
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
            if not key_path and isinstance(root, Mapping) and _is_flat(root):
                raise InputError(
                    f"{where}--key '{shown}': no entry '{parts[0]}'; the file itself "
                    "is a flat name -> tensor mapping: omit --key"
                )
            found = _shown_key(key_path) or "the top level"
            if key_path and not isinstance(node, (Mapping, list, tuple)):
                # A number, a string: nothing below it to index or name.
                raise InputError(
                    f"{where}--key '{shown}': '{found}' holds a value of type "
                    f"{type(node).__name__}, not a mapping or list; {_hint(root)}"
                )
            if isinstance(node, (list, tuple)):
                kind = type(node).__name__
                found += f" (a {kind} of {len(node)}: positions 0 to {len(node) - 1})"
            raise InputError(
                f"{where}--key '{shown}': no entry '{parts[0]}' at {found}; "
                f"{_hint(root)}"
            )
    if not isinstance(node, (Mapping, list, tuple)):
        raise InputError(
            f"{where}--key '{shown}' leads to a {type(node).__name__}, not a mapping of "
            f"gradients; {_hint(root)}"
        )
    return key_path


def _lookup(node: Any, name: str) -> tuple[str, Any] | None:
    if isinstance(node, (list, tuple)):
        if name.isdigit() and name.isascii() and int(name) < len(node):
            return str(int(name)), node[int(name)]
        return None
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
    listed = [
        (str(k), v) for k, v in root.items()
        if str(k) in GRADIENT_KEYS and isinstance(v, (list, tuple))
    ]  # fmt: skip
    if len(listed) == 1:
        name, value = listed[0]
        raise InputError(
            f"{where}'{name}' is a {type(value).__name__} of {len(value)}, not a name -> tensor "
            f"mapping; --key {name} reads it with positions as names (0 to {len(value) - 1})"
        )
    raise InputError(
        f"{where}no gradients found: no top-level 'grads', 'gradients' or 'grad' mapping and "
        f"the file is not a flat name -> tensor mapping; {_hint(root)}"
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


def _children(node: Any):
    return node.items() if isinstance(node, Mapping) else enumerate(node)


def _leaves(node: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted name, value)`` for every non-container entry under ``node``, in file order.

    Iterative (a checkpoint may nest deeper than Python's recursion limit);
    a container that holds itself is an error rather than an endless walk.
    """
    prefix: list[str] = []
    on_path = [id(node)]
    stack = [iter(_children(node))]
    while stack:
        for entry, value in stack[-1]:
            name = str(entry)
            if isinstance(value, (Mapping, list, tuple)) and value:
                if id(value) in on_path:
                    raise InputError(
                        f"{where}'{'.'.join((*prefix, name))}' contains itself"
                    )
                prefix.append(name)
                on_path.append(id(value))
                stack.append(iter(_children(value)))
                break
            yield ".".join((*prefix, name)), value
        else:
            stack.pop()
            on_path.pop()
            if prefix:
                prefix.pop()


def _is_optimizer_state(node: Any) -> bool:
    """A ``torch.optim.Optimizer.state_dict()``, or a mixed-precision wrapper's state around
    one: its tensors are moments and master weights, never gradients."""
    from gradclip_cli.source.layouts.torch_optim import wraps_optimizer_state

    return isinstance(node, Mapping) and (
        "state" in node and "param_groups" in node or wraps_optimizer_state(node))


def _gradient_shaped(value: Any) -> bool:
    # A scalar is a counter (AdamW's `step`) or a loss, never a parameter's gradient.
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0


def _survey(root: Any) -> tuple[list[str], list[str]]:
    """Dotted paths of the containers that directly hold gradient-shaped floating tensors,
    and of the optimizer states, both in file order and at most ``_MAX_DEPTH`` deep."""
    candidates: list[str] = []
    optimizers: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[Any, tuple[str, ...]]] = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        if id(node) in seen or len(prefix) > _MAX_DEPTH:
            continue
        seen.add(id(node))
        if _is_optimizer_state(node):
            optimizers.append(".".join(prefix) or "the top level")
            continue
        children = list(_children(node))
        if prefix and any(_gradient_shaped(v) for _, v in children) and not _weights(node, prefix):
            candidates.append(".".join(prefix))
        stack.extend(
            (value, (*prefix, str(entry)))
            for entry, value in reversed(children)
            if isinstance(value, (Mapping, list, tuple))
        )
    return candidates, optimizers


def _weights(node: Any, prefix: tuple[str, ...]) -> bool:
    """A model's weights (never a gradient candidate): a weight key at the top level, or
    what ``roles.weight_evidence`` recognises."""
    from gradclip_cli.source.roles import weight_evidence

    if len(prefix) == 1 and prefix[0] in WEIGHT_KEYS:
        return True
    return isinstance(node, Mapping) and weight_evidence(node) is not None


def candidate_keys(root: Any) -> list[str]:
    """Dotted paths of the containers in ``root`` that directly hold gradient-shaped tensors.

    Optimizer state and a model's weights are never candidates: their tensors are
    moments, counters and parameters.
    """
    return _survey(root)[0]


def _candidate_text(root: Any) -> str:
    keys = candidate_keys(root)
    if not keys:
        return "none (no mapping in the file holds gradient-shaped tensors)"
    shown = ", ".join(keys[:_MAX_CANDIDATES])
    more = len(keys) - _MAX_CANDIDATES
    return shown + (f" (and {more} more)" if more > 0 else "")


def _hint(root: Any) -> str:
    """What to try instead: the keys that may hold gradients. What else the file holds
    (weights, optimizer state) the command says, as the ``--what`` it can measure."""
    if not candidate_keys(root):
        return "no mapping in the file holds gradient-shaped tensors"
    return f"candidates for --key: {_candidate_text(root)}"


def _shown_key(key_path: tuple[str, ...]) -> str:
    return ".".join(key_path)
