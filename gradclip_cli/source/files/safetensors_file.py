"""Reading ``.safetensors`` files.

Layout (https://github.com/huggingface/safetensors#format): 8 bytes little-endian
header length N, N bytes of JSON header, then the byte buffer the header's
``data_offsets`` point into. The header is checked against the file size here,
before the library maps anything, so a lying header gives a clear message and
never an allocation beyond what the file holds.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gradclip_cli.errors import InputError
from gradclip_cli.source.files.json_text import parse_json
from gradclip_cli.source.files.small_file import open_regular
from gradclip_cli.source.interface import Checkpoint
from gradclip_cli.source.untrusted import is_count

# The safetensors library refuses headers above 100 MB; so do we, before reading one.
MAX_HEADER_BYTES = 100_000_000

# Bytes per element of each dtype the format defines (F4 packs two values per byte).
DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "C64": 8,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it; offsets are relative to the byte buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A header already checked against the file: every entry lies inside the buffer."""

    entries: tuple[TensorEntry, ...]  # in buffer order
    metadata: dict[str, str] | None
    buffer_size: int  # bytes after the header


def is_safetensors(head: bytes) -> bool:
    """True when ``head`` opens with a header length and then a JSON object."""
    return len(head) >= 9 and struct.unpack("<Q", head[:8])[0] > 0 and head[8:9] == b"{"


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check the header; ``InputError`` when it is not JSON or lies about sizes."""
    try:
        with open_regular(path, "a safetensors file") as file:
            file_size = os.fstat(file.fileno()).st_size
            if file_size < 8:
                raise InputError(f"{path}: truncated safetensors file ({file_size} bytes)")
            (header_size,) = struct.unpack("<Q", file.read(8))
            if header_size > min(file_size - 8, MAX_HEADER_BYTES):
                raise InputError(
                    f"{path}: corrupt safetensors header: it claims {header_size} bytes, "
                    f"the file holds {file_size - 8} after the length"
                )
            raw = file.read(header_size)
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
    header = parse_json(raw, where=f"{path}: corrupt safetensors header",
                        what="JSON")
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header: not a JSON object")
    buffer_size = file_size - 8 - header_size
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise InputError(f"{path}: corrupt safetensors header: __metadata__ is not str -> str")
    entries = [_entry(path, name, info, buffer_size) for name, info in header.items()]
    entries.sort(key=lambda entry: (entry.begin, entry.end))
    return SafetensorsHeader(tuple(entries), metadata, buffer_size)


def load_safetensors(path: Path, *, trust_pickle: bool = False) -> Checkpoint:
    """Load a safetensors file; ``root`` is ``{name: tensor}`` in the order the data is stored.

    ``trust_pickle`` is accepted for a uniform reader signature: the format
    holds no pickle. The library maps the file privately (copy-on-write), so
    editing a tensor in place never reaches the file; a test holds it to that.
    """
    header = read_header(path)
    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as file:
            root = {entry.name: _aligned(file.get_tensor(entry.name)) for entry in header.entries}
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise InputError(f"{path}: corrupt safetensors file: {reason}") from None
    return Checkpoint(path=path, format="safetensors", root=root, metadata=header.metadata)


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    # The format does not require aligned offsets, and a tensor mapped at an
    # odd address is legal but slow or unsupported in some kernels: copy it.
    if tensor.data_ptr() % tensor.element_size():
        return tensor.clone()
    return tensor


def _entry(path: Path, name: str, info: object, buffer_size: int) -> TensorEntry:
    def corrupt(why: str) -> InputError:
        return InputError(f"{path}: corrupt safetensors header: tensor '{name}' {why}")

    if not isinstance(info, dict):
        raise corrupt("is not described by a JSON object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise corrupt("has no dtype")
    if not (isinstance(shape, list) and all(is_count(n) for n in shape)):
        raise corrupt(f"has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))):
        raise corrupt(f"has bad data_offsets {offsets!r}")
    begin, end = offsets
    if not begin <= end <= buffer_size:
        raise corrupt(f"lies past the end of the file (bytes {begin}..{end} of {buffer_size})")
    width = DTYPE_BYTES.get(dtype)
    if width is not None and math.ceil(math.prod(shape) * width) != end - begin:
        raise corrupt(f"needs {math.ceil(math.prod(shape) * width)} bytes, has {end - begin}")
    return TensorEntry(name, dtype, tuple(shape), begin, end)
