"""One checkpoint file: the file readers, plus what the file's content says it is.

A plain file gives its gradients (the ``--key`` rule of ``source/locate.py``)
and, when it holds them next to the gradients, the model's weights and the
optimizer's state (``fill_from_root``, which a framework's own file, such as a
Lightning ``.ckpt``, uses too). A file that an index beside it lists as one of its shards is
opened alone, and the report says that it covers that shard only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import locate, roles, select_gradients
from gradclip_cli.source.interface import Checkpoint, stored
from gradclip_cli.source.vocabulary import (
    GRADIENT_KEYS,
    OPTIMIZER_KEYS,
    SHARD_NAME,
    WEIGHT_KEYS,
    step_of,
)

from . import dcp_hf
from .draft import Draft
from .facts import ENTRY, FLAT, KEY, MARK, PROOF, STATE, Found, NotGradients, wording
from .paths import read_json
from .torch_optim import (
    MASTER_WEIGHT_KEYS,
    is_optimizer_state,
    optimizer_state,
    wraps_optimizer_state,
)


def contents_of(ckpt: Checkpoint, *, key: str | None) -> Draft:
    """A loaded file that is no framework's own (``layouts.open_file`` asks them first)."""
    path = ckpt.path
    contents = Draft(path=path, kind=ckpt.format, files=[path], checkpoint=ckpt,
                     trusted_pickle=ckpt.trusted_pickle)
    fill_from_root(contents, ckpt.root, path, key, metadata=ckpt.metadata)
    index, shards = _index_listing(path)
    if index is not None:
        contents.description.append(
            f"covers shard {visible(path.name)} only; the whole checkpoint is indexed by "
            f"{visible(index.name)}")
        contents.index = index
        if shards > 1:  # an index of one file: that file is the whole set
            contents.shard_of = index.parent
    elif (folder := dcp_hf.set_of(path, ckpt.metadata)) is not None:
        contents.description.append(
            f"covers shard {visible(path.name)} only, its pieces of each tensor "
            f"({dcp_hf.SHARDING_KEY}); the whole checkpoint is the folder "
            f"{visible(str(folder))}")
        contents.shard_of = folder
    elif (count := _counted_shards(path)) is not None:
        contents.description.append(
            f"covers shard {visible(path.name)} only: its name counts it one of {count} "
            "shards, and no index beside it lists the set")
        contents.shard_of = path.parent
    return contents


def _counted_shards(path: Path) -> int | None:
    """How many shards the name of ``path`` says its set has (``-0000K-of-0000M``), where
    more than one; else None."""
    match = SHARD_NAME.fullmatch(path.name)
    return int(match.group(2)) if match and int(match.group(2)) > 1 else None


def fill_from_root(contents: Draft, root: Any, path: Path, key: str | None,
                   metadata: Mapping[str, str] | None = None) -> None:
    """Gradients, weights and optimizer state of a loaded file's ``root``, each by its
    evidence (``source/roles.py``): a ``--key`` that names optimizer state or a model's
    weights measures them as such, and a flat mapping is gradients only when nothing
    marks it as something else."""
    if key is not None and _named(contents, root, path, key):
        if contents.keyed == roles.WEIGHT:
            contents.step = step_of(root)  # the weights alone: nothing else is measured
        else:
            _others(contents, root, path, skip=key)
        return
    if key is None and is_optimizer_state(root):
        # torch.save(optimizer.state_dict()): accelerate's optimizer.bin, a script's opt.pt.
        contents.optimizers.append(optimizer_state(root, path, "the file"))
        contents.say(wording(Found(roles.OPTIMIZER_STATE, STATE),
                             NotGradients(path, roles.OPTIMIZER_STATE)))
        return
    try:
        selection = select_gradients(root, key, path=path)
    except InputError as error:
        if key is not None:
            raise
        contents.missing[roles.GRADIENT] = str(error)
    else:
        _gradients(contents, root, path, key, selection, metadata)
    _others(contents, root, path)


