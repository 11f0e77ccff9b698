"""Steps the commands share: loading the gradients, measuring them, emitting a report."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from .. import values
from ..core import Elements, PowerSums, distinct_elements, tensor_power_sums
from ..distributed import launcher
from ..errors import InputError
from ..format import FORMATS
from ..format.text import visible
from ..measuring import power_sums, stored_power_sums
from ..progress import Steps
from ..sink.atomic import Staged, stage
from ..source import Checkpoint
from ..source.files.pages import PageReleaser
from ..source.interface import Contents, WriteBackPlan
from ..source.layouts import open_checkpoint
from ..source.what import Selection, select

# torch's intra-op threads become gradclip's own workers (see tensor_power_sums).
WORKERS = torch.get_num_threads()
torch.set_num_threads(1)


@dataclass
class Loaded:
    """An opened checkpoint and what ``--what`` chose from it.

    ``elements``: the distinct storage elements of the chosen tensors
    (core/elements.py), where they are gradients held whole in memory (a
    single file, a mapped shard); None where they are read piece by piece or
    derived from optimizer state, which share no storage once read.
    """

    contents: Contents
    selection: Selection
    elements: Elements | None = None
    write_back: WriteBackPlan | None = None  # clip: how the layout writes it back

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self.contents.checkpoint

    @property
    def key(self) -> str:
        return self.selection.key

    @property
    def names(self) -> list[str]:  # without tie duplicates
        return self.selection.names

    @property
    def tensors(self) -> list:
        """The stored tensors (``StoredTensor``: shape, dtype, numel, pieces)."""
        return self.selection.tensors

    @property
    def ties(self) -> dict[str, list[str]]:
        return self.selection.ties

    @property
    def skipped(self) -> list[str]:
        return self.selection.skipped

    @property
    def shares(self) -> list[list[str]]:
        """For each tensor, the other tensors holding some of its elements."""
        if self.elements is None:
            return [[] for _ in self.names]
        return [[self.names[j] for j in others] for others in self.elements.shares]

    def counts(self) -> tuple[list[int], list[int]]:
        """Distinct elements each tensor covers, and those it holds first (owns)."""
        if self.elements is None:
            counts = [t.numel() for t in self.tensors]
            return counts, counts
        e = self.elements
        return [e.count(i) for i in range(len(e))], [piece.numel() for piece in e.owned]

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors themselves, for changing them in place (clip)."""
        held = [t.held for t in self.selection.tensors]
        if any(h is None for h in held):
            raise InputError(f"{visible(str(self.contents.path))}: clip needs every gradient "
                             "in one piece; this checkpoint stores some in several")
        return held


def output_format(name: str):
    """The format module for ``--format NAME``; UsageError if there is none."""
    return FORMATS[values.word("--format", name, tuple(FORMATS))]


def load(path: Path, key: str | None, trust_pickle: bool, verify: bool, steps: Steps,
         what: str = "auto", *, gradients_only: bool = False) -> Loaded:
    """Open ``path`` (any layout) and choose what ``--what`` measures.

    Tied names (holding exactly the same storage elements, whatever the view:
    ``m`` and ``m.t()``) are folded into their first name; gradients held in
    memory that share only some elements keep their own rows and count each
    shared element once (core/elements.py). ``gradients_only``: clip, which
    changes gradients and nothing else.
    """
    steps.begin("loading")
    contents = open_checkpoint(path, key=key, trust_pickle=trust_pickle, verify=verify)
    if contents.trusted_pickle and speaks():
        print(f"gradclip: warning: {visible(str(path))}: loaded with --trust-pickle "
              "(full unpickling; code in the file may have run)", file=sys.stderr)
    selection = select(contents, what, gradients_only=gradients_only)
    elements = None
    held = [t.held for t in selection.tensors]
    if selection.what == "grads" and all(h is not None for h in held):
        # Finding the ties computed them already, unless ties were dropped.
        elements = selection.elements if selection.elements is not None else \
            distinct_elements(held)
    return Loaded(contents, selection, elements)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.dtype.itemsize for t in tensors)


