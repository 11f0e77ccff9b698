"""Writing safetensors files in tests, through the library itself.

``safetensors.torch.save_file`` needs NumPy, which gradclip does not depend
on; ``serialize_file`` with ``TensorSpec`` is the library's NumPy-free entry
point.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import TensorSpec, serialize_file


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata=None) -> None:
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    specs = {
        name: TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=list(t.shape),
            data_ptr=t.data_ptr(),
            data_len=t.numel() * t.element_size(),
        )
        for name, t in tensors.items()
    }
    serialize_file(specs, str(path), metadata=metadata)
