"""A monitor record as tracker scalars; the TensorBoard writer of ``GradMonitor(tensorboard=)``.

Every writer of gradclip's (the Lightning and Trainer callbacks through their
framework's logger, ``GradMonitor``'s TensorBoard files) logs the same
scalars for a logged step, made here from the monitor's record (the JSON
line as a dict) under the contract's tags (``tracker_tags``):

- ``gradclip/total_norm``: the total norm;
- ``gradclip/norm/<group>``: each group's norm, under the log's group name;
- ``gradclip/spike``: 1.0 on a spike (the total or a group), else 0.0;
- ``gradclip/clip_coef``: the coefficient the gradients were multiplied by;
  1.0 on a step whose record has none (the log's ``null``: nothing was
  scaled). A point on every logged step, not only on clipped ones: a logger
  that keeps the last value of a key until it is logged again (Lightning's
  results do, within an epoch) would otherwise repeat a clip's coefficient
  on the steps after it;
- ``gradclip/norm_type``: p, only where it is not 2 (a tracker keeps numbers
  under names, not the log's ``norm_type``; absent means the 2-norm).

Values are the record's float64 numbers, NaN and inf as floats; a tracker
that stores float32 (TensorBoard, and Lightning's ``self.log`` under the
default dtype) rounds them to float32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import tracker_tags

NORM_TYPE = tracker_tags.NORM_TYPE

TENSORBOARD_EXTRA = "pip install 'gradclip[tensorboard]'"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The tracker scalars of one monitor record, tag -> value, in a fixed order:
    the total, the groups in the record's order, the spike flag, the clip
    coefficient, then p where it is not 2."""
    out = {tracker_tags.TOTAL_NORM: float(record["total_norm"])}
    # float() reads the record's "nan"/"inf"/"-inf" strings back as the numbers.
    for group, norm in record["groups"].items():
        out[tracker_tags.group_norm(group)] = float(norm)
    out[tracker_tags.SPIKE] = 1.0 if record["spike"] else 0.0
    coef = record.get("clip_coef")
    out[tracker_tags.CLIP_COEF] = 1.0 if coef is None else float(coef)
    norm_type = float(record.get("norm_type", 2.0))
    if norm_type != 2.0:
        out[NORM_TYPE] = norm_type
    return out


def summary_writer_class() -> type:
    """torch's ``SummaryWriter``, or an ``ImportError`` naming the extra that brings it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # torch imports the tensorboard package there
        raise ImportError(
            "GradMonitor(tensorboard=...) writes through torch.utils.tensorboard, which needs "
            f"the tensorboard package: {TENSORBOARD_EXTRA} ({error})"
        ) from None
    return SummaryWriter


class TensorBoardScalars:
    """Writes each logged step's scalars to TensorBoard event files in ``log_dir``.

    Through torch's ``SummaryWriter`` (its event file, its queue, its flush
    every ``flush_secs``), made at the first write so that a monitor on a
    rank that never writes creates no file. A step's scalars go out as one
    ``Summary`` of all its values, one event: ``add_scalar`` per tag cost
    132 us each (1,000 groups: 0.13 s a step), one event 5 us a value
    (docs/guides/dashboards.md). TensorBoard stores each value as a float32
    (``simple_value``).
    """

    def __init__(self, log_dir: str | os.PathLike[str]):
        self._writer_class = summary_writer_class()  # the missing extra fails here, not mid-run
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def write(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self._writer is None:
            self._writer = self._writer_class(str(self.log_dir))
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)
                                 for tag, value in values.items()])
        # The writer's own file writer, as add_scalar reaches it (reopened after close()).
        self._writer._get_file_writer().add_summary(summary, step)

    def close(self) -> None:
        """Flush and close the event file (a later write opens a new one)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
