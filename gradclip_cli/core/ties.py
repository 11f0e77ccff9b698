"""Tied tensors: one storage under several names.

Tied weights (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) are
one tensor. Counting them twice would inflate the total norm and scaling them
twice would clip them by the coefficient squared, so gradclip keeps the first
name of each tie and reports the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tie_key(t: torch.Tensor):
    """Two tensors are tied when they are the same view of the same memory."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def find_ties(tensors: Sequence[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first tensor it is tied to (itself if none).

    Empty tensors are never tied: they have no memory to share, and their
    ``data_ptr`` can coincide.
    """
    first: dict = {}
    owner = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            owner.append(i)
            continue
        owner.append(first.setdefault(tie_key(t), i))
    return owner
