"""What every checkpoint source hands to the rest of gradclip.

Two kinds of source live under ``source/``:

* *files* (``source/files/``) read one file's bytes safely and give a
  ``Checkpoint``: the stored object, untouched;
* *layouts* (``source/layouts/``) know how one checkpoint is laid out across
  files and keys and give ``Contents``: named tensors (gradients, weights),
  the optimizer state, the step, and a description for the report. It is an
  inventory, read-only once handed over: a layout fills a ``Draft``
  (``source/layouts/draft.py``) and hands over what its ``finish()`` makes.

The layout contract (``Layout``, ``Contents``, ``StoredTensor``, ``Piece``,
and for a layout ``clip`` can write, ``WriteBack`` and its ``WriteBackPlan``)
is written out below; a new layout module follows it and adds one line to
``source/layouts/__init__.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import torch


@dataclass
class Checkpoint:
    """A loaded checkpoint file, untouched.

    ``root`` is the object as stored: a dict (possibly nested) for torch files,
    a flat ``{name: tensor}`` dict for safetensors. Tensors are memory-mapped
    where the format allows, so loading does not copy the file into memory.
    """

    path: Path
    format: str  # "torch-zip" | "torch-legacy" | "safetensors"
    root: Any
    metadata: dict[str, str] | None = None  # safetensors header metadata
    trusted_pickle: bool = False  # loaded with weights_only=False


@dataclass
class GradientSelection:
    """The gradient mapping found inside a checkpoint.

    ``key_path`` leads from ``Checkpoint.root`` to the mapping (``()`` when the
    whole file is the mapping). ``tensors`` holds the floating-point tensors in
    checkpoint order; ``skipped`` names entries that are tensors but not floating
    point (counted in the report, never touched).
    """

    key_path: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    skipped: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return ".".join(self.key_path)


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Piece:
    """One stored part of a tensor.

    ``offsets`` is where the piece starts in the full tensor (one index per
    dimension) and ``shape`` its extent; ``read()`` returns the piece's data
    with that shape, memory-mapped where the file format allows. ``read`` is
    called when the piece is measured and its result dropped afterwards, so a
    layout may read from disk there (a DCP chunk) or return a tensor it
    already holds (a mapped safetensors entry). ``file`` names where the bytes
    live, for messages and for giving mapped pages back. ``held`` is the
    data when the layout already holds it (a mapped tensor: ties between
    names are found among held pieces, and clip scales them in place).

    In a *flat* ``StoredTensor`` (see there) a piece is instead a range of
    the tensor's row-major flattening: ``offsets == (start,)``, ``shape ==
    (length,)``, and ``read()`` returns those ``length`` elements as 1-D.
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    file: Path | None = None
    held: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class StoredTensor:
    """A named tensor as a checkpoint stores it: in one piece or in several.

    The pieces tile the tensor exactly once: no gaps, no overlaps. A layout
    whose files hold a piece more than once (replicated DCP chunks, a
    parameter saved by every data-parallel rank) keeps one copy and drops the
    others, so every element counts once in every norm. Memory stays bounded
    by the largest piece: nothing here reads a piece until it is measured.

    ``shape``, ``dtype`` and ``numel()`` match a ``torch.Tensor``'s, so a
    report can describe a stored tensor without reading it.

    ``flat=True``: the pieces are 1-D ranges of the tensor's row-major
    flattening rather than N-d blocks, for layouts that store a parameter
    flattened and cut at arbitrary element boundaries (DeepSpeed ZeRO
    partitions a flat buffer of all parameters across ranks, so a 2-D
    weight may end in one rank's file and continue in the next). Norms need
    only the elements, so such pieces are measured as they are; ``read()``
    assembles them and gives the tensor its shape.
    """

    __slots__ = ("name", "shape", "dtype", "pieces", "flat")

    def __init__(self, name: str, shape: Iterable[int], dtype: torch.dtype,
                 pieces: Iterable[Piece], *, flat: bool = False):
        self.name = name
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.pieces = tuple(pieces)
        self.flat = flat

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor, file: Path | None = None) -> StoredTensor:
        """A tensor already at hand (loaded or mapped): one piece covering all of it."""
        shape = tuple(tensor.shape)
        piece = Piece((0,) * len(shape), shape, lambda: tensor, file, tensor)
        return cls(name, shape, tensor.dtype, (piece,))

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def held(self) -> torch.Tensor | None:
        """The tensor itself when it is one piece already at hand, else None."""
        if len(self.pieces) == 1 and self.pieces[0].shape == tuple(self.shape):
            return self.pieces[0].held
        return None

    def read(self) -> torch.Tensor:
        """The whole tensor: the single piece as stored, or the pieces assembled (a copy)."""
        if len(self.pieces) == 1 and self.pieces[0].shape == tuple(self.shape):
            return self.pieces[0].read()
        if self.flat:
            flat = torch.empty(self.numel(), dtype=self.dtype)
            for piece in self.pieces:
                start, = piece.offsets
                flat[start:start + piece.numel] = piece.read().reshape(-1)
            return flat.view(self.shape)
        out = torch.empty(self.shape, dtype=self.dtype)
        for piece in self.pieces:
            index = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.shape))
            out[index] = piece.read()
        return out

    def __repr__(self) -> str:
        flat = ", flat" if self.flat else ""
        return (f"StoredTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"pieces={len(self.pieces)}{flat})")