class Releasers:
    """Page release for every file a checkpoint was read from (see ``PageReleaser``)."""

    def __init__(self, files):
        self._releasers = [PageReleaser(Path(f)) for f in files]

    def release(self, tensors) -> None:
        for releaser in self._releasers:
            releaser.release(tensors)


def speaks() -> bool:
    """Whether this process prints: always, except ranks other than 0 under a launcher."""
    session = launcher.current()
    return session is None or session.primary


def _shared(sizes: list[int], session: launcher.Session | None, run,
            owners: list[int] | None = None) -> PowerSums:
    """``run(indices)`` over all pieces, or under a launcher over this rank's share of them
    (split by bytes, or as ``owners`` says), every rank getting all of them back in the
    single-process order."""
    if session is None:
        return run(None)
    from ..distributed.combine import gather_power_sums
    from ..distributed.pieces import assign, owned

    if owners is None:
        owners = assign(sizes, session.world_size)
    mine = owned(owners, session.rank)
    return gather_power_sums(session, run(mine), mine, len(sizes))


def measure(loaded: Loaded, p: float, device: torch.device, steps: Steps, label: str,
            release: PageReleaser | Releasers | None = None,
            session: launcher.Session | None = None,
            files: dict[str, int] | None = None) -> tuple[PowerSums, PowerSums]:
    """Power sums of each tensor's own elements and of the elements it owns
    (``core.element_power_sums``), with progress and page release.

    Every distinct element is read once: the pieces of ``Loaded.elements``.
    With a ``session`` (under a launcher) each rank reads and measures its own
    pieces and every rank gets all of them back, in the single-process order.
    ``files`` (held gradients only): the rank that reads each file, by name,
    where the split must follow files (clip of a set writes each shard from
    the rank that read it) rather than bytes.
    """
    if loaded.elements is not None:
        owners = None if files is None else _piece_owners(loaded, files)
        return _measure_elements(loaded.elements, p, device, steps, label, release, session,
                                 owners)
    selection = loaded.selection

    def run(only):
        steps.begin(label, total=selection.bytes_to_read(only))

        def done(batch) -> None:
            steps.advance(nbytes(batch))
            if release is not None:
                release.release(batch)

        chosen = selection.derivations if only is None else \
            [selection.derivations[i] for i in only]
        return power_sums(chosen, p, device, done, WORKERS)

    # Read piece by piece or derived from optimizer state: no two rows share
    # an element, so each tensor owns all of its own.
    sums = _shared(selection.read_sizes(), session, run)
    return sums, sums


def _measure_elements(elements: Elements, p: float, device: torch.device, steps: Steps,
                      label: str, release, session: launcher.Session | None,
                      owners: list[int] | None = None) -> tuple[PowerSums, PowerSums]:
    """``measure`` over held gradients: every distinct element is read once."""
    pieces, rows = elements.measured()

    def done(batch) -> None:
        steps.advance(nbytes(batch))
        if release is not None:
            release.release(batch)

    def run(only):
        work = pieces if only is None else [pieces[i] for i in only]
        steps.begin(label, total=nbytes(work))
        return tensor_power_sums(work, p, device=device, on_batch=done, workers=WORKERS)

    sums = _shared([nbytes([t]) for t in pieces], session, run, owners)
    n = len(elements)
    return sums.take(torch.tensor(rows, dtype=torch.int64)), sums.take(torch.arange(n))


def tensor_owners(loaded: Loaded, files: dict[str, int]) -> list[int]:
    """The rank of each tensor of ``loaded``: the rank that reads its file (``files``, by
    ``set_member`` name in the set's folder)."""
    return [files[_member(loaded, t.pieces[0].file)] for t in loaded.tensors]


def tensor_writers(loaded: Loaded, files: dict[str, int]) -> list[set[int]]:
    """The ranks that write each tensor of ``loaded`` (``files``): its own file's, and
    for a piece that other files hold too (``WriteBackPlan.copies``), theirs."""
    writers = []
    back = loaded.write_back
    for t, rank in zip(loaded.tensors, tensor_owners(loaded, files)):
        copies = back.copies(t.name) if back is not None else ()
        writers.append({rank, *(files[_member(loaded, c)] for c in copies)})
    return writers


