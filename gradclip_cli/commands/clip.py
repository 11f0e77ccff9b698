"""``gradclip clip``: load, measure, scale or clamp, check, write a copy."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from .. import options
from ..core import clamp_, clip_coefficient, scale_
from ..distributed import launcher
from ..errors import UsageError
from ..progress import progress_steps
from ..report import ClipReport, NonFinite
from ..sink import write_contents
from .common import emit, load, measure, output_format, speaks


def run(
    *, path: str, max_norm: str | None, clip_value: str | None, output: str | None,
    in_place: bool, key: str | None, norm_type: str, device: str, format: str,
    allow_nonfinite: bool, verify: bool, trust_pickle: bool, quiet: bool,
    output_file: Path | None, what: str = "grads",
) -> int:
    p = options.norm_type(norm_type)
    limit = options.threshold("--max-norm", max_norm, allow_zero=False)
    value = options.threshold("--clip-value", clip_value, allow_zero=False)
    if (limit is None) == (value is None):
        raise UsageError("clip needs exactly one of --max-norm X or --clip-value V")
    dev = options.device(device)
    fmt = output_format(format)
    # A folder is a set, written as a folder (its target is known once it is opened).
    target = path if os.path.isdir(path) else options.clip_output(path, output, in_place)
    options.report_file(output_file)
    session = launcher.join(dev, device)
    if session is not None:
        dev = session.device
    with progress_steps(quiet or not speaks()) as steps:
        loaded = load(path, key, trust_pickle, verify, steps, what, gradients_only=True)
        tensors = loaded.held_tensors()
        if loaded.contents.shards:
            target = str(_set_target(loaded.contents.index.parent, output, in_place))
        # Under a launcher the ranks share the reading for this first norm.
        before = measure(loaded, p, dev, steps, "computing norms", session=session).total()
        total_before = float(before.norm[0])
        nonfinite = NonFinite(int(before.nan[0]), int(before.posinf[0]), int(before.neginf[0]))
        if nonfinite.total and not allow_nonfinite:
            if not speaks():
                return 1
            print(f"gradclip: {path}: total norm is {total_before} ({nonfinite.nan} NaN, "
                  f"{nonfinite.posinf} +inf, {nonfinite.neginf} -inf); refusing to clip, "
                  "nothing written (--allow-nonfinite clips anyway)", file=sys.stderr)
            return 1
        if not speaks():
            # One file is written by one process, which must hold every
            # scaled tensor: rank 0 scales, checks and writes; the other
            # ranks are done. (Sharded checkpoints: each rank its shards.)
            return 0
        coef = None
        if limit is not None:
            c = clip_coefficient(torch.tensor(total_before, dtype=torch.float64), limit)
            coef = float(c)
            scale_(tensors, c)
            clipped = coef < 1.0
        else:
            clamp_(tensors, value)
            clipped = float(before.max_abs[0]) > value
        after = float(measure(loaded, p, dev, steps, "checking").total().norm[0])
        steps.begin("writing")
        other_links = write_contents(loaded.contents, target, in_place=in_place)
    report = ClipReport(
        source=path, output=target, format=loaded.contents.kind,
        key=loaded.key, norm_type=p, max_norm=limit, clip_value=value,
        total_norm_before=total_before, clip_coef=coef, total_norm_after=after,
        clipped=clipped, num_tensors=len(loaded.tensors), nonfinite=nonfinite,
        other_links_unchanged=other_links,
    )
    emit(lambda out: fmt.render_clip(report, out), output_file)
    return 0


def _set_target(folder: Path, output: str | None, in_place: bool) -> Path:
    """A sharded set is written as a folder: ``-o`` names it; default ``<folder>.clipped``."""
    if in_place:
        return folder
    target = Path(output) if output is not None else folder.with_name(f"{folder.name}.clipped")
    if target.exists():
        raise UsageError(f"{target}: exists; a clipped set is written as a new folder "
                         "(or use --in-place)")
    return target