def _gradients(contents, root, path, key, selection, metadata) -> None:
    marked = roles.marked_as_gradients(root, metadata)
    if selection.key_path == () and key is None:
        evidence = roles.weight_evidence(root, file=path, folder=path.parent)
        if marked:
            roles.contradiction(root, f"{path}: gradclip's mark")
            contents.say(wording(Found(roles.GRADIENT, MARK)))
        elif evidence is not None:
            contents.weights, contents.buffers = roles.split_buffers(
                stored({str(k): v for k, v in root.items() if hasattr(v, "dtype")}, path))
            contents.weights_of = roles.weights_of(path)
            contents.say(wording(Found(roles.WEIGHT, PROOF, detail=evidence),
                                 NotGradients(path, roles.WEIGHT, evidence,
                                              whose=contents.weights_of or "a model's")))
            return
        else:
            contents.say(wording(Found(roles.GRADIENT, FLAT,
                                       detail="a flat name -> tensor mapping")))
    else:
        shown = selection.key
        roles.contradiction(locate.at_key(root, shown), f"{path}: the key '{shown}'")
        contents.say(wording(Found(roles.GRADIENT, MARK if marked else
                                   KEY if key is not None else ENTRY, (shown,))))
    contents.gradients = stored(selection.tensors, path)
    contents.gradient_key = selection.key
    contents.skipped = list(selection.skipped)


def _named(contents: Draft, root: Any, path: Path, key: str) -> bool:
    """``--key`` naming optimizer state or a model's weights: taken as such (True); one
    leading inside them is refused."""
    for entry, value in locate.enclosing(root, key, path=path):
        whole = _whole(value)
        if whole is not None:
            raise roles.not_gradients(str(path), key, "lies inside", entry, whole)
        master = key[len(entry) + 1:].split(".", 1)[0]
        if wraps_optimizer_state(value) and master in MASTER_WEIGHT_KEYS:
            raise InputError(f"{path}: --key '{key}' is in '{entry}.{master}', a "
                             "mixed-precision optimizer's fp32 master weights: not gradients; "
                             "the model's weights are measured with --what weights")
    node = locate.at_key(root, key, path=path)
    shown = visible(key)
    if key.rsplit(".", 1)[-1] in GRADIENT_KEYS and isinstance(node, Mapping):
        roles.contradiction(node, f"{path}: --key {key}")  # a gradient key holding weights
    if is_optimizer_state(node):
        contents.optimizers.append(optimizer_state(node, path, f"'{key}'"))
        contents.keyed = roles.OPTIMIZER_STATE
        contents.say(wording(Found(roles.OPTIMIZER_STATE, KEY, (key,)),
                             NotGradients(path, roles.OPTIMIZER_STATE, key=key)))
        return True
    evidence = roles.weight_evidence(node) if isinstance(node, Mapping) and node else None
    if evidence is None and key in WEIGHT_KEYS and isinstance(node, Mapping) and node:
        evidence = f"the {shown!r} entry, where scripts keep the model"
    if evidence is None:
        _refuse_what_it_holds(root, path, key)
        return False
    tensors = {str(k): v for k, v in node.items() if isinstance(v, torch.Tensor)}
    contents.weights, contents.buffers = roles.split_buffers(stored(tensors, path))
    contents.keyed = roles.WEIGHT
    contents.say(wording(Found(roles.WEIGHT, KEY, (key,), detail=evidence),
                         NotGradients(path, roles.WEIGHT, evidence, key=key)))
    return True


