"""``torch.distributed.checkpoint`` (DCP) folders: ``.metadata`` plus ``__R_N.distcp`` files.

Recognised by content: a folder holding ``.metadata``, or that file given
itself (a pickle of DCP's ``Metadata``). The folder is read and checked by
``dcp_folder``, the building block every DCP-based layout shares; this
layout says what a plain ``dcp.save`` of a training script's state holds:
the model under one of ``WEIGHT_KEYS`` (``get_state_dict``'s ``model``),
the optimizer under one of ``OPTIMIZER_KEYS`` (or Lightning's
``optimizer_0``, ``optimizer_1``...), saved gradients under ``grads`` (the
``--key`` rule), the step under ``step`` or ``global_step``.

A ``.distcp`` data file given alone is refused naming its folder: only the
``.metadata`` beside it says where each tensor's bytes lie (``data_file_alone``);
so are data files whose folder lost its ``.metadata`` (``index_missing``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import roles
from gradclip_cli.source.interface import Contents, OptimizerState, StoredTensor, WriteBack
from gradclip_cli.source.locate import GRADIENT_KEYS
from gradclip_cli.source.vocabulary import OPTIMIZER_KEYS, STEP_KEYS, WEIGHT_KEYS

from .dcp_folder import (
    METADATA_NAME,
    DcpFolder,
    hold_gradient_chunks,
    read_folder,
    read_metadata,
    recognises,
    renamed,
)
from .dcp_frameworks import fqn_optimizer
from .draft import Draft
from .facts import ENTRY, KEY, UNMARKED, Found, NotGradients, wording

__all__ = ["KIND", "SAID", "fill_gradients", "first_under", "holds_optimizer_state",
           "model_weights", "open", "open_as", "optimizer", "optimizer_tops", "recognises",
           "write_back"]

KIND = "dcp"
SAID = "a DCP checkpoint"  # how the report's evidence names the layout
_STEP_KEYS = STEP_KEYS
_LIGHTNING_OPTIMIZER = re.compile(r"optimizer_\d+")


_DATA_SUFFIX = ".distcp"  # torch's FileSystemWriter names its data files __R_N.distcp


def index_missing(path: Path) -> str | None:
    """Why a folder of DCP data files (or one of them) without the ``.metadata`` that
    indexes them cannot be read: only that index says which tensor's bytes lie where (an
    interrupted save writes it last; a copy by ``*`` leaves the hidden file behind). None
    where the folder has its index, or holds no such file."""
    given_file = not os.path.isdir(path)
    if given_file and not path.name.endswith(_DATA_SUFFIX):
        return None  # every file opened comes here: no listing for the others
    folder = path.parent if given_file else path
    if os.path.lexists(folder / METADATA_NAME):
        return None
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(_DATA_SUFFIX))
    except OSError:
        return None
    if not names or (given_file and path.name not in names):
        return None
    held = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    return (f"{path}: torch.distributed.checkpoint data files ({held}) with no "
            f"{METADATA_NAME} beside them, the index that says where each tensor lies in "
            "them: they cannot be read without it (a save that did not finish, or a copy "
            f"that left the hidden {METADATA_NAME} behind)")


def data_file_alone(path: Path) -> str | None:
    """Why a DCP data file given alone cannot be read: its folder's ``.metadata`` (the
    index) lists it as one of its storage files, and only that index says where each
    tensor's bytes lie in it. None for any other file."""
    missing = index_missing(path)
    if missing is not None:
        return missing
    meta_file = path.parent / METADATA_NAME
    if path.name == METADATA_NAME or not recognises(meta_file):
        return None
    try:
        meta = read_metadata(meta_file)
    except InputError:
        return None
    if not any(location.relative_path == path.name for location in meta.locations.values()):
        return None
    return (f"{path}: one data file of the torch.distributed.checkpoint folder "
            f"{path.parent}, readable only through its index {meta_file}; give the folder: "
            f"{path.parent}")


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    return open_as(path, SAID, key=key, trust_pickle=trust_pickle, verify=verify).finish()


