"""``gradclip clip``: load, measure, scale or clamp, check, write a copy."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from .. import options
from ..core import (
    Coefficient,
    clamp_elements_,
    distinct_elements,
    exact_clip_coefficient,
    lowered_coefficient,
    rounds_to_zero,
    scale_elements_,
    unit_roundoff,
)
from ..distributed import launcher
from ..errors import OutputError, UsageError
from ..format import entry
from ..format.text import visible
from ..progress import progress_steps
from ..report import ClipReport
from ..report.groups import nonfinite_counts
from ..sink.atomic import links_kept
from ..sink.write_back import execute
from ..source.layouts import write_back
from ..source.locate import at_key
from ..source.what import select
from .common import Loaded, load, measure, speaks, tensor_writers
from .output import Output

# Lowering steps tried before giving up (two suffice in practice; see
# core.lowered_coefficient for why four always do).
_MAX_LOWERINGS = 8


def run(
    *, path: str, max_norm: str | None, clip_value: str | None, output: str | None,
    in_place: bool, key: str | None, norm_type: str, device: str, format: str,
    allow_nonfinite: bool, verify: bool, trust_pickle: bool, quiet: bool,
    output_file: Path | None, what: str = "grads", progress: bool = True,
) -> int:
    report_out = Output.of(format, output_file, quiet=quiet, reads=[path],
                           writes=[] if output is None else [output], writes_known=False)
    p = options.norm_type(norm_type)
    limit = options.threshold("--max-norm", max_norm, allow_zero=False)
    value = options.threshold("--clip-value", clip_value, allow_zero=False)
    if (limit is None) == (value is None):
        raise UsageError("clip needs exactly one of --max-norm X or --clip-value V")
    dev = options.device(device)
    # A folder is a set, written as a folder (its target is known once it is opened).
    target = path if os.path.isdir(path) else options.clip_output(path, output, in_place)
    report_out.check(reads=[path], writes=[target], writes_known=False)

    def load_for_writing(steps) -> tuple[Loaded, list[str]]:
        loaded = _for_writing(load(path, key, trust_pickle, verify, steps, what,
                                   gradients_only=True))
        loaded.held_tensors()  # clip changes tensors in place: each must be one piece
        return loaded, _unshare_other_entries(loaded)

    session = launcher.join(dev, device, [path])
    if session is not None:
        dev = session.device
    with progress_steps(not progress or not speaks()) as steps:
        loaded, unshared = load_for_writing(steps)
        if loaded.write_back is not None and loaded.write_back.folder is not None:
            # A set of files (HF sharded, DCP, DCP's HF layout) is written as a folder.
            target = str(_set_target(loaded.write_back.folder, output, in_place))
        report_out.check(reads=[*loaded.contents.files, loaded.contents.path], writes=[target])
        if value is not None and any(t.is_complex() for t in loaded.held_tensors()):
            raise UsageError("--clip-value cannot clamp complex gradients (complex numbers "
                             "have no order); use --max-norm")
        # Under a launcher the ranks share the reading for this first norm; for a
        # set, by shards: each rank goes on to clip and write the shards it read.
        plan = loaded.write_back
        by_shard = session is not None and plan is not None and plan.folder is not None \
            and bool(plan.files)
        files = None
        if by_shard:
            from ..distributed.sets import shard_owners

            files = shard_owners([f.path for f in plan.files], plan.folder, session.world_size)
        owned = measure(loaded, p, dev, steps, "computing norms", session=session,
                        files=files).owned
        before = owned.total()
        total_before = float(before.norm[0])
        overflow = bool(before.overflow[0])
        nonfinite = nonfinite_counts(before)[0]

        def refuse(why: str, then: str = "") -> int:
            """Exit 1, nothing written: a finding, which the CI formats report as one in
            place of what was clipped (a report file is never left missing, or stale from
            an earlier run). The table and JSON have the line on stderr alone."""
            if not speaks():
                return 1
            message = f"{visible(str(path))}: {why}; refusing to clip, nothing written{then}"
            print(f"gradclip: {message}", file=sys.stderr)
            if entry(report_out.format).carries_refusals:
                report = ClipReport(
                    source=path, output=target, format=loaded.contents.kind, key=loaded.key,
                    norm_type=p, max_norm=limit, clip_value=value,
                    total_norm_before=total_before, clip_coef=None,
                    total_norm_after=total_before, clipped=False,
                    num_tensors=len(loaded.tensors), nonfinite=nonfinite, overflow=overflow,
                    refused=message)
                report_out.emit(report, verdict=False)
            return 1

        if nonfinite.total and not allow_nonfinite:
            return refuse(f"gradient total norm is {total_before} ({nonfinite.nan} NaN, "
                          f"{nonfinite.posinf} +inf, {nonfinite.neginf} -inf)",
                          " (--allow-nonfinite clips anyway)")
        coef = torch_coef = None
        if limit is not None:
            coef = torch_coef = exact_clip_coefficient(before, limit)
            # Every rank has the same total, so every rank decides (and exits) alike.
            if not nonfinite.total and _zeroes_everything(loaded, owned, coef):
                return refuse(f"clipping to --max-norm {limit:g} needs a coefficient of "
                              f"2^{coef.log2:.6g} (gradient total norm {_describe(before)}, "
                              f"p={p:g}), "
                              "which would round every gradient to zero")
        if not speaks() and not by_shard:
            # One file is written by one process, which must hold every
            # scaled tensor: rank 0 scales, checks and writes; the other
            # ranks are done. (A set: each rank its own shards.)
            return 0
        checking = session if by_shard else None

        def mine(loaded: Loaded):
            """The elements this process scales: all, or under a launcher those of the
            shards it writes (a replicated piece: every rank that writes a copy)."""
            if not by_shard:
                return loaded.elements
            return loaded.elements.only(
                [session.rank in ranks for ranks in tensor_writers(loaded, files)])

        def check(loaded: Loaded) -> float:
            sums = measure(loaded, p, dev, steps, "checking", session=checking, files=files)
            return float(sums.total().norm[0])

        if limit is not None:
            scale_elements_(mine(loaded), coef)
            after = check(loaded)
            # Rounding to a narrow stored dtype can leave the total just above
            # the limit; start again from the file with a lower coefficient.
            # ``inspect`` measures the output with this same code, so the
            # comparison it makes is this one.
            roundoff = max(unit_roundoff(t.dtype) for t in loaded.held_tensors())
            attempt = 0
            while after > limit and math.isfinite(after) and attempt < _MAX_LOWERINGS:
                coef = lowered_coefficient(coef, after, limit, roundoff, attempt)
                attempt += 1
                loaded, unshared = load_for_writing(steps)
                scale_elements_(mine(loaded), coef)
                after = check(loaded)
            clipped = not coef.is_one
        else:
            clipped = _clamp_changes(loaded, owned, value)
            clamp_elements_(mine(loaded), value)
            after = check(loaded)
        if loaded.write_back is None:
            raise OutputError(f"{target}: cannot write a {loaded.contents.kind} checkpoint")
        # The report is drawn (and a --output-file staged) before the checkpoint is
        # written: nothing can fail over the report once the clipped copy exists.
        lowered = coef is not torch_coef
        report = ClipReport(
            source=path, output=target, format=loaded.contents.kind,
            key=loaded.key, norm_type=p, max_norm=limit, clip_value=value,
            total_norm_before=total_before, clip_coef=None if coef is None else coef.value,
            total_norm_after=after, clipped=clipped,
            # A DCP set is clipped chunk by chunk (its HF layout piece by piece); the
            # report counts its tensors.
            num_tensors=loaded.write_back.tensor_count or len(loaded.tensors),
            nonfinite=nonfinite, overflow=overflow,
            clip_coef_log2=None if coef is None else coef.log2,
            clip_coef_torch=torch_coef.value if lowered else None, coef_lowered=lowered,
            unshared=unshared,
            # One file replaced by a new one: its other names keep the old bytes.
            other_links_unchanged=0 if loaded.write_back.folder is not None
            else links_kept(_resolved(target)),
        )
        pending = report_out.prepare(report)
        steps.begin("writing")
        try:
            c = loaded.contents  # what was loaded and the held gradients, clipped in place
            execute(loaded.write_back, target, filter(None, (c.checkpoint, *c.shards)),
                    {n: t.held for n, t in (c.gradients or {}).items()},
                    in_place=in_place, ranks=session if by_shard else None, owners=files)
        except BaseException:
            if pending is not None:
                pending.discard()
            raise
    if pending is not None:
        pending.deliver()
    return 0


def _resolved(target: str) -> str:
    """The file a write replaces: a symlink's target (``sink.write_checkpoint``)."""
    return os.path.realpath(target) if os.path.islink(target) else target


