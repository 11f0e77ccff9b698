"""``gradclip inspect``: load, measure, report. Never writes the input."""

from __future__ import annotations

import os
import re
import stat
import sys
from pathlib import Path

from .. import options
from ..distributed import launcher
from ..errors import InputError
from ..escaping import visible
from ..progress import progress_steps
from ..report import OK, build_inspect_report, parse_group_by
from ..source.roles import role_counts
from ..source.vocabulary import checkpoint_step
from .common import Releasers, emit, load, measure, measure_weights, output_format, speaks


def run(
    *, path: str, key: str | None, norm_type: str, device: str, format: str,
    max_norm: str | None, allow_nonfinite: bool, verify: bool, group_by: str, top: int,
    trust_pickle: bool, quiet: bool, output_file: Path | None, what: str = "auto",
    progress: bool = True,
) -> int:
    # First: an error document (--format json) goes to --output-file too.
    options.report_file(output_file, reads=[path])
    p = options.norm_type(norm_type)
    threshold = options.threshold("--max-norm", max_norm, allow_zero=True)
    dev = options.device(device)
    fmt = output_format(format)
    rule = parse_group_by(group_by)
    session = launcher.join(dev, device, [path])
    if session is not None:
        dev = session.device
    with progress_steps(not progress or not speaks()) as steps:
        try:
            loaded = load(path, key, trust_pickle, verify, steps, what)
        except InputError as error:
            hint = trend_hint(path)
            if hint is None:
                raise
            raise InputError(f"{error}; {hint}") from None
        options.report_file(output_file, reads=loaded.contents.files)
        # inspect never writes a tensor, so pages read can go back at once:
        # resident memory stays flat whatever the file's size.
        release = Releasers(loaded.contents.files)
        sums, owned = measure(loaded, p, dev, steps, "computing norms", release, session)
        weight_sums = measure_weights(loaded, p, dev, release, session)
    contents, selection = loaded.contents, loaded.selection
    # One step rule with trend's (source/vocabulary.py): what the checkpoint records,
    # else a step-numbered name, its own or its folder's.
    step = checkpoint_step(contents.step,
                           None if loaded.checkpoint is None else loaded.checkpoint.root, path)
    counts, owned_counts = loaded.counts()
    report = build_inspect_report(
        names=loaded.names, tensors=loaded.tensors, sums=sums, owned=owned,
        counts=counts, owned_counts=owned_counts,
        ties=loaded.ties, shares=loaded.shares,
        group_rule=rule, source=path, format=contents.kind,
        key=loaded.key, device=str(dev), max_norm=threshold,
        allow_nonfinite=allow_nonfinite, group_by=group_by, skipped=loaded.skipped,
        what=selection.what, step=step.step,
        description=[*contents.description, *([step.note] if step.note else []),
                     *_buffers_apart(contents, selection.what),
                     f"measured: {selection.measured}"],
        measured={"what": selection.what, "explain": selection.explain,
                  "evidence": selection.evidence},
        roles=role_counts(contents),
        weight_sums=weight_sums,
    )
    if quiet and format == "table":
        # -q: the verdict alone on stdout; what the finding is goes to stderr.
        from ..format import table

        if speaks():
            table.print_findings(report, sys.stderr)
        emit(lambda out: table.print_verdict(report, out), output_file)
    else:
        emit(lambda out: fmt.render_inspect(report, out, top=top), output_file)
    return 0 if report.status == OK else 1


# A run's folder holds numbered checkpoints (HF Trainer, DeepSpeed), not one checkpoint.
_NUMBERED = re.compile(r"(checkpoint[-_]|global_step|step-?)\d+")
_SCANNED = 1000  # children looked at for a hint; a refusal never waits on a huge folder


def _is_log(path: Path) -> bool:
    from ..source.logs.recognise import log_kind

    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False
    return regular and log_kind(path) is not None


def trend_hint(path: str) -> str | None:
    """Where inspect refuses a run's logs or its output folder: the command that reads them.

    A ``trainer_state.json`` or a monitor's ``grads.jsonl`` holds norms over
    steps, and an ``output_dir`` holds several checkpoints: ``trend`` reads
    both (docs/reference/contract.md, "Over time"); inspect reads one checkpoint.
    """
    p = Path(path)
    if _is_log(p):
        what = "a log of gradient norms over steps"
    elif p.is_dir():
        from ..source.layouts import LAYOUTS

        if any(layout.recognises(p) for layout in LAYOUTS):
            return None  # a checkpoint: its own refusal says what it holds
        try:
            children = [c for _, c in zip(range(_SCANNED), p.iterdir())]
        except OSError:
            return None
        if any(_NUMBERED.fullmatch(c.name) and c.is_dir() for c in children):
            what = "a run's folder of numbered checkpoints"
        elif any(c.suffix in (".json", ".jsonl") and _is_log(c) for c in children):
            what = "a run's folder with a log of gradient norms"
        else:
            return None
    else:
        return None
    return f"it is {what}: for norms over the run use 'gradclip trend {path}'"


def _buffers_apart(contents, what: str) -> list[str]:
    """The buffers set apart from the weights, named (a few), when weights are measured."""
    buffers = list(contents.buffers or ())
    if what != "weights" or not buffers:
        return []
    more = f" and {len(buffers) - 3} more" if len(buffers) > 3 else ""
    return [f"buffers, not weights: {visible(', '.join(buffers[:3]))}{more}"]
