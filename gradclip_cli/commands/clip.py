"""``gradclip clip``: load for writing, measure, clip (``clipping.py``: refuse, scale or clamp,
check), report, write a copy."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .. import clipping, options
from ..core import Coefficient, clamp_elements_, scale_elements_
from ..distributed import launcher
from ..distributed.sets import shard_owners
from ..errors import GradclipError, OutputError, UsageError, stderr_lines
from ..format import entry
from ..format.text import visible
from ..progress import progress_steps
from ..report import ClipReport
from ..report.groups import nonfinite_counts
from ..sink.atomic import links_kept
from ..sink.write_back import execute
from ..source.layouts import LAYOUTS
from .common import Loaded, load_for_writing, measure, speaks, tensor_writers
from .output import Output


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
    session = launcher.join(dev, device, [path])
    if session is not None:
        dev = session.device
    notes: tuple[str, ...] = ()  # what --verify could not check: a failure says it too
    try:
        with progress_steps(not progress or not speaks()) as steps:
            read = functools.partial(load_for_writing, path, key, trust_pickle, verify, steps, what)
            loaded = read()
            notes = loaded.contents.notes
            if loaded.contents.shard_of is not None:
                # Its norm is this file's alone: scaled by it, the set's total would not be
                # the one asked for (inspect says so; clip writes nothing).
                shard_of = loaded.contents.shard_of
                folder = str(shard_of)
                whole = f"clip the set: gradclip clip {folder}" if any(
                    layout.recognises(shard_of) for layout in LAYOUTS) else \
                    "the set's index is not there to read it by (a '*.index.json')"
                raise UsageError(f"{path}: one shard of the set in {folder}: clip scales "
                                 "by the total norm of every gradient of the set, which this file "
                                 f"alone does not hold; {whole}")
            plan = loaded.write_back
            if plan is not None and plan.folder is not None:
                target = str(options.set_output(plan.folder, output, in_place))
            report_out.check(reads=[*loaded.contents.files, loaded.contents.path], writes=[target])
            dtypes = [t.dtype for t in loaded.held_tensors()]
            if value is not None and any(dtype.is_complex for dtype in dtypes):
                raise UsageError("--clip-value cannot clamp complex gradients (complex numbers "
                                 "have no order); use --max-norm")
            # Under a launcher the ranks share the reading for this first norm; for a
            # set, by shards: each rank goes on to clip and write the shards it read.
            owners = shard_owners(session, plan)
            owned = measure(loaded, p, dev, steps, "computing norms", session=session,
                            files=owners).owned
            before, maxima = owned.total(), owned.max_abs.tolist()
            report = functools.partial(_report, before, source=path, output=target, norm_type=p,
                                       max_norm=limit, clip_value=value)
            refused = clipping.refusal(before, maxima, dtypes, p=p, limit=limit,
                                       allow_nonfinite=allow_nonfinite, value=value)
            if refused is not None:
                return _refuse(report_out, report(loaded), *refused)
            if not speaks() and owners is None:
                return 0  # one file: rank 0 scales, checks and writes it; the others are done
            share = _Share(read, loaded, p, dev, steps, None if owners is None else session, owners)
            del loaded  # the share's now: a lowering reads the file again in its place
            done = clipping.to_norm(before, limit, dtypes, share.scaled) if limit is not None \
                else clipping.to_value(value, maxima, share.loaded.held_tensors(), share.clamped)
            loaded = share.loaded
            if loaded.write_back is None:
                raise OutputError(f"{target}: cannot write a {loaded.contents.kind} checkpoint")
            # The report is drawn (and a --output-file staged) before the checkpoint is
            # written: nothing can fail over the report once the clipped copy exists.
            pending = report_out.prepare(report(loaded, done))
            steps.begin("writing")
            try:
                c = loaded.contents  # what was loaded and the held gradients, clipped in place
                execute(loaded.write_back, target, filter(None, (c.checkpoint, *c.shards)),
                        {n: t.held for n, t in (c.gradients or {}).items()},
                        in_place=in_place, ranks=share.session, owners=owners)
            except BaseException:
                if pending is not None:
                    pending.discard()
                raise
        if pending is not None:
            pending.deliver()
    except GradclipError as error:
        error.noting(notes)
        raise
    return 0


class _Share:
    """This process's part of a clip: the gradients read for writing (``read``, again for
    each lowered coefficient), the elements it changes (all; under a launcher, ``session``,
    those of the set's files it writes, ``owners``, a replicated piece in every rank that
    writes a copy), and their total norm once changed."""

    def __init__(self, read: Callable[[], Loaded], loaded: Loaded, p: float, device, steps,
                 session: launcher.Session | None, owners: dict[str, int] | None):
        self.read, self.loaded, self.p, self.device = read, loaded, p, device
        self.steps, self.session, self.owners = steps, session, owners

    def scaled(self, coef: Coefficient, again: bool) -> float:
        if again:
            self.loaded = self.read()
        scale_elements_(self._elements(), coef)
        return self._after()

    def clamped(self, value: float) -> float:
        clamp_elements_(self._elements(), value)
        return self._after()

    def _elements(self):
        if self.owners is None:
            return self.loaded.elements
        return self.loaded.elements.only(
            [self.session.rank in ranks for ranks in tensor_writers(self.loaded, self.owners)])

    def _after(self) -> float:
        sums = measure(self.loaded, self.p, self.device, self.steps, "checking",
                       session=self.session, files=self.owners)
        return float(sums.total().norm[0])


def _report(before, loaded, done: clipping.Clipped | None = None, **given) -> ClipReport:
    """The report of a clip (``done``), or of a refusal (``refused``: nothing written, the
    norms the input's)."""
    total, plan = float(before.norm[0]), loaded.write_back
    # A DCP set is clipped chunk by chunk (its HF layout piece by piece); the report
    # counts its tensors, refused or not.
    given.update(num_tensors=(plan is not None and plan.tensor_count) or len(loaded.tensors))
    if done is None:
        done = clipping.Clipped(total, False)
    else:
        given.update(
            unshared=loaded.unshared,
            # One file replaced by a new one: its other names keep the old bytes.
            other_links_unchanged=0 if plan.folder is not None
            else links_kept(_resolved(given["output"])))
    coef = done.coef
    return ClipReport(
        **given, format=loaded.contents.kind, key=loaded.key, total_norm_before=total,
        total_norm_after=done.after, clipped=done.changed,
        nonfinite=nonfinite_counts(before)[0], overflow=bool(before.overflow[0]),
        clip_coef=None if coef is None else coef.value,
        clip_coef_log2=None if coef is None else coef.log2,
        clip_coef_torch=done.torch_coef.value if done.lowered else None,
        coef_lowered=done.lowered, notes=list(loaded.contents.notes))


def _resolved(target: str) -> str:
    """The file a write replaces: a symlink's target (``sink.write_checkpoint``)."""
    return os.path.realpath(target) if os.path.islink(target) else target


def _refuse(report_out: Output, report: ClipReport, why: str, then: str) -> int:
    """Exit 1, nothing written: a finding, which the CI formats report as one in place of
    what was clipped (a report file is never left missing, or stale from an earlier
    run). The table and JSON have the line on stderr alone. The message goes to the
    formats as it is: each escapes the file's name its own way, once."""
    if not speaks():
        return 1
    message = f"{report.source}: {why}; refusing to clip, nothing written{then}"
    documented = entry(report_out.format).carries_refusals
    # What --verify could not check: in the document where there is one, else on stderr
    # after the error line (not under -q), as a failure (exit 2 or 3) says it.
    for line in stderr_lines(visible(message),
                             () if documented or report_out.quiet else report.notes):
        print(line, file=sys.stderr)
    if documented:
        report_out.emit(dataclasses.replace(report, refused=message), verdict=False)
    return 1
