"""A Trainer's ``training_args.bin``, read for the few plain settings ``trend`` reports.

``Trainer`` saves its ``TrainingArguments`` with ``torch.save(self.args, ...)``
into every ``checkpoint-N/`` (transformers 5, ``trainer.py``,
``TRAINING_ARGS_NAME``): a pickle of the dataclass (NEWOBJ, then BUILD with
its fields), whose values include transformers' and accelerate's enums
(``SchedulerType("linear")``), an ``AcceleratorConfig`` and accelerate's
``PartialState``. Whether the Trainer clipped, and to what, is its
``max_grad_norm`` field, written nowhere else (``trainer_state.json`` does
not carry it).

The file goes through the same restricted unpickler as every checkpoint,
widened (``allowing``) by exactly the globals listed here, each mapped to an
inert stand-in: nothing is imported and nothing from the file is called.
The arguments' stand-in keeps its plain fields (numbers, strings, flags) and
drops the rest; every other listed class is kept as an empty marker. A file
that names any other global is refused as any checkpoint is (exit 3 under
``inspect``; ``trend`` says the setting is unknown and why).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gradclip_cli.errors import InputError, UnsafeCheckpointError
from gradclip_cli.source.files.weights_pickle import Opaque, Outside, allowing
from gradclip_cli.source.untrusted import is_number

FILE_NAME = "training_args.bin"
# A Trainer's arguments pickle to about 8 KB; a file far larger is something else,
# refused before it is opened.
MAX_BYTES = 1 << 20
_PLAIN = (int, float, bool, str, type(None))


class TrainingArgumentsState(Opaque):
    """``TrainingArguments``' plain fields (``max_grad_norm``, ``logging_steps``, ...)."""

    __slots__ = ("fields",)

    def __new__(cls, *args):
        if args:
            raise Outside("unexpected TrainingArguments arguments")
        self = super().__new__(cls)
        self.fields = {}
        return self

    def __setstate__(self, state):
        if type(state) is not dict:
            raise Outside("TrainingArguments state is not a dict")
        self.fields = {k: v for k, v in state.items() if type(k) is str and type(v) in _PLAIN}


class Marker(Opaque):
    """A value the arguments hold that ``trend`` never reads (an enum, a config object)."""

    __slots__ = ()

    def __new__(cls, *args):
        return super().__new__(cls)

    def __setstate__(self, state):
        pass  # kept empty: nothing of it is read


_ARGUMENT_CLASSES = (
    ("transformers.training_args", "TrainingArguments"),
    ("transformers.training_args_seq2seq", "Seq2SeqTrainingArguments"),
)
_MARKERS = (
    ("transformers.trainer_utils", "SchedulerType"),
    ("transformers.trainer_utils", "IntervalStrategy"),
    ("transformers.trainer_utils", "SaveStrategy"),
    ("transformers.trainer_utils", "HubStrategy"),
    ("transformers.trainer_utils", "FSDPOption"),
    ("transformers.training_args", "OptimizerNames"),
    ("transformers.training_args", "ParallelMode"),
    ("transformers.debug_utils", "DebugOption"),
    ("transformers.trainer_pt_utils", "AcceleratorConfig"),
    ("accelerate.state", "PartialState"),
    ("accelerate.utils.dataclasses", "DistributedType"),
)
GLOBALS: dict[tuple[str, str], object] = {
    **{name: TrainingArgumentsState for name in _ARGUMENT_CLASSES},
    **{name: Marker for name in _MARKERS},
}


def read_fields(path: Path) -> dict[str, object]:
    """The plain fields of the ``TrainingArguments`` pickled in ``path``.

    ``InputError`` naming the file when it cannot be read, is not a
    ``TrainingArguments`` or names a global outside ``GLOBALS``.
    """
    from gradclip_cli.source import load_checkpoint

    try:
        size = os.stat(path).st_size
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror or error}") from None
    if size > MAX_BYTES:
        raise InputError(f"{path}: {size} bytes is too large for a Trainer's arguments")
    try:
        with allowing(GLOBALS):
            root = load_checkpoint(path).root
    except UnsafeCheckpointError as error:
        named = re.search(r"\(it references ([^)]*)\)", str(error))
        culprit = f" ({named.group(1)})" if named else ""
        raise InputError(
            f"{path}: not read: it names a global outside the Trainer's "
            f"arguments{culprit}, which only full unpickling could build; "
            "gradclip never unpickles it"
        ) from None
    if not isinstance(root, TrainingArgumentsState):
        raise InputError(
            f"{path}: not a Trainer's TrainingArguments (holds a {type(root).__name__})"
        )
    return dict(root.fields)


def max_grad_norm(path: Path) -> float:
    """``max_grad_norm`` of the arguments in ``path``: the Trainer clips to it when > 0
    (``Trainer._inner_training_loop``: ``max_grad_norm is not None and > 0``; a NaN
    never is). An integer beyond float64's range is an ``InputError``: torch's
    ``clip_grad_norm_`` raises ``OverflowError`` on it, so no run trained with it."""
    value = read_fields(path).get("max_grad_norm")
    if not is_number(value):
        raise InputError(f"{path}: TrainingArguments has no numeric max_grad_norm")
    try:
        return float(value)
    except OverflowError:
        raise InputError(
            f"{path}: max_grad_norm is an integer too large for a float "
            f"({value.bit_length()} bits), which torch's clip_grad_norm_ refuses "
            "(OverflowError): no Trainer run clipped with these arguments"
        ) from None