@dataclass(frozen=True)
class Derivation:
    """How one measured tensor's value follows from stored tensors: ``compute(*reads read)``,
    of ``shape``. ``scale``: the value is exactly ``scale * reads[0]``, so its norm is the
    stored tensor's norm scaled and nothing is copied (the identity: ``scale == 1``).
    Where every read has ``shape``, ``compute`` is elementwise (element ``i`` of the
    value depends on element ``i`` of each read alone): the measuring step may apply
    it to pieces. A transform that mixes elements reads tensors of other shapes
    (Adafactor's factored rows and columns).
    """

    reads: tuple[StoredTensor, ...]
    compute: Callable[..., torch.Tensor]
    shape: tuple[int, ...]
    scale: float | None = None

    @classmethod
    def stored(cls, tensor: StoredTensor) -> Derivation:
        """The stored tensor itself (gradients, weights)."""
        return cls((tensor,), lambda t: t, tuple(tensor.shape), 1.0)


@dataclass(frozen=True)
class OptimizerState:
    """A ``torch.optim.Optimizer.state_dict()`` (or a framework's equivalent), as stored.

    ``param_groups`` are the stored groups: each a dict with ``"params"`` (the
    parameter ids of the group, in the order the optimizer was given them)
    and the hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``...).
    ``state`` maps a parameter id to its per-parameter state: tensors as
    ``StoredTensor`` (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) and
    scalars as Python numbers or 0-dim tensors (``step``). ``param_names``
    maps ids to model names when the optimizer stored them (torch >= 2.6
    with named parameters; DeepSpeed's ``param_shapes``), else is None and
    ``source/what.py`` recovers the mapping from the model's order.
    ``file`` is where the state was read (for messages); ``key`` the ``--key`` that
    names this state alone (a file's top-level ``optimizer_d``), None where none does.
    """

    param_groups: list[dict[str, Any]]
    state: dict[int, dict[str, Any]]
    param_names: dict[int, str] | None = None
    file: Path | None = None
    key: str | None = None


def chained(states: list[OptimizerState], file: Path | None) -> tuple[OptimizerState,
                                                                      list[dict[int, int]]]:
    """Several optimizers' states as one, each one's ids renumbered after the last's.

    Their param groups follow one another, so the model's order maps them all
    at once (``source/naming.interleave``); ``param_names`` are kept where every
    state has them. Returns the state and, per input, its id -> new id.
    """
    groups: list[dict[str, Any]] = []
    state: dict[int, dict[str, Any]] = {}
    names: dict[int, str] | None = {}
    renumbered = []
    offset = 0
    for opt in states:
        ids = sorted({p for g in opt.param_groups for p in g["params"]})
        renumber = {p: offset + i for i, p in enumerate(ids)}
        offset += len(ids)
        groups += [{**g, "params": [renumber[p] for p in g["params"]]} for g in opt.param_groups]
        state.update((renumber[p], entry) for p, entry in opt.state.items())
        if names is not None and opt.param_names is not None:
            names.update((renumber[p], n) for p, n in opt.param_names.items())
        else:
            names = None
        renumbered.append(renumber)
    return OptimizerState(groups, state, names or None, file), renumbered


