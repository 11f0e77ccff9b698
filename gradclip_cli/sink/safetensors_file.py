"""Writing ``.safetensors`` files, keeping the input's tensor order and header metadata.

The file is streamed here rather than handed to the library's writers:
``safetensors.torch.save_file`` needs numpy (not a gradclip dependency),
``safetensors.serialize`` builds the whole file in memory (twice the
checkpoint's size), and ``serialize_file`` does its own temp-file-and-rename,
which would bypass ``atomic_write``'s mode, fsync and clean-up guarantees. The
library still names each dtype (``TensorSpec``) and reads every written file
back in the tests.

Layout (https://github.com/huggingface/safetensors#format): 8-byte
little-endian header length, the JSON header padded with spaces to a multiple
of 8 (as the library pads it, so tensor data stays aligned), then the data.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from typing import BinaryIO

import torch
from safetensors import TensorSpec

from gradclip_cli.errors import OutputError
from gradclip_cli.source.interface import Checkpoint

_ALIGNMENT = 8


def write_safetensors(ckpt: Checkpoint, file: BinaryIO) -> None:
    """Write the flat ``{name: tensor}`` root, in its order, with ``ckpt.metadata``."""
    if sys.byteorder != "little":
        # Tensor bytes go out as they sit in memory; the format is little-endian.
        raise OutputError("writing safetensors needs a little-endian machine")
    tensors = {name: _host_contiguous(tensor) for name, tensor in ckpt.root.items()}
    file.write(_header(tensors, ckpt.metadata))
    for tensor in tensors.values():
        size = tensor.numel() * tensor.element_size()
        if size:
            # A zero-copy view of the tensor's bytes: no numpy, no second buffer.
            file.write(memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())))


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        spec = TensorSpec(
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=list(tensor.shape),
            data_ptr=tensor.data_ptr(),
            data_len=size,
        )
        header[name] = {
            "dtype": spec.dtype,
            "shape": spec.shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def _host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()
