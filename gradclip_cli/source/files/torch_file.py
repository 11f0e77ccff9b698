"""Reading ``torch.save`` files: the zip format and the legacy pickle format.

Both are read first by gradclip's restricted reader (``weights_pickle``: any
pickle protocol, plain tensors, Parameters and plain values), then, for what
it does not read, by torch's weights-only unpickler; nothing in the file can
run code unless the user passes ``--trust-pickle``.
"""

from __future__ import annotations

import contextlib
import mmap
import pickle
import pickletools
import re
import warnings
import zipfile
from pathlib import Path

import torch

from gradclip_cli.errors import InputError, UnsafeCheckpointError
from gradclip_cli.source.files import torch_legacy_reader, torch_zip_reader
from gradclip_cli.source.files.weights_pickle import Outside, is_allowed
from gradclip_cli.source.interface import Checkpoint

ZIP_MAGIC = b"PK\x03\x04"
# The opcode ``PROTO`` followed by a protocol number torch can write (2..5):
# legacy ``torch.save`` files open with a pickled magic number at protocol 2.
# Also the text-protocol opcodes that import a callable (GLOBAL ``c``, or MARK
# then INST ``(i``), which is how hand-made malicious pickles usually open.
_PICKLE_START = re.compile(rb"\x80[\x02-\x05]|\(*(?:c|\(i)[\w.]+\n[\w.]+\n")

# Messages of the weights-only unpickler that mean "this pickle wants to import
# or call something", as opposed to "this pickle is damaged". torch's own
# ``_get_wo_message`` in torch/serialization.py matches the same phrases.
_REFUSAL = re.compile(
    r"GLOBAL (\S+) (?:was not an allowed global|whose module)"
    r"|(\S+) must be \S+ to load|Unsupported operand (?P<opcode>\d+)|Unsupported class"
)
# Advice torch wraps around weights-only refusals; the reason sits between.
_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")
_ENFORCE_PREFIX = re.compile(r"^\[enforce fail at [^\]]*\]\s*\.?\s*")


def is_torch_zip(head: bytes) -> bool:
    """True when ``head`` (the file's first bytes) opens a zip archive."""
    return head.startswith(ZIP_MAGIC)


def is_pickle(head: bytes) -> bool:
    """True when ``head`` opens a pickle (the legacy torch format, or a bare pickle).

    A bare pickle is routed here too, so the weights-only unpickler is the one
    to refuse it when it imports something, and the user hears about
    ``--trust-pickle`` instead of "unknown format".
    """
    return _PICKLE_START.match(head) is not None


def load_torch_zip(path: Path, *, trust_pickle: bool = False) -> Checkpoint:
    """Load a zip-format ``torch.save`` file, memory-mapped.

    ``mmap=True`` maps the file instead of reading it; MAP_PRIVATE is pinned
    (whatever the process-wide default) so that editing a loaded tensor in
    place copies the page and never writes through to the file.
    """
    root, culprit = None, None
    if not trust_pickle and not path.name.endswith(".safetensors"):
        # The common case (plain tensors in dicts/lists) without torch's
        # pure-Python unpickler; None means "outside that subset": torch decides.
        # The reader checks the directory entries it reads itself, so the
        # zipfile pass below (0.15-0.3 s for 20,000 entries) runs only for torch.
        root, culprit = _restricted(path, torch_zip_reader.restricted_read)
    if root is None:
        _check_zip_directory(path)
        with torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE):
            root = _torch_load(path, trust_pickle=trust_pickle, mapped=True, culprit=culprit)
    return Checkpoint(path=path, format="torch-zip", root=root, trusted_pickle=trust_pickle)


def load_torch_legacy(path: Path, *, trust_pickle: bool = False) -> Checkpoint:
    """Load a legacy (pre-1.6, non-zip) ``torch.save`` file; torch cannot mmap this format."""
    root, culprit = (None, None) if trust_pickle else \
        _restricted(path, torch_legacy_reader.restricted_read)
    if root is None:
        root = _torch_load(path, trust_pickle=trust_pickle, mapped=False, culprit=culprit)
    return Checkpoint(path=path, format="torch-legacy", root=root, trusted_pickle=trust_pickle)


def _restricted(path: Path, read) -> tuple[object | None, str | None]:
    """The restricted reader's result, or None to let ``torch.load`` decide.

    With None comes the global the restricted reader refused, if that was why:
    ``_torch_load`` names it when torch refuses a global that ``allowing`` vouches for.

    torch's weights-only unpickler reads pickle protocols 2 and 3 only: for
    those, a file outside the restricted subset goes to torch, which reads
    what it can and refuses what needs full unpickling. A protocol 4 or 5
    file it would refuse whatever it holds, so there the restricted reader's
    verdict stands: a global it does not hand out (or state set on a tensor)
    is refused as needing full unpickling; anything else is damage.
    """
    try:
        return read(path), None
    except Outside as outside:
        if not outside.damaged and (outside.protocol is None or outside.protocol <= 3):
            return None, outside.culprit
        if outside.unsafe:
            raise _refusal(path, outside.culprit) from None
        reason = _short(str(outside))
        raise InputError(f"{path}: not a readable torch checkpoint: {reason}") from None