NOTHING: Mapping[str, Any] = MappingProxyType({})


def _frozen(mapping: Mapping | None) -> Mapping | None:
    """A read-only copy of ``mapping`` (the values are shared: lazy handles, not data)."""
    if mapping is None or isinstance(mapping, MappingProxyType):
        return mapping
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Contents:
    """What a layout found in a checkpoint: an inventory, read-only to everyone who reads it.

    A layout builds it once (``source/layouts/draft.py``'s ``Draft``) and hands it over;
    no field is assigned afterwards and no collection changes (sequences are tuples,
    mappings read-only views: ``dataclasses.replace`` gives another inventory). The
    tensors are ``StoredTensor`` handles: the mappings hold them, never their data.
    Every field a layout cannot fill stays empty.

    Attributes:
        path: the PATH the user gave.
        kind: what it is, for the report (``"hf-sharded"``, ``"hf-trainer"``,
            ``"lightning"``, ``"dcp"``, ``"deepspeed"``, or a file format).
        description: lines for the report header, each a plain sentence:
            the files read, and any limit on coverage ("covers shard
            model-00002-of-00003.safetensors only; the index is
            model.safetensors.index.json").
        files: every file the layout read (all inside the checkpoint's folder).
        gradients: saved gradients by name, in checkpoint order, or None.
        gradient_key: where the gradients were found (the ``--key`` path).
        skipped: names of non-floating-point entries next to the gradients.
        weights: the model's parameters by name, in the files' order, or None
            (the same mapping as ``gradients`` where one flat mapping is both).
        order: the model's parameter names in the model's order when the layout
            knows it: the weights' own order (torch state_dict order), or an order
            learned elsewhere (rebuilding the model from its config, a framework's
            parameter list); None when it does not (safetensors headers and HF
            indexes sort the names), in which case optimizer state without
            ``param_names`` cannot be mapped to names from the weights alone.
        optimizers: every optimizer state (Lightning can hold a list), the first
            also as ``optimizer``.
        step: the training step when the checkpoint records one.
        checkpoint: for a single-file source, the loaded file (clip writes it back).
        shards: for a set of files (HF sharded, DCP's Hugging Face layout),
            each file's loaded ``Checkpoint`` in index (or name) order, for
            clip to write back as a set.
        index: the index file of a set, when there is one (a DCP folder's ``.metadata``).
        folder: for a set of files, the folder that holds them, which clip
            writes back as a folder (an index's folder; DCP's Hugging Face
            layout has no index).
        shard_of: for one file of a set given alone (a shard an index lists, or
            whose name counts it one of several, a file of DCP's Hugging Face
            layout), the set's folder: its norms are
            that file's alone, which the report says, and which clip refuses to
            scale by (the set's total is another).
        trusted_pickle: some file was read with ``--trust-pickle``'s full unpickler.
        missing: why something a command may ask for is absent, for its message,
            keyed by role (``source/roles.py``): ``GRADIENT`` (why no gradients were
            found, for ``--what grads``), ``OPTIMIZER_STATE`` (why optimizer state the
            checkpoint holds is not read, for ``--what exp_avg`` and the rest), and
            ``PARAMETER_NAMES`` (why optimizer state keeps its parameter ids as names
            although the checkpoint holds the model: the layout's own cause, which
            ``what.named_by_id`` words in the report as it words every layout's).
        buffers: a model's buffers (running statistics, counters): never weights or
            gradients.
        evidence: role (``GRADIENT``, ``WEIGHT``, ``OPTIMIZER_STATE``) -> the evidence
            for it, for the report (``source/roles.py``): "a state_dict: torch's
            _metadata", "a 'grads' key".
        keyed: the role ``--key`` named (``WEIGHT``, ``OPTIMIZER_STATE``), which
            ``--what auto`` then measures. General: every layout that reads ``--key``
            below its top level can name an entry that is not gradients (a single
            file's and a DCP folder's do).
        fused_weights: weights under the optimizer's name for a parameter the model
            stores under other names (split into pieces, or beside an adapter), for
            ``ratio`` and for checking the optimizer's ``param_names`` against the
            model. General: any framework whose optimizer steps a parameter the
            checkpoint stores otherwise (torchtitan's fused ``wqkv``, torchtune's
            LoRA adapter) fills it.
        notes: lines of ``description`` every format carries, not the table and json
            alone: what ``--verify`` could not check (a file that stores no checksums).
        weights_of: whose weights ``weights`` are where they are not the model's (a
            LoRA adapter saved alone: "the LoRA adapter's"), for the report's account
            of what ``--what weights`` measured; "" for the model's.
    """

    path: Path
    kind: str
    description: tuple[str, ...] = ()
    files: tuple[Path, ...] = ()
    gradients: Mapping[str, StoredTensor] | None = None
    gradient_key: str = ""
    skipped: tuple[str, ...] = ()
    weights: Mapping[str, StoredTensor] | None = None
    order: tuple[str, ...] | None = None
    optimizers: tuple[OptimizerState, ...] = ()
    step: int | None = None
    checkpoint: Checkpoint | None = None
    shards: tuple[Checkpoint, ...] = ()
    index: Path | None = None
    folder: Path | None = None
    shard_of: Path | None = None
    trusted_pickle: bool = False
    missing: Mapping[str, str] = field(default_factory=lambda: NOTHING)
    buffers: Mapping[str, StoredTensor] | None = None
    evidence: Mapping[str, str] = field(default_factory=lambda: NOTHING)
    keyed: str | None = None
    fused_weights: Mapping[str, StoredTensor] = field(default_factory=lambda: NOTHING)
    notes: tuple[str, ...] = ()
    weights_of: str = ""

    def __post_init__(self) -> None:
        # Whatever built it (a layout's draft, ``dataclasses.replace``), its collections are
        # read-only: sequences as tuples, mappings as read-only copies. One flat mapping
        # that is both gradients and weights stays one.
        same = self.gradients is not None and self.gradients is self.weights
        for name in ("description", "files", "skipped", "optimizers", "shards", "notes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.order is not None:
            object.__setattr__(self, "order", tuple(self.order))
        for name in ("weights", "gradients", "missing", "buffers", "evidence", "fused_weights"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        if same:
            object.__setattr__(self, "gradients", self.weights)

    @property
    def optimizer(self) -> OptimizerState | None:
        return self.optimizers[0] if self.optimizers else None


class Layout(Protocol):
    """One checkpoint layout, as a module in ``source/layouts/`` provides it.

    ``KIND``: the ``Contents.kind`` it produces.

    ``recognises(path) -> bool``: look at content, never at a suffix alone:
    a folder's file names and a small JSON file's keys are content; reading
    a large file is not (recognition must stay cheap, and must not fail on
    paths of other kinds: return False, raise nothing). Layouts are tried in
    registry order and the first that recognises the path opens it.

    ``open(path, *, key, trust_pickle, verify) -> Contents``: read the
    checkpoint. Rules every layout keeps:

    * every file read comes from the registry's file readers
      (``source.load_checkpoint``), so the weights-only unpickler, the header
      checks and ``--verify`` apply to each file;
    * nothing outside the checkpoint's folder is read: a name taken from a
      file (an index's ``weight_map``, DCP's storage paths) is resolved and
      checked to stay inside the folder, symlinks included, before it is
      opened (``layouts.paths.inside``);
    * any inconsistency (a missing or truncated file, a tensor the index
      puts elsewhere, a name stored twice, a metadata file that is not what
      it claims) raises ``InputError`` with one line naming the file;
    * tensors are handed over as ``StoredTensor``: mapped, or as pieces read
      on demand, never all copied into memory at once; replicated pieces
      are kept once;
    * ``description`` says what was read and what is not covered;
    * the answer is built once and never changed afterwards, by the layout or
      anyone else (``Contents`` is frozen; a layout fills a ``Draft`` and
      returns ``draft.finish()``).

    ``write_back(contents) -> WriteBack``, for a layout that ``clip`` can
    write (a set of files; a single file needs none): which files are
    written and how, as data (``WriteBackPlan``), and the gradients clip
    scales in place where the layout holds them anew. It reads what it must
    (a chunk's bytes, where a blob keeps them), changes nothing of
    ``contents`` and writes nothing: the sink executes the plan.
    """

    KIND: str

    def recognises(self, path: Path) -> bool: ...

    def open(self, path: Path, *, key: str | None, trust_pickle: bool,
             verify: bool) -> Contents: ...


# --------------------------------------------------------------------------- write-back


@dataclass(frozen=True)
class StorageBytes:
    """A held gradient's storage inside a file that is copied (a DCP chunk's ``torch.save``
    blob): its ``nbytes`` bytes start at ``data_start`` (an absolute offset), and their
    CRC32 is kept at each of ``crc_positions``. Scaling changes values, not sizes, so
    the bytes are written over in place and the file keeps its length."""

    tensor: str
    data_start: int
    nbytes: int
    crc_positions: tuple[int, ...]


@dataclass(frozen=True)
class FileWrite:
    """One file that ``clip`` writes, named by its input ``path``.

    ``format``: written whole in this file format (``"torch-zip"``,
    ``"safetensors"``...) from the object loaded from it (``Contents.checkpoint``
    or one of ``Contents.shards``), whose held gradients clip changed in place;
    None: copied byte for byte, each of ``storages`` written over from its held
    gradient. ``tensors``: the held gradients the file holds. ``copies``:
    ``(entry, tensor)``, an entry of the file written from the held gradient
    ``tensor`` that another file holds too (a replicated piece, scaled once).
    """

    path: Path
    format: str | None
    tensors: tuple[str, ...] = ()
    copies: tuple[tuple[str, str], ...] = ()
    storages: tuple[StorageBytes, ...] = ()


@dataclass(frozen=True)
class WriteBackPlan:
    """How ``clip`` writes a checkpoint back, as plain data: the other half of a layout's
    ``open``, as pip-audit pairs a dependency source's ``collect()`` with its ``fix()``,
    and kept apart from the doing as ``torch.distributed.checkpoint`` keeps a
    ``SavePlan`` apart from its ``StorageWriter``. Paths, names and offsets only: a plan
    can be printed and compared without touching a file.

    ``folder``: a set written back as a new folder, every file of it not in
    ``files`` copied byte for byte (None: one file, replaced). ``files``: the
    files that hold gradients, which ranks under a launcher share (each writes
    the files it read). ``tensor_count``: the tensors the report counts where
    held gradients are pieces of them (None: one each). The sink executes it
    (``sink/write_back.py``'s ``execute``), knowing files and nothing of why.
    """

    folder: Path | None
    files: tuple[FileWrite, ...]
    tensor_count: int | None = None

    def copies(self, tensor: str) -> tuple[Path, ...]:
        """The other files holding the held gradient ``tensor`` too, written from it."""
        return tuple(f.path for f in self.files if any(t == tensor for _, t in f.copies))


@dataclass(frozen=True)
class WriteBack:
    """A layout's answer to ``write_back(contents)``: the ``plan``, and ``gradients``, the
    tensors clip scales in place where the layout holds them anew for clip, each a
    gradient of its own held in memory (a DCP folder's gradient chunks, a DCP Hugging
    Face set's pieces); None: ``contents.gradients`` themselves, already held. Nothing
    of ``contents`` changes: clip chooses from these gradients instead.
    ``layouts.write_back`` finds the layout (a single file needs none)."""

    plan: WriteBackPlan
    gradients: dict[str, StoredTensor] | None = None


def written_whole(checkpoints: Iterable[Checkpoint], gradients: Mapping[str, StoredTensor],
                  folder: Path | None = None) -> WriteBackPlan:
    """The plan for files written whole from what was loaded: one file (``folder`` None),
    or a set's shards; each lists the gradients whose first piece it holds."""
    files = tuple(FileWrite(Path(c.path), c.format, tuple(
        n for n, t in gradients.items()
        if folder is None or (t.pieces and t.pieces[0].file == Path(c.path))))
        for c in checkpoints)
    return WriteBackPlan(folder, files)


def stored(
    tensors: Mapping[str, torch.Tensor], file: Path | None = None
) -> dict[str, StoredTensor]:
    """``{name: tensor}`` as ``{name: StoredTensor}``, one piece each."""
    return {name: StoredTensor.whole(name, t, file) for name, t in tensors.items()}