def open_as(path: Path, said: str, *, key: str | None, trust_pickle: bool,
            verify: bool) -> Draft:
    """``open``, the evidence naming the layout as ``said`` (a Lightning sharded folder is
    a DCP folder with ``meta.pt``)."""
    folder = read_folder(path, verify=verify, trust_pickle=trust_pickle)
    contents = Draft(path=path, kind=KIND, files=folder.files, index=folder.metadata_file,
                     folder=folder.folder, trusted_pickle=folder.trusted)
    for top in WEIGHT_KEYS:
        contents.weights = folder.under(top) or None
        if contents.weights:
            contents.say(wording(Found(roles.WEIGHT, ENTRY, (top,), said)))
            break
    fill_gradients(contents, folder, key, said)
    # A --key that names the model or an optimizer measures that alone (the --key rule).
    tops = optimizer_tops(folder) if contents.keyed is None else []
    for name in tops:
        contents.optimizers.append(optimizer(folder, name))
    if tops:
        contents.say(wording(Found(roles.OPTIMIZER_STATE, ENTRY, tuple(tops), said)))
    for k, p in folder.paths.items():
        if len(p) == 1 and p[0] in _STEP_KEYS:
            contents.step = folder.step(k)
            break
    held = [what for what, there in (("weights", contents.weights),
                                     ("gradients", contents.gradients),
                                     ("optimizer state", contents.optimizers)) if there]
    step = f" at step {contents.step}" if contents.step is not None else ""
    contents.description.append(
        f"DCP checkpoint{step}: {len(folder.tensors)} tensors, {folder.chunk_count} chunks, "
        f"{len(folder.files) - 1} files; {', '.join(held) or 'no tensors gradclip reads'}")
    return contents


def first_under(folder: DcpFolder, tops) -> dict[str, StoredTensor] | None:
    """The tensors under the first of ``tops`` that holds any (``DcpFolder.under``), or None."""
    for top in tops:
        found = folder.under(top)
        if found:
            return found
    return None


def model_weights(folder: DcpFolder) -> dict[str, StoredTensor] | None:
    """The model's weights in a folder that holds only a model: the tensors under the first
    of ``WEIGHT_KEYS`` that holds any, else a flat name -> tensor state dict's
    floating-point tensors (accelerate's ``pytorch_model_fsdp_0/``)."""
    found = first_under(folder, WEIGHT_KEYS)
    if found is None and folder.tensors and all(len(p) == 1 for p in folder.paths.values()):
        found = {n: renamed(t, n) for n, t in folder.tensors.items()
                 if t.dtype.is_floating_point or t.dtype.is_complex} or None
    return found


def fill_gradients(contents: Draft, folder: DcpFolder, key: str | None,
                   said: str = SAID) -> None:
    """The gradients of ``folder`` by the ``--key`` rule: everything under ``--key``, else
    the one of ``GRADIENT_KEYS`` present, else a flat name -> tensor state dict; the
    evidence names the layout as ``said``."""
    meta_file, paths, tensors = folder.metadata_file, folder.paths, folder.tensors
    if key is not None and _named(contents, folder, key, said):
        return
    if key is not None:
        wanted = [part for part in key.split(".") if part]
        found = {}
        for k, p in paths.items():
            dotted = [str(part) for part in p]
            # A path part may hold dots itself ("0.weight"): compare dotted names.
            full = ".".join(dotted)
            prefix = ".".join(wanted)
            if k in tensors and full.startswith(prefix + ".") and full != prefix:
                found[full[len(prefix) + 1:]] = tensors[k]
        if not found:
            raise InputError(f"{meta_file}: --key '{key}': no tensors under it "
                             f"(top-level keys: {_tops(paths)})")
        _set_gradients(contents, found, ".".join(wanted), meta_file)
        contents.say(wording(Found(roles.GRADIENT, KEY, (key,), said)))
        return
    present = [g for g in GRADIENT_KEYS if any(p[0] == g and len(p) > 1 for p in paths.values())]
    if len(present) == 1:
        found = {".".join(map(str, p[1:])): tensors[k] for k, p in paths.items()
                 if p[0] == present[0] and len(p) > 1 and k in tensors}
        _set_gradients(contents, found, present[0], meta_file)
        contents.say(wording(Found(roles.GRADIENT, ENTRY, (present[0],), said)))
        return
    if all(len(p) == 1 for p in paths.values()) and tensors:
        # A flat name -> tensor state dict: the --key rule's "whole file" (and the model).
        _set_gradients(contents, dict(tensors), "", meta_file)
        contents.weights = contents.gradients
        contents.say(wording(Found(roles.GRADIENT, UNMARKED, (), said,
                                   "a flat name -> tensor state dict")))
        return
    why = "several gradient entries" if present else "no gradients"
    candidates = present or _candidate_tops(folder)
    hint = (f"; candidates for --key: {', '.join(candidates)}"
            if candidates else "")
    contents.missing[roles.GRADIENT] = f"{meta_file}: {why} (top-level keys: {_tops(paths)}){hint}"