def _for_writing(loaded: Loaded) -> Loaded:
    """``loaded`` with its layout's write-back plan (``layouts.write_back``).

    Where the layout holds its gradients anew for clip, each a gradient of its
    own that clip scales in place and the sink writes back where it was (a DCP
    set's chunk by chunk, its Hugging Face layout's piece by piece), those are
    chosen; other checkpoints keep what ``load`` chose."""
    back = write_back(loaded.contents)
    if back is not None and back.gradients is not None:
        contents = dataclasses.replace(loaded.contents, gradients=back.gradients)
        selection = select(contents, "grads", gradients_only=True)
        loaded = Loaded(contents, selection,
                        distinct_elements([t.held for t in selection.tensors]))
    loaded.write_back = None if back is None else back.plan
    return loaded


def _set_target(folder: Path, output: str | None, in_place: bool) -> Path:
    """A sharded set is written as a folder: ``-o`` names it; default ``<folder>.clipped``."""
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


def _describe(total) -> str:
    norm = float(total.norm[0])
    if math.isinf(norm) and bool(total.overflow[0]):
        return f"> 1.8e308, about 10^{float(total.log2_norm[0]) * math.log10(2):.6g}"
    return f"{norm:g}"


def _zeroes_everything(loaded: Loaded, owned, coef: Coefficient) -> bool:
    """Whether scaling by ``coef`` would round every nonzero gradient element to zero.

    Each tensor's largest element decides for it: if that rounds to zero in
    the tensor's dtype, so does every other. Gradients that are all zero
    already are no evidence either way.
    """
    maxima = owned.max_abs.tolist()
    nonzero = [(m, t) for m, t in zip(maxima, loaded.held_tensors()) if m > 0]
    return bool(nonzero) and all(rounds_to_zero(m, t.dtype, coef) for m, t in nonzero)