def _refusal(path: Path, culprit: str | None) -> UnsafeCheckpointError:
    what = f" (it references {culprit})" if culprit else ""
    return UnsafeCheckpointError(
        f"{path}: refused: loading needs full unpickling, which can run code "
        f"from the file{what}; pass --trust-pickle only if you trust its source"
    )


def _check_zip_directory(path: Path) -> None:
    """Read the zip's central directory (not its data) to name truncation plainly;
    torch's reader reports a cut archive as "[Errno 22] Invalid argument"."""
    try:
        with zipfile.ZipFile(path) as archive:
            size = path.stat().st_size
            spans = []
            with open(path, "rb") as raw:
                for info in archive.infolist():
                    if info.compress_type != zipfile.ZIP_STORED:
                        # torch.save stores every entry; torch.load(mmap=True) maps a
                        # compressed one's bytes as the tensor's, and inflating a
                        # data.pkl costs what it claims, not what the file holds.
                        raise zipfile.BadZipFile(
                            f"entry '{info.filename}' is compressed (torch.save stores "
                            "entries uncompressed)")
                    if info.header_offset + info.compress_size > size:
                        raise zipfile.BadZipFile(f"entry '{info.filename}' runs past the end")
                    spans.append((_local_span(raw, info, size), info.filename))
            # torch's reader trusts the central directory: an entry pointed at
            # another's bytes would load that data as a tensor, silently.
            spans.sort()
            for ((_, end), name), ((begin, _), after) in zip(spans, spans[1:]):
                if begin < end:
                    raise zipfile.BadZipFile(f"entries '{name}' and '{after}' overlap")
    except zipfile.BadZipFile as error:
        raise InputError(f"{path}: truncated or corrupt zip archive: {error}") from None
    except (OSError, EOFError, ValueError, NotImplementedError) as error:
        # NotImplementedError: zipfile's "zip file version 6.4" for a damaged
        # version-needed field, or a compression method it lacks.
        raise InputError(f"{path}: truncated or corrupt zip archive: {error}") from None


def _local_span(raw, info: zipfile.ZipInfo, size: int) -> tuple[int, int]:
    """The bytes an entry occupies: its local header, name, extra field and data."""
    raw.seek(info.header_offset)
    local = raw.read(30)
    if len(local) < 30 or local[:4] != ZIP_MAGIC:
        raise zipfile.BadZipFile(f"entry '{info.filename}' has no local header")
    name_len = int.from_bytes(local[26:28], "little")
    extra_len = int.from_bytes(local[28:30], "little")
    name = raw.read(name_len)
    if name.decode("utf-8", "replace") != info.orig_filename:
        raise zipfile.BadZipFile(f"entry '{info.filename}' points at another entry's header")
    end = info.header_offset + 30 + name_len + extra_len + info.compress_size
    if end > size:
        raise zipfile.BadZipFile(f"entry '{info.filename}' runs past the end")
    return info.header_offset, end


def _torch_load(path: Path, *, trust_pickle: bool, mapped: bool,
                culprit: str | None = None) -> object:
    # torch.load picks its safetensors reader by the name alone when given a
    # path ending in ".safetensors"; the content said torch, so hand it an open
    # file instead. mmap needs a path, so such a misnamed zip is read, not mapped.
    by_handle = not mapped or path.name.endswith(".safetensors")
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            # Legacy files trigger TypedStorage deprecation noise that is
            # torch's internal business, not the user's.
            warnings.simplefilter("ignore", UserWarning)
            source = stack.enter_context(open(path, "rb")) if by_handle else path
            return torch.load(
                source,
                map_location="cpu",
                weights_only=not trust_pickle,
                mmap=mapped and not by_handle,
            )
    except pickle.UnpicklingError as error:
        refused = _REFUSAL.search(str(error))
        if refused and not trust_pickle and _is_real_opcode(refused.group("opcode")):
            named = refused.group(1) or refused.group(2)
            if culprit is not None and is_allowed(named):
                # torch stopped at a stand-in gradclip vouches for; the reason is elsewhere.
                named = culprit
            raise _refusal(path, named) from None
        raise InputError(f"{path}: not a readable torch checkpoint: {_reason(error)}") from None
    except Exception as error:  # torch raises RuntimeError, EOFError, ValueError, OSError...
        raise InputError(f"{path}: not a readable torch checkpoint: {_reason(error)}") from None


def _is_real_opcode(code: str | None) -> bool:
    """An opcode the restricted unpickler lacks (protocol 4's FRAME, say) means a real
    pickle that needs the full one; a byte that is no opcode at all means damage."""
    return code is None or chr(int(code)) in pickletools.code2op


def _reason(error: BaseException) -> str:
    """A short reason: torch appends C++ stack traces and advice to its messages."""
    if isinstance(error, EOFError):
        return "unexpected end of file (truncated?)"
    lines = [
        line.strip()
        for line in str(error).splitlines()
        if line.strip() and not line.strip().startswith(_BOILERPLATE)
    ]
    text = _ENFORCE_PREFIX.sub("", lines[0]) if lines else ""
    text = text.split(". This is an internal miniz error")[0]
    return _short(text or type(error).__name__)


def _short(text: str) -> str:
    return text if len(text) <= 160 else text[:157] + "..."