def _refuse_what_it_holds(root: Any, path: Path, key: str) -> None:
    """A ``--key`` whose entry holds an optimizer's state dict or a model's weights
    (torchtune's ``optimizer_in_bwd`` keeps one optimizer state dict per parameter under
    ``optimizer``): their tensors are not gradients, so the key is refused, naming the
    first such entry to measure whole."""
    if not isinstance(locate.at_key(root, key, path=path), (Mapping, list, tuple)):
        return
    for entry, value in locate.within(root, key, path=path):
        whole = _whole(value)
        if whole is not None:
            raise roles.not_gradients(str(path), key, "holds", entry, whole)


def _whole(value: Any) -> str | None:
    """What ``value`` is when a ``--key`` may name it only whole: an optimizer's state dict
    or a model's weights (with the evidence); None for anything else."""
    if is_optimizer_state(value):
        return "an optimizer's state dict (state and param_groups)"
    evidence = roles.weight_evidence(value) if isinstance(value, Mapping) else None
    return None if evidence is None else f"a model's weights ({evidence})"


def _others(contents: Draft, root: Any, path: Path, skip: str | None = None) -> None:
    """The weights, optimizer state and step a file keeps beside what was chosen."""
    if not isinstance(root, Mapping):
        return
    if contents.weights is None:
        # The usual names, else any top-level entry that is recognisably a model's
        # state dict (torch's _metadata, buffers).
        found = [(name, "") for name in WEIGHT_KEYS]
        found += [(str(k), e) for k, v in root.items()
                  if str(k) not in WEIGHT_KEYS and isinstance(v, Mapping)
                  and (e := roles.weight_evidence(v)) is not None]
        for name, evidence in found:
            weights = root.get(name)
            if name != skip and isinstance(weights, Mapping) and weights and all(
                    isinstance(v, torch.Tensor) for v in weights.values()):
                contents.weights = stored({str(k): v for k, v in weights.items()}, path)
                listed = _listed_buffers(root, name, contents.weights)
                if listed:
                    contents.buffers = {n: contents.weights.pop(n) for n in listed}
                if roles.WEIGHT not in contents.evidence:
                    contents.say(wording(Found(roles.WEIGHT, ENTRY, (name,), detail=evidence)))
                break
    if not contents.optimizers:
        # The usual names first, then any top-level entry shaped as one (state and
        # param_groups): the structure is the evidence, whatever the script named it.
        # Every one is kept (a GAN's optimizer_g and optimizer_d): one alone is a part.
        names = [*OPTIMIZER_KEYS, *(str(k) for k in root if str(k) not in OPTIMIZER_KEYS)]
        found = [n for n in names if n != skip and is_optimizer_state(root.get(n))]
        for name in found:
            alone = name if locate.names_alone(root, name, root[name]) else None
            contents.optimizers.append(optimizer_state(root[name], path, f"'{name}'", alone))
        if found and roles.OPTIMIZER_STATE not in contents.evidence:
            contents.say(wording(Found(roles.OPTIMIZER_STATE, ENTRY, tuple(found))))
    contents.step = step_of(root)


def _listed_buffers(root: Mapping, name: str, weights: Mapping[str, Any]) -> list[str]:
    """The entries of ``root[name]`` that the file's ``buffer_names`` lists beside its
    ``module`` (DeepSpeed's model state file, read as a file away from its folder): buffers
    of any name or dtype, never weights."""
    names = root.get("buffer_names")
    if name != "module" or not isinstance(names, (list, tuple)) \
            or not all(isinstance(n, str) for n in names):
        return []
    return [n for n in names if n in weights]


def _index_listing(path: Path) -> tuple[Path | None, int]:
    """An index beside ``path`` whose ``weight_map`` lists this file, if there is one, and
    how many files it lists."""
    folder = path.parent
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".index.json")]
    except OSError:
        return None, 0
    for name in sorted(names):
        candidate = folder / name
        try:
            index = read_json(candidate, what="an index", folder=folder)
        except InputError:
            continue
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if isinstance(weight_map, dict) and path.name in weight_map.values():
            return candidate, len({f for f in weight_map.values() if isinstance(f, str)})
    return None, 0