def _clamp_changes(loaded: Loaded, owned, value: float) -> bool:
    """Whether clamping to ``[-value, value]`` changes some gradient element.

    A tensor's largest magnitude decides for it, except where it holds a NaN:
    its ``max_abs`` is then NaN, while the clamp keeps the NaN and still changes
    the elements beyond the bound (an infinity among them), so those are looked
    for.
    """
    for m, t in zip(owned.max_abs.tolist(), loaded.held_tensors()):
        if m > value or (math.isnan(m) and bool((t.abs() > value).any())):
            return True
    return False


def _unshare_other_entries(loaded: Loaded) -> list[str]:
    """Give every non-gradient tensor that shares storage with a gradient its own copy.

    ``torch.save`` keeps shared storages shared, so an EMA buffer that is a
    view of ``grads.w`` would otherwise be scaled along with it. The walk
    covers nested dicts, lists and tuples outside the gradient mapping
    (iteratively: depth is the file's to choose; each container once, so a
    container that holds itself ends the walk). A tuple cannot change, so one
    holding such a tensor is rebuilt in its place. The gradient mapping's own
    containers are never entered, even where the file names them again
    elsewhere (one dict under two keys): a copy there would take the place of
    the gradient that is clipped. The names of copied entries are returned
    for the report.
    """
    if loaded.checkpoint is None:
        return []  # a set of files: each shard holds gradients only where it is written
    storages = {_storage_key(t) for t in loaded.held_tensors() if t.layout == torch.strided}
    storages.discard(None)
    if not storages:
        return []
    root = loaded.checkpoint.root
    gradients = at_key(root, loaded.key) if loaded.key else root
    seen = _containers(gradients)
    copies: dict[int, torch.Tensor] = {}  # id of a shared tensor -> its copy
    rebuilt: dict[int, tuple] = {}  # id of a tuple -> the one that replaces it
    copied: list[str] = []
    stack: list[tuple[tuple[str, ...], object, bool]] = [((), root, False)]
    while stack:
        path, node, children_done = stack.pop()
        if not children_done:
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((path, node, True))
            stack.extend(((*path, str(name)), child, False) for name, child in _entries(node)
                         if _entries(child) is not None)
            continue
        replaced = []
        for name, child in _entries(node):
            new = rebuilt.get(id(child), child)
            if isinstance(child, torch.Tensor) and child.layout == torch.strided \
                    and _storage_key(child) in storages:
                new = copies.setdefault(id(child), child.detach().clone())
                copied.append(".".join((*path, str(name))))
            replaced.append(new)
            if new is not child and not isinstance(node, tuple):
                node[name] = new
        if isinstance(node, tuple) and any(a is not b for a, b in zip(replaced, node)):
            rebuilt[id(node)] = tuple(replaced)
    if id(root) in rebuilt:
        loaded.checkpoint.root = rebuilt[id(root)]
    return sorted(copied)


def _entries(node) -> list | None:
    """A container's ``(name, child)`` pairs (a tuple's exactly, not ``torch.Size``'s or
    another subclass's); None for anything else."""
    if isinstance(node, Mapping):
        return list(node.items())
    if isinstance(node, list) or type(node) is tuple:
        return list(enumerate(node))
    return None


def _containers(node) -> set[int]:
    """The ids of ``node`` and every container inside it."""
    found: set[int] = set()
    stack = [node]
    while stack:
        node = stack.pop()
        entries = _entries(node)
        if entries is None or id(node) in found:
            continue
        found.add(id(node))
        stack.extend(child for _, child in entries)
    return found


def _storage_key(t: torch.Tensor):
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr())