def _named(contents: Draft, folder: DcpFolder, key: str, said: str) -> bool:
    """``--key`` naming an optimizer's state or the model's weights: taken as such, never
    as gradients (True), as ``single_file`` does for one file."""
    top = ".".join(part for part in key.split(".") if part)
    for node, whole in _wholes(folder):
        entry = ".".join(node)
        relation = ("lies inside" if top.startswith(entry + ".") else
                    "holds" if entry.startswith(top + ".") else
                    "names" if entry == top and len(node) > 1 else None)
        if relation is not None:
            raise roles.not_gradients(str(folder.metadata_file), key, relation, entry, whole,
                                      measured_whole=len(node) == 1)
    shown = visible(key)
    if holds_optimizer_state(folder, top):
        contents.optimizers = [optimizer(folder, top)]
        contents.keyed = roles.OPTIMIZER_STATE
        contents.say(wording(Found(roles.OPTIMIZER_STATE, KEY, (key,), said),
                             NotGradients(folder.metadata_file, roles.OPTIMIZER_STATE, key=key)))
        return True
    weights = folder.under(top)
    evidence = roles.weight_evidence(weights) if weights else None
    if evidence is None and weights and top in WEIGHT_KEYS:
        evidence = f"the {shown!r} entry, where scripts keep the model"
    if evidence is None:
        return False
    contents.weights = weights
    contents.keyed = roles.WEIGHT
    contents.say(wording(Found(roles.WEIGHT, KEY, (key,), said, evidence),
                         NotGradients(folder.metadata_file, roles.WEIGHT, evidence, key=key)))
    return True


def _wholes(folder: DcpFolder) -> list[tuple[tuple[str, ...], str]]:
    """The entries a ``--key`` may name only whole, at any depth, outermost first, each
    with what it is: optimizers' state dicts (``state`` and ``param_groups`` beside each
    other; flattened ones at the top level) and models' weights (an entry of
    ``WEIGHT_KEYS``, or a top-level one with evidence). torch's DCP tutorial saves
    ``{"app": {"model": ..., "optim": ...}}``: one level down."""
    inner = {tuple(map(str, p[:d])) for p in folder.paths.values() for d in range(1, len(p))}
    found = {}
    for node in inner:
        if (node + ("state",) in inner and node + ("param_groups",) in inner
                or len(node) == 1 and holds_optimizer_state(folder, node[0])):
            found[node] = "an optimizer's state dict (state and param_groups)"
        elif node[-1] in WEIGHT_KEYS and node[0] not in GRADIENT_KEYS:
            found[node] = f"a model's weights (the {node[-1]!r} entry, where scripts keep " \
                "the model)"
    for node in inner:
        # Evidence in the tensors' names (buffers) speaks for a top-level entry only when
        # it holds no model or optimizer of its own: else they are what the names show.
        if len(node) == 1 and node not in found and not any(n[0] == node[0] for n in found):
            evidence = roles.weight_evidence(folder.under(node[0]))
            if evidence is not None:
                found[node] = f"a model's weights ({evidence})"
    out = []
    for node in sorted(found, key=lambda n: (len(n), n)):
        if not any(node[:d] in found for d in range(1, len(node))):  # not inside another
            out.append((node, found[node]))
    return out


