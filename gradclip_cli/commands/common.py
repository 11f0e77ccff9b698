"""Steps the commands share: loading the gradients, measuring them, emitting a report."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from ..core import Elements, PowerSums, distinct_elements, tensor_power_sums
from ..distributed import launcher
from ..errors import UsageError
from ..format import FORMATS
from ..format.text import visible
from ..progress import Steps
from ..sink import atomic_write
from ..source import Checkpoint, load_checkpoint, select_gradients
from ..source.files.pages import PageReleaser

# torch's intra-op threads become gradclip's own workers (see tensor_power_sums).
WORKERS = torch.get_num_threads()
torch.set_num_threads(1)


@dataclass
class Loaded:
    checkpoint: Checkpoint
    key: str
    names: list[str]  # without tie duplicates
    tensors: list[torch.Tensor]
    ties: dict[str, list[str]]
    skipped: list[str]
    elements: Elements  # the distinct elements of ``tensors``
    key_path: tuple[str, ...] = ()

    @property
    def shares(self) -> list[list[str]]:
        """For each tensor, the other tensors holding some of its elements."""
        return [[self.names[j] for j in others] for others in self.elements.shares]


def output_format(name: str):
    """The format module for ``--format NAME``; UsageError if there is none."""
    if name not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


def load(path: Path, key: str | None, trust_pickle: bool, verify: bool, steps: Steps) -> Loaded:
    """Read ``path`` and pick its gradients; tied names are folded into their first name.

    Tied means holding exactly the same storage elements, whatever the view
    (``m`` and ``m.t()``); tensors sharing only some elements keep their own
    rows and count each shared element once (core/elements.py).
    """
    steps.begin("loading")
    ckpt = load_checkpoint(path, trust_pickle=trust_pickle, verify=verify)
    if ckpt.trusted_pickle and speaks():
        print(f"gradclip: warning: {visible(str(path))}: loaded with --trust-pickle "
              "(full unpickling; code in the file may have run)", file=sys.stderr)
    selection = select_gradients(ckpt.root, key, path=path)
    all_names = list(selection.tensors)
    all_tensors = list(selection.tensors.values())
    everything = distinct_elements(all_tensors)
    ties: dict[str, list[str]] = {}
    for i, o in enumerate(everything.tie_of):
        if o != i:
            ties.setdefault(all_names[o], []).append(all_names[i])
    keep = [i for i, o in enumerate(everything.tie_of) if o == i]
    tensors = [all_tensors[i] for i in keep]
    elements = everything if len(keep) == len(all_tensors) else distinct_elements(tensors)
    return Loaded(ckpt, selection.key, [all_names[i] for i in keep], tensors, ties,
                  list(selection.skipped), elements, tuple(selection.key_path))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def speaks() -> bool:
    """Whether this process prints: always, except ranks other than 0 under a launcher."""
    session = launcher.current()
    return session is None or session.primary


def measure(loaded: Loaded, p: float, device: torch.device, steps: Steps, label: str,
            release: PageReleaser | None = None, session: launcher.Session | None = None
            ) -> tuple[PowerSums, PowerSums]:
    """Power sums of each tensor's own elements and of the elements it owns
    (``core.element_power_sums``), with progress and page release.

    Every distinct element is read once: the pieces of ``Loaded.elements``.
    With a ``session`` (under a launcher) each rank reads and measures its own
    pieces and every rank gets all of them back, in the single-process order.
    """
    pieces, rows = loaded.elements.measured()
    mine = list(range(len(pieces)))
    if session is not None:
        from ..distributed.pieces import assign, owned

        owners = assign([nbytes([t]) for t in pieces], session.world_size)
        mine = owned(owners, session.rank)
    work = [pieces[i] for i in mine]
    steps.begin(label, total=nbytes(work))

    def done(batch) -> None:
        steps.advance(nbytes(batch))
        if release is not None:
            release.release(batch)

    sums = tensor_power_sums(work, p, device=device, on_batch=done, workers=WORKERS)
    if session is not None:
        from ..distributed.combine import gather_power_sums

        sums = gather_power_sums(session, sums, mine, len(pieces))
    n = len(loaded.elements)
    return sums.take(torch.tensor(rows, dtype=torch.int64)), sums.take(torch.arange(n))


def emit(write: Callable[[TextIO], None], output_file: Path | None) -> None:
    """Send a rendered report to stdout, or atomically to ``--output-file`` (rank 0 alone)."""
    if not speaks():
        return
    if output_file is None:
        write(sys.stdout)
        return
    buffer = io.StringIO()
    write(buffer)
    data = buffer.getvalue().encode("utf-8")
    atomic_write(Path(output_file), lambda file: file.write(data))
