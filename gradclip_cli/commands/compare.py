"""``gradclip compare A B``: per-group norms of two checkpoints, side by side."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from .. import options, values
from ..distributed import launcher
from ..progress import progress_steps
from ..report import parse_group_by
from ..report.compare import build_compare_report
from ..report.outcome import exit_code
from ..report.trend import OneKind, one_optimizer
from .common import speaks
from .grouped import Measured, MeasureOptions, ReadNotes, measurable, measure_checkpoint
from .output import Output


def run(
    *, a: Path, b: Path, what: str, fail_above: str | None, group_by: str, key: str | None,
    norm_type: str, device: str, format: str, trust_pickle: bool, verify: bool, quiet: bool,
    output_file: Path | None, progress: bool = True,
) -> int:
    output = Output.of(format, output_file, quiet=quiet, reads=[a, b])
    options.what(what)
    limit = values.ratio_limit("--fail-above", fail_above)
    p = options.norm_type(norm_type)
    dev = options.device(device)
    rule = parse_group_by(group_by)
    session = launcher.join(dev, device, [a, b])
    if session is not None:
        dev = session.device
    how = MeasureOptions(key, p, dev, rule, group_by, trust_pickle, verify, session, what)
    kinds = OneKind(what, "compare", lambda: measurable([a, b], key, trust_pickle))
    read = ReadNotes()  # a refusal at B still says what --verify could not check in A
    with progress_steps(quiet or not progress or not speaks()) as steps:
        # One at a time: A's pages are released before B is read.
        with read.carried(a):
            ra = measure_checkpoint(a, how, steps, read=read)
            kinds.check(str(a), ra.what)
        with read.carried(b):
            rb = measure_checkpoint(b, how, steps, read=read)
            kinds.check(str(b), rb.what)
    report = build_compare_report(
        a=str(a), b=str(b), what=kinds.what, norm_type=p, group_by=group_by,
        totals=(ra.total_norm, rb.total_norm), groups_a=ra.groups, groups_b=rb.groups,
        nonfinite=_nonfinite(ra) or _nonfinite(rb), fail_above=limit,
    )  # fmt: skip
    report = replace(report, optimizer=one_optimizer({ra.optimizer, rb.optimizer}),
                     notes=tuple(read.notes))
    output.emit(report)
    return exit_code(report)


def _nonfinite(m: Measured) -> bool:
    return bool(m.nonfinite.total) or not math.isfinite(m.total_norm)
