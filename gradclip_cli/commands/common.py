"""Steps the commands share: loading a checkpoint and measuring what ``--what`` chose
(``commands/output.py`` sends the report)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import measuring
from ..core import Elements, distinct_elements
from ..distributed import launcher
from ..errors import GradclipError, InputError, UsageError
from ..format.text import visible
from ..measuring import Measurement
from ..progress import Steps
from ..report.tag import TagRead
from ..sink.unshared import unshare_other_entries
from ..source import Checkpoint, packed_dtype, roles
from ..source.files.pages import PageReleaser
from ..source.files.small_file import quoted
from ..source.interface import Contents, WriteBackPlan
from ..source.layouts import open_checkpoint, write_back
from ..source.run_inputs import Input
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
    # clip: the other entries that shared storage with a gradient, given their own copy
    unshared: list[str] = field(default_factory=list)

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

    def held_tensors(self) -> list[torch.Tensor]:
        """The tensors themselves, for changing them in place (clip)."""
        held = [t.held for t in self.selection.tensors]
        if any(h is None for h in held):
            raise InputError(f"{self.contents.path}: clip needs every gradient "
                             "in one piece; this checkpoint stores some in several")
        return held


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
    try:
        contents = open_checkpoint(path, key=key, trust_pickle=trust_pickle, verify=verify)
    except roles.KeyNotGradients as error:
        if not gradients_only:
            raise  # inspect's remedy: the entry measured whole
        raise InputError(f"{error.refusal}; {_clippable(path, trust_pickle, verify)}") from None
    if contents.trusted_pickle and speaks():
        print(f"gradclip: warning: {visible(str(path))}: loaded with --trust-pickle "
              "(full unpickling; code in the file may have run)", file=sys.stderr)
    named = contents.missing.get(roles.GRADIENT)
    if gradients_only and contents.keyed is not None and named:
        # --key names the weights or an optimizer's state whole: inspect measures them.
        raise InputError(f"{named}; {_clippable(path, trust_pickle, verify)}").noting(
            contents.notes)
    try:
        selection = select(contents, what, gradients_only=gradients_only)
    except GradclipError as error:
        error.noting(contents.notes)  # what --verify could not check: the failure says it
        raise
    elements = None
    held = [t.held for t in selection.tensors]
    if selection.what == "grads" and all(h is not None for h in held):
        # Finding the ties computed them already, unless ties were dropped.
        elements = selection.elements if selection.elements is not None else \
            distinct_elements(held)
    return Loaded(contents, selection, elements)


def _clippable(path: Path, trust_pickle: bool, verify: bool) -> str:
    """What clip can clip in the checkpoint at ``path``, as a refusal of a ``--key`` that
    names no gradients ends: the ``--key`` of the saved gradients that the contract's
    default rule finds there, else none (clip never offers weights or optimizer state)."""
    try:
        contents = open_checkpoint(path, key=None, trust_pickle=trust_pickle, verify=verify)
        found = select(contents, "grads", gradients_only=True).key
    except InputError:
        return "clip changes saved gradients only; available: none (no saved gradients found)"
    offer = f"--key {shlex.quote(found)}" if found else "the same command without --key"
    return f"clip changes saved gradients only; available: {offer}"


def load_for_writing(path: Path, key: str | None, trust_pickle: bool, verify: bool,
                     steps: Steps, what: str) -> Loaded:
    """``load`` for clip, which changes gradients in place and writes them back: with its
    layout's write-back plan (``layouts.write_back``), every gradient held in one piece,
    and every other entry that shares storage with one given its own copy
    (``sink/unshared.py``).

    Where the layout holds its gradients anew for clip, each a gradient of its
    own that clip scales in place and the sink writes back where it was (a DCP
    set's chunk by chunk, its Hugging Face layout's piece by piece), those are
    chosen; other checkpoints keep what ``load`` chose."""
    loaded = load(path, key, trust_pickle, verify, steps, what, gradients_only=True)
    back = write_back(loaded.contents)
    if back is not None and back.gradients is not None:
        contents = dataclasses.replace(loaded.contents, gradients=back.gradients)
        selection = select(contents, "grads", gradients_only=True)
        loaded = Loaded(contents, selection,
                        distinct_elements([t.held for t in selection.tensors]))
    loaded.write_back = None if back is None else back.plan
    loaded.unshared = unshare_other_entries(loaded.checkpoint, loaded.key,
                                            loaded.held_tensors())
    return loaded


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


def measure(loaded: Loaded, p: float, device: torch.device, steps: Steps, label: str,
            release: PageReleaser | Releasers | None = None,
            session: launcher.Session | None = None, files: dict[str, int] | None = None,
            weights: bool = False) -> Measurement:
    """``measuring.measure`` of what ``load`` chose, with progress and page release.

    ``files`` (held gradients only): the rank that reads each file, by name,
    where the split under a launcher must follow files (clip of a set writes
    each shard from the rank that read it) rather than bytes. ``weights``:
    also the measured names' weights (``ratio``), where all are held.
    """
    for tensor in loaded.selection.tensors:
        if (packed := packed_dtype(tensor.dtype)) is not None:
            where = tensor.pieces[0].file if tensor.pieces else None
            raise InputError(f"{where or loaded.contents.path}: {quoted(tensor.name)} "
                             f"is {packed}")
    owners = None if files is None or loaded.elements is None else \
        _piece_owners(loaded, files)
    return measuring.measure(loaded.selection, p, device, elements=loaded.elements,
                             owners=owners, progress=steps, label=label, release=release,
                             session=session, weights=weights, workers=WORKERS)


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


def tag_read(inputs: list[Input]) -> TagRead | None:
    """The tag ``--tag`` named, where some inputs are its values (``trend``'s and the
    autopsy's); None where none is.

    A tag whose name is no gradient norm's (``train/loss``) beside other inputs
    (checkpoints, a monitor log) would be judged with gradient norms as one
    run's: exit 2, as two quantities are (``report.trend.OneKind``).
    """
    tagged = [i for i in inputs if i.tracker is not None and i.tracker.given]
    if not tagged:
        return None
    read = TagRead(tagged[0].tracker.tag, tagged[0].tracker.named_as_norm,
                   tuple(str(i.path) for i in tagged))
    others = [i for i in inputs if i.tracker is None or not i.tracker.given]
    if others and not read.named_as_norm:
        raise UsageError(f"{tagged[0].path}: tag {quoted(read.name)} (given with --tag) is "
                         f"no gradient norm by its name, but {others[0].path} is read with "
                         "it as one run's norms; one quantity at a time: give the tag's "
                         "file alone")
    return read
