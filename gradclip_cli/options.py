"""What the commands check once torch is loaded: the device, and where output goes.

Each bad value is a UsageError (exit 2) with one line. The form of every
value was checked while the command line was parsed (``values.py``); here
``--device`` is checked against this machine, and output paths before any
work: one that exists and is not a regular file is an OutputError (exit 3),
as it would be at the moment of writing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from . import values
from .errors import UsageError
from .sink.atomic import check_target

if TYPE_CHECKING:
    import torch

# The rules for values given as text live in values.py (checked while the command
# line is parsed, before torch loads); these names are the commands' way to them.
norm_type = values.norm_type
threshold = values.threshold
DEVICE_CHOICES = values.DEVICES


def device(text: str) -> torch.device:
    """The compute device; UsageError if unknown or not available here."""
    import torch

    name = text.strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device must be {DEVICE_CHOICES}, got {text!r}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text}: CUDA is not available on this machine")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {text}: no such CUDA device ({torch.cuda.device_count()} present)"
            )
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"--device {text}: MPS is not available on this machine")
        return dev
    raise UsageError(f"--device must be {DEVICE_CHOICES}, got {text!r}")


def default_output(source: str) -> str:
    """``<stem>.clipped<suffix>`` beside the input, its folder spelled as the user spelled it."""
    path = Path(source)
    name = f"{path.stem}.clipped{path.suffix}"
    folder, given_name = os.path.split(source)
    if given_name == path.name:
        return os.path.join(folder, name)
    return str(path.with_name(name))  # "dir/h.pt/" and other spellings Path tidies


def clip_output(source: str, output: str | None, in_place: bool) -> str:
    """Where ``clip`` writes, as the user would spell it; never the input unless ``--in-place``.

    An output that exists and is not a regular file (a folder, a FIFO, a
    device) is an ``OutputError`` now, before any work is done.
    """
    if in_place:
        if output is not None:
            raise UsageError("--in-place and -o/--output contradict each other; give one")
        return source
    target = output if output is not None else default_output(source)
    if os.path.exists(target) and os.path.realpath(target) == os.path.realpath(source):
        raise UsageError(
            f"{target}: the output is the input; use --in-place to replace it"
        )
    check_target(target)
    return target


def report_file(output_file: Path | None) -> Path | None:
    """``--output-file``: refused now, not after the work, when it cannot be a file."""
    if output_file is not None:
        check_target(output_file)
    return output_file
