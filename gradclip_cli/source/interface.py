"""What every checkpoint source hands to the rest of gradclip."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Checkpoint:
    """A loaded checkpoint, untouched.

    ``root`` is the object as stored: a dict (possibly nested) for torch files,
    a flat ``{name: tensor}`` dict for safetensors. Tensors are memory-mapped
    where the format allows, so loading does not copy the file into memory.
    """

    path: Path
    format: str  # "torch-zip" | "torch-legacy" | "safetensors"
    root: Any
    metadata: dict[str, str] | None = None  # safetensors header metadata
    trusted_pickle: bool = False  # loaded with weights_only=False


@dataclass
class GradientSelection:
    """The gradient mapping found inside a checkpoint.

    ``key_path`` leads from ``Checkpoint.root`` to the mapping (``()`` when the
    whole file is the mapping). ``tensors`` holds the floating-point tensors in
    checkpoint order; ``skipped`` names entries that are tensors but not floating
    point (counted in the report, never touched).
    """

    key_path: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    skipped: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return ".".join(self.key_path)