def _member(loaded: Loaded, file: Path | str) -> str:
    from ..sink.sharded_set import set_member

    return set_member(file, loaded.write_back.folder)


def _piece_owners(loaded: Loaded, files: dict[str, int]) -> list[int]:
    """The rank of each measured piece of ``loaded.elements``: the rank of its tensor's file.

    Measured positions ``0 .. n-1`` are tensor ``i``'s own elements, later ones
    the gathered coverage of each tensor that has one, in tensor order
    (``Elements.measured``). Tensors in different files share no storage.
    """
    owners = tensor_owners(loaded, files)
    owners += [owners[i] for i, c in enumerate(loaded.elements.covered) if not isinstance(c, int)]
    return owners


def measure_weights(loaded: Loaded, p: float, device: torch.device,
                    release: Releasers | None = None,
                    session: launcher.Session | None = None) -> PowerSums | None:
    """Power sums of the weights of the measured names (for ``ratio``), where all are held."""
    weights = loaded.selection.weights
    if not weights or any(w is None for w in weights):
        return None
    on_batch = release.release if release is not None else None

    def run(only):
        chosen = weights if only is None else [weights[i] for i in only]
        return stored_power_sums(chosen, p, device, on_batch, WORKERS)

    return _shared([w.nbytes for w in weights], session, run)


class _Drawn(io.StringIO):
    """A report drawn in memory as it would be on ``stream``: it answers ``isatty``,
    ``fileno`` and ``encoding`` as the stream does, so a table gets the terminal's width
    and colours, and a JSON document its indentation, exactly as if drawn there."""

    def __init__(self, stream: TextIO):
        super().__init__()
        self._stream = stream

    def isatty(self) -> bool:
        try:
            return self._stream.isatty()
        except (AttributeError, OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"


@dataclass
class Pending:
    """A report drawn in full and not yet delivered: for stdout its text, for
    ``--output-file`` a staged file (``sink.atomic.Staged``).

    Commands draw the report first, then write what else they write (clip's
    checkpoint, trend's plot), then ``deliver``: drawing cannot fail once
    something is written, so no command writes an output and then exits
    non-zero over its report."""

    text: str
    staged: Staged | None = None
    verdict: str | None = None

    def deliver(self) -> None:
        """Stdout gets the report; with ``--output-file`` the file does, and stderr the
        verdict line, so a CI job's log says why it failed (or that it passed)."""
        if self.staged is None:
            sys.stdout.write(self.text)
            sys.stdout.flush()
            return
        self.staged.commit()
        if self.verdict is not None:
            print(f"gradclip: {self.verdict}", file=sys.stderr)

    def discard(self) -> None:
        if self.staged is not None:
            self.staged.discard()


def prepare(write: Callable[[TextIO], None], output_file: Path | None,
            verdict: str | None = None) -> Pending | None:
    """Draw a report for stdout, or stage it for ``--output-file`` (rank 0 alone: None
    elsewhere); ``Pending.deliver`` sends it. ``verdict``: the report's one-line
    verdict (``format/words.py``, names made visible there), which a report sent to a
    file also prints on stderr."""
    if not speaks():
        return None
    if output_file is None:
        drawn = _Drawn(sys.stdout)
        write(drawn)
        return Pending(drawn.getvalue())
    buffer = io.StringIO()
    write(buffer)
    data = buffer.getvalue().encode("utf-8")
    return Pending("", stage(Path(output_file), lambda file: file.write(data)), verdict)


def emit(write: Callable[[TextIO], None], output_file: Path | None,
         verdict: str | None = None) -> None:
    """Send a rendered report to stdout, or atomically to ``--output-file`` (rank 0 alone;
    ``verdict`` then on stderr too)."""
    pending = prepare(write, output_file, verdict)
    if pending is not None:
        pending.deliver()
