"""How tensor names map to report groups (``--group-by``).

``layer`` (default): the name up to and including its first all-digit
component (``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``),
else its parent module (``transformer.wte.weight`` -> ``transformer.wte``).
``module``: the parent module. ``depth:N``: the first N components.
``regex:PATTERN``: the first capture group of the first match (the whole
match if the pattern has no group). ``tensor``: one group per tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..errors import UsageError

UNMATCHED = "(unmatched)"

GroupRule = Callable[[str], str]


def _parent(name: str) -> str:
    head, _, _ = name.rpartition(".")
    return head or name


def by_layer(name: str) -> str:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return _parent(name)


def by_module(name: str) -> str:
    return _parent(name)


def by_tensor(name: str) -> str:
    return name


def by_depth(depth: int) -> GroupRule:
    def rule(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    return rule


def by_regex(pattern: re.Pattern) -> GroupRule:
    def rule(name: str) -> str:
        match = pattern.search(name)
        if match is None:
            return UNMATCHED
        return (match.group(1) if pattern.groups else match.group(0)) or UNMATCHED

    return rule


_NAMED = {"layer": by_layer, "module": by_module, "tensor": by_tensor}


def parse_group_by(spec: str) -> GroupRule:
    """The rule for a ``--group-by`` value; UsageError if it is not one."""
    if spec in _NAMED:
        return _NAMED[spec]
    kind, sep, arg = spec.partition(":")
    if sep and kind == "depth":
        if not arg.isdigit() or int(arg) < 1:
            raise UsageError(f"--group-by depth:N needs a whole number N >= 1, got {arg!r}")
        return by_depth(int(arg))
    if sep and kind == "regex":
        try:
            return by_regex(re.compile(arg))
        except re.error as e:
            raise UsageError(f"--group-by regex: invalid pattern {arg!r}: {e}") from None
    raise UsageError(
        f"--group-by must be layer, module, tensor, depth:N or regex:PATTERN, got {spec!r}"
    )
