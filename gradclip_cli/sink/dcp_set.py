"""Writing a clipped DCP folder: every file copied, each gradient chunk's storage rewritten.

A chunk is a ``torch.save`` blob at a byte range of a ``.distcp`` file, and
``.metadata`` records those ranges. Scaling changes a storage's values, not
its size, so each blob is rewritten in place, same length: the storage's
bytes and the CRC32 the zip keeps of them (central directory, data
descriptor, local header where set). The ranges stay where ``.metadata``
says, so it is copied byte for byte and gradclip never writes DCP's pickle.

The folder is written and switched as a sharded set is (``sharded_set``,
through the DCP layout's ``write_back``, which passes ``chunk_patcher`` as
the copy's patch): a new folder beside the target, one rename; a crash
leaves the old set or the new one, never a mix.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from collections.abc import Callable
from pathlib import Path


def chunk_patcher(chunks, folder: Path) -> Callable[[str, Path], None]:
    """``patch(name, copy)`` for ``write_set``: the scaled chunks' bytes and CRC32s into the
    copy of the ``.distcp`` file ``name`` (``set_member``'s name in ``folder``)."""
    from gradclip_cli.sink.sharded_set import set_member

    by_file: dict[str, list] = {}
    for chunk in chunks:
        by_file.setdefault(set_member(chunk.file, folder), []).append(chunk)

    def patch(name: str, out: Path) -> None:
        todo = by_file.get(name)
        if not todo:
            return
        with open(out, "r+b") as file:
            for chunk in todo:
                storage = chunk.tensor.untyped_storage()
                data = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
                file.seek(chunk.patch.data_start)
                file.write(data)
                crc = struct.pack("<L", zlib.crc32(data))
                for at in chunk.patch.crc_positions:
                    file.seek(at)
                    file.write(crc)
    return patch
