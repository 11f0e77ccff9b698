"""Megatron's grad-buffer layout: where each parameter lies in its DDP bucket.

Megatron-core's ``_ParamAndGradBuffer`` (core_v0.16.1,
``megatron/core/distributed/param_and_grad_buffer.py``) lays a buffer's
parameters out in reverse model order (roughly backprop's), and with the
distributed optimizer pads each parameter's start to a multiple of 64
elements (``_pad_start_of_param_if_needed``). A bucket closes once it holds
``bucket_size`` elements (``param_end_index - bucket_start_index >=
bucket_size``; never, when ``bucket_size`` is None), and a ``shared_embedding``
parameter gets a bucket of its own (``_does_param_require_new_bucket``: the
bucket before it closes at its padded start). A bucket's end is then padded to
a multiple of ``lcm(data-parallel size, 128)``, so every bucket starts 64-aligned
and a parameter's place *within its bucket* does not depend on the
data-parallel size; ``numel_unpadded`` is a bucket's length without that end
padding.

The distributed optimizer saves that layout two ways: ``distrib_optim.pt``
(legacy format) holds each buffer as its buckets' unpadded lengths side by side
(``concatenated``); Megatron's ``torch_dist`` with ``dp_reshardable`` saves each
bucket as a tensor of its own, ``numel_unpadded`` long (``megatron``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ALIGN = 64  # a parameter starts at a multiple of 64 elements of its bucket (core_v0.16.1)


@dataclass(frozen=True)
class Bucket:
    """One bucket: each parameter's ``(start, end)`` from the bucket's start, and its
    length without the end padding (``numel_unpadded``)."""

    places: dict[str, tuple[int, int]]
    numel_unpadded: int


def buckets(
    names: Sequence[str],
    numels: Mapping[str, int],
    *,
    bucket_size: int | None = None,
    sizes: Sequence[int] | None = None,
    own: frozenset[str] | set[str] = frozenset(),
) -> list[Bucket]:
    """The buckets of one buffer whose parameters are ``names`` in model order.

    A bucket closes as Megatron's DDP closes it: once it holds ``bucket_size``
    elements, or, given ``sizes`` instead (the saved buckets' lengths), once it
    reaches its saved length (``fits_one_bucket_size`` then checks that one
    ``bucket_size`` closes them all so); one of ``own`` sits in a bucket alone.
    """
    out: list[Bucket] = []
    places: dict[str, tuple[int, int]] = {}
    cursor = 0

    def close(end: int) -> None:
        nonlocal places, cursor
        out.append(Bucket(places, end))
        places, cursor = {}, 0

    for name in reversed(names):
        start = -(-cursor // ALIGN) * ALIGN
        if name in own and places:  # the bucket before it closes at its padded start
            close(start)
            start = 0
        end = start + numels[name]
        places[name] = (start, end)
        if sizes is not None:
            full = len(out) < len(sizes) and end >= sizes[len(out)]
        else:
            full = bucket_size is not None and end >= bucket_size
        if full or name in own:
            close(end)
        else:
            cursor = end
    if places:
        close(cursor)
    return out


def fits_one_bucket_size(layout: Sequence[Bucket]) -> bool:
    """Whether one ``bucket_size`` closes every bucket where it closes: each parameter's end
    before its bucket's last below it, each bucket but the last reaching it."""
    below = [e for b in layout for _, e in sorted(b.places.values())[:-1]]
    reach = [b.numel_unpadded for b in layout[:-1]]
    return not below or not reach or max(below) < min(reach)


def concatenated(layout: Sequence[Bucket]) -> dict[str, tuple[int, int]]:
    """Each parameter's ``(start, end)`` in the buckets laid side by side without their end
    padding (``get_parameter_state_dp_zero``'s flat buffer)."""
    out, offset = {}, 0
    for bucket in layout:
        for name, (start, end) in bucket.places.items():
            out[name] = (offset + start, offset + end)
        offset += bucket.numel_unpadded
    return out


# What every param group of one distributed optimizer must share: its buckets (and
# distrib_optim.pt) do not say which parameters each group holds.
HYPER = ("lr", "betas", "eps", "amsgrad")


def one_setting(groups: Sequence[Mapping]) -> bool:
    """Whether every param group has the first one's lr, betas, eps and amsgrad."""
    first = {k: groups[0].get(k) for k in HYPER}
    return all({k: g.get(k) for k in HYPER} == first for g in groups)