def _candidate_tops(folder: DcpFolder) -> list[str]:
    """Top-level entries that may hold gradients: those holding tensors that are neither
    the model's weights nor an optimizer's state, nor hold them (``locate.candidate_keys``
    in one file)."""
    out = []
    kept_whole = {node[0] for node, _ in _wholes(folder)}
    for top in folder.tops():
        held = folder.under(top)
        if top in kept_whole or not held:
            continue
        if any(t.dtype.is_floating_point and len(t.shape) > 0 for t in held.values()):
            out.append(top)
    return out


def _set_gradients(contents: Draft, found: dict[str, StoredTensor], where: str,
                   meta_file: Path) -> None:
    floating = {n: renamed(t, n) for n, t in found.items()
                if t.dtype.is_floating_point or t.dtype.is_complex}
    contents.skipped = [n for n in found if n not in floating]
    contents.gradient_key = where
    if floating:
        contents.gradients = floating
    else:
        contents.missing[roles.GRADIENT] = \
            f"{meta_file}: no floating-point gradients under '{where}'"


def _tops(paths) -> str:
    tops = list(dict.fromkeys(str(p[0]) for p in paths.values()))
    shown = ", ".join(f"'{t}'" for t in tops[:8])
    return shown + (f" and {len(tops) - 8} more" if len(tops) > 8 else "")


def holds_optimizer_state(folder: DcpFolder, top: str) -> bool:
    """Whether ``top`` holds an optimizer state dict: ``state`` and ``param_groups`` nested,
    or flattened by parameter name (``_flattened``)."""
    return folder.holds_optimizer_state(top) or bool(_flattened(folder, top))


def optimizer(folder: DcpFolder, top: str) -> OptimizerState:
    """The optimizer state dict saved under ``top``, nested or flattened."""
    flat = _flattened(folder, top)
    return fqn_optimizer(folder, flat) if flat else folder.optimizer(top)


def _flattened(folder: DcpFolder, top: str) -> dict[str, str]:
    """An optimizer state dict flattened by parameter name under ``top`` (torch's
    ``get_optimizer_state_dict`` with ``flatten_optimizer_state_dict``, as OLMo-core's
    ``optim`` and torchtitan's ``optimizer``): each DCP key -> ``state.<fqn>.<key>`` or
    ``param_groups.<fqn>.<key>``. Its tensors are moments, never gradients."""
    return {k: str(p[1]) for k, p in folder.paths.items()
            if len(p) == 2 and p[0] == top and str(p[1]).startswith(("state.", "param_groups."))}


def optimizer_tops(folder: DcpFolder) -> list[str]:
    """The top-level keys holding optimizer state: the first of ``OPTIMIZER_KEYS`` that
    does, else Lightning's ``optimizer_0``, ``optimizer_1``... (one per optimizer)."""
    for name in OPTIMIZER_KEYS:
        if holds_optimizer_state(folder, name):
            return [name]
    numbered = [t for t in folder.tops() if _LIGHTNING_OPTIMIZER.fullmatch(t)]
    return [t for t in sorted(numbered, key=lambda t: int(t.rsplit("_", 1)[1]))
            if holds_optimizer_state(folder, t)]


def write_back(contents: Contents) -> WriteBack:
    """For clip: every gradient chunk held as a gradient of its own, and the folder written
    back with each chunk's bytes patched into a copy of its file (``hold_gradient_chunks``)."""
    return hold_gradient_chunks(contents)
