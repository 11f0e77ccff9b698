"""What the commands check once torch is loaded: the device, and where output goes.

Each bad value is a UsageError (exit 2) with one line. The form of every
value was checked while the command line was parsed (``values.py``); here
``--device`` is checked against this machine, and output paths before any
work: one that exists and is not a regular file is an OutputError (exit 3),
as it would be at the moment of writing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from . import values
from .errors import REPORT_FILE_FLAG, UsageError
from .sink.atomic import check_folder, check_target

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


def set_output(folder: Path, output: str | None, in_place: bool) -> Path:
    """Where ``clip`` writes a sharded set, which is written as a folder: ``-o`` names it;
    default ``<folder>.clipped``; never inside the input, nor one that exists."""
    if in_place:
        return folder
    target = Path(output) if output is not None else folder.with_name(f"{folder.name}.clipped")
    real_folder = Path(os.path.realpath(folder))
    if real_folder in Path(os.path.realpath(target)).parents:
        # The input is never changed without --in-place, not even by a new entry.
        raise UsageError(f"{target}: inside the input folder {folder}; a clipped set is "
                         "written as a new folder beside it (or use --in-place)")
    if target.exists():
        raise UsageError(f"{target}: exists; a clipped set is written as a new folder "
                         "(or use --in-place)")
    return target


def report_file(output_file: Path | str | None, *, reads: Iterable[Path | str] = (),
                writes: Iterable[Path | str] = (), writes_known: bool = True) -> Path | None:
    """``--output-file``: refused now, not after the work, when it cannot be a file or
    when it is anything the command reads or writes.

    ``reads``: the inputs (files and folders: the command line's, then every file a
    layout read, as each becomes known); ``writes``: what the command writes besides
    the report (clip's output file or folder, ``--plot``). Refused (``UsageError``,
    exit 2, nothing written): the same file by identity (``st_dev``/``st_ino``:
    symlinks and hard links included) or by real path (one not made yet), and
    anything inside one of those folders, or a hard link to a file inside one.
    Commands call this again as more of what they read becomes known; each call
    comes before anything is written. A report that cannot be written at all (a
    folder in its place; its folder missing, once ``writes_known``: until then the
    folder may be one the command is to make, a clipped set's) is an ``OutputError``
    (exit 3), here too: clip must not write its copy and then fail on the report.
    """
    if output_file is None:
        return None
    check_target(output_file)
    for role, paths in (("the input", reads), ("the output", writes)):
        for path in paths:
            why = _same_or_inside(output_file, path)
            if why is not None:
                raise UsageError(f"{REPORT_FILE_FLAG} {output_file}: "
                                 f"{why} {role} {path}; the report would "
                                 "replace it; nothing was written")
    if writes_known:
        check_folder(output_file)
    return Path(output_file)


def _same_or_inside(report: Path | str, path: Path | str) -> str | None:
    """How ``report`` clashes with ``path`` ("is", "is inside", "is a link to a file in"),
    or None when it does not."""
    real_report, real_path = os.path.realpath(report), os.path.realpath(path)
    if real_report == real_path:
        return "is"
    try:
        mine = os.stat(report)
    except OSError:
        mine = None
    try:
        theirs = os.stat(path)
    except OSError:
        theirs = None
    if mine is not None and theirs is not None and _same_file(mine, theirs):
        return "is"
    if Path(real_path) in Path(real_report).parents:
        return "is inside"  # a folder, or one not made yet (a clipped set's)
    if mine is not None and mine.st_nlink > 1 and theirs is not None \
            and stat.S_ISDIR(theirs.st_mode) and _links_into(mine, path):
        return "is a link to a file inside"
    return None


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _links_into(report: os.stat_result, folder: Path | str) -> bool:
    """Whether a file under ``folder`` (symlinks followed, folders not) is ``report``."""
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                if _same_file(report, os.stat(os.path.join(root, name))):
                    return True
            except OSError:
                continue
    return False


def what(text: str) -> str:
    """``--what``: one of the quantities ``source/what.py`` measures, or ``auto``."""
    return values.word("--what", text, values.WHATS)


def fail_on(text: str) -> str:
    """``--fail-on``: ``newest`` or ``any``."""
    return values.word("--fail-on", text, values.FAIL_ON)


def spike_rule(z: float | None, alpha: float | None, warmup: int | None
               ) -> tuple[float, float, int]:
    """The spike rule's ``--z``, ``--alpha`` and ``--warmup``, each its default where not
    given (``core/spikes.py``), checked by the rules the command line checks them by
    (``values.py``), for callers that skip it (the Python API)."""
    from .core.spikes import DEFAULT_ALPHA, DEFAULT_WARMUP, DEFAULT_Z

    z = DEFAULT_Z if z is None else z
    alpha = DEFAULT_ALPHA if alpha is None else alpha
    warmup = DEFAULT_WARMUP if warmup is None else warmup
    values.threshold("--z", z, allow_zero=False)
    values.fraction("--alpha", alpha)
    values.whole("--warmup", warmup, least=1)
    return z, alpha, warmup
