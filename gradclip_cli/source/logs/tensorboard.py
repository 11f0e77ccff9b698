"""TensorBoard event files (``events.out.tfevents.*``), read point by point.

Every scalar of every event counts: ``EventAccumulator`` keeps a reservoir
sample (10,000 scalars per tag by default), so a 40,000-step run shown there
has lost three in four steps, a spike among them. The events come from
tensorboard's own record reader (``event_file_loader.RawEventFileLoader``,
which checks each record's CRC32C) and are parsed with its ``Event`` proto.
Scalars are read as either writer stores them: ``simple_value`` (the old
style, and torch's ``SummaryWriter`` by default; float32) or a 0-dim tensor
summary (``new_style=True``, tensorboard's own ``tf.summary``-style writers).

That reader stops without a word at a truncated or damaged record (it is
made to tail a file still being written), so the points before the damage
would pass as the whole run. Here the records read must account for every
byte of the file (a record is its data and 16 bytes of length and CRCs);
a file that ends sooner is exit 3 naming the byte where reading stopped. A
file cut exactly between two records cannot be told from a shorter run.

A folder of event files is a run (TensorBoard's own rule); its files are
read in the order their names give (the writer's start time, then the
rest), one after another.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from gradclip_cli.errors import InputError, MissingExtraError
from gradclip_cli.source.files.small_file import quoted
from gradclip_cli.source.logs.tracker import Points, Tracker, TrackerRun

NAME = "TensorBoard"
EXTRA = "tensorboard"
PREFIX = "events.out.tfevents."
# A record: 8 bytes of length, 4 of its CRC, the data, 4 of the data's CRC.
RECORD_OVERHEAD = 16
_START_TIME = re.compile(r"^events\.out\.tfevents\.(\d+)")


def claims(path: Path, is_dir: bool) -> bool:
    return not is_dir and path.name.startswith(PREFIX)


def _file_order(path: Path) -> tuple:
    match = _START_TIME.match(path.name)
    return (int(match.group(1)) if match else -1, path.name)


def runs(claimed: Sequence[Path]) -> list[TrackerRun]:
    by_folder: dict[Path, list[Path]] = {}
    for file in claimed:
        by_folder.setdefault(file.parent, []).append(file)
    return [_run(folder, sorted(files, key=_file_order))
            for folder, files in sorted(by_folder.items())]


def given(path: Path) -> list[TrackerRun] | None:
    return [_run(path.parent, [path])] if path.name.startswith(PREFIX) else None


def _run(folder: Path, files: list[Path]) -> TrackerRun:
    doubles: set[str] = set()  # tags written as float64 tensors, once read
    return TrackerRun(NAME, str(folder), "", files[0] if len(files) == 1 else folder,
                      lambda: read_scalars(files, doubles),
                      stores_float32=lambda tag: tag not in doubles)


def _modules(where: Path):
    try:
        from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.util import tensor_util
    except ImportError:
        raise MissingExtraError(f"{where}: reading TensorBoard event files needs "
                                "the tensorboard package: pip install 'gradclip[tensorboard]'"
                                ) from None
    return RawEventFileLoader, Event, tensor_util


def read_scalars(files: Sequence[Path], doubles: set[str] | None = None
                 ) -> dict[str, Points]:
    """Every scalar of ``files`` by tag, ``(step, value)`` in file order; the tags
    written as tensors of another dtype than float32 (float64, say) are added to
    ``doubles``."""
    loader, event_type, tensor_util = _modules(files[0])
    scalars: dict[str, Points] = {}
    doubles = set() if doubles is None else doubles
    for file in files:
        _read_file(file, scalars, doubles, loader, event_type, tensor_util)
    return scalars


def _read_file(file: Path, scalars: dict[str, Points], doubles: set[str], loader,
               event_type, tensor_util) -> None:
    shown = str(file)
    try:
        size = os.stat(file).st_size
        records = loader(str(file)).Load()
    except OSError as error:
        raise InputError(f"{shown}: cannot read: {error.strerror or error}") from None
    consumed = 0
    points = 0
    for record in records:
        consumed += len(record) + RECORD_OVERHEAD
        try:
            event = event_type.FromString(record)
        except Exception:  # noqa: BLE001 (protobuf's DecodeError, whatever its module)
            raise InputError(f"{shown}: the record at byte {consumed - len(record) - 4} is "
                             "not a TensorBoard event (a damaged file?)") from None
        if not event.HasField("summary"):
            continue
        for value in event.summary.value:
            kind = value.WhichOneof("value")
            if kind == "simple_value":
                number = value.simple_value
            elif kind == "tensor":
                number = _tensor_scalar(value.tensor, tensor_util,
                                        f"{shown}: tag {quoted(value.tag)} at step "
                                        f"{event.step}")
                if number is None:
                    continue
                if value.tensor.dtype != DT_FLOAT:
                    doubles.add(value.tag)
            else:
                continue  # images, histograms, text: not a scalar
            scalars.setdefault(value.tag, []).append((event.step, number))
            points += 1
    if consumed != size:
        raise InputError(
            f"{shown}: truncated or damaged at byte {consumed} of {size} (a record's "
            f"length or CRC does not match); the {points} scalar(s) before it are not "
            "taken as the whole run")


DT_FLOAT = 1
DT_BFLOAT16 = 14
_FLOAT_DTYPES = frozenset({DT_FLOAT, 2, DT_BFLOAT16, 19})  # DT_DOUBLE, DT_HALF too


def _tensor_scalar(tensor, tensor_util, where: str) -> float | None:
    """A 0-dim floating tensor's value; None for any other tensor (text, a histogram).
    One that holds other than one value is exit 3 (``make_ndarray`` raised)."""
    if tensor.dtype not in _FLOAT_DTYPES or tensor.tensor_shape.dim:
        return None
    try:
        values = (_bfloat16_values(tensor) if tensor.dtype == DT_BFLOAT16
                  else tensor_util.make_ndarray(tensor).reshape(-1).tolist())
    except ValueError:  # numpy's: content not a whole number of elements, or too many
        values = []
    if len(values) != 1:
        raise InputError(f"{where}: a 0-dim tensor that does not hold one value "
                         "(a damaged event?)")
    return float(values[0])


def _bfloat16_values(tensor) -> list[float]:
    """A DT_BFLOAT16 tensor's values (numpy, and so ``make_ndarray``, has no bfloat16): each
    the upper 16 bits of a float32, in ``half_val`` or as 2 little-endian bytes in
    ``tensor_content``."""
    content = tensor.tensor_content
    if content:
        if len(content) % 2:
            raise ValueError("not a whole number of bfloat16 elements")
        bits = [int.from_bytes(content[i:i + 2], "little") for i in range(0, len(content), 2)]
    else:
        bits = list(tensor.half_val)
    return [struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0] for b in bits]


TRACKER = Tracker(NAME, EXTRA, claims, runs, given)
