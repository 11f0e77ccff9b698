"""``inspect CURR --previous PREV``: open both checkpoints, reconstruct the gradients of
CURR's last optimizer step from the two states (``source/previous.py``), run the
cross-check, and hand ``inspect`` a selection to measure like any other."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import GradclipError
from ..format.text import visible
from ..progress import Steps
from ..source.layouts import open_checkpoint
from ..source.previous import Disagreement, reconstruct
from .common import WORKERS, Loaded, nbytes, speaks


@dataclass
class Checked:
    """The cross-check's outcome and the report lines that say what was done."""

    disagreement: Disagreement
    lines: list[str]


def load_pair(path: str, previous: str, key: str | None, trust_pickle: bool, verify: bool,
              steps: Steps, device: torch.device) -> tuple[Loaded, Checked, list[Path]]:
    """The reconstructed gradients as a ``Loaded``, the check, and every file read."""
    steps.begin("loading")
    curr = open_checkpoint(path, key=key, trust_pickle=trust_pickle, verify=verify)
    try:
        prev = open_checkpoint(previous, key=key, trust_pickle=trust_pickle, verify=verify)
    except GradclipError as error:  # what --verify could not check in PATH, then in PREV
        own, error.notes = error.notes, ()
        error.noting((*curr.notes, *own))
        raise
    # Both files' notes (each names its file): the report, or a refusal of the pair, says
    # what --verify could not check in PREV too.
    curr = dataclasses.replace(curr, notes=tuple(dict.fromkeys((*curr.notes, *prev.notes))))
    for contents in (curr, prev):
        if contents.trusted_pickle and speaks():
            print(f"gradclip: warning: {visible(str(contents.path))}: loaded with "
                  "--trust-pickle (full unpickling; code in the file may have run)",
                  file=sys.stderr)
    try:
        rec = reconstruct(curr, prev)
        steps.begin("cross-checking the moments",
                    total=sum(t.nbytes for d in rec.checks for t in d.reads))
        found = rec.disagreement(device, lambda batch: steps.advance(nbytes(batch)), WORKERS)
    except GradclipError as error:
        error.noting(curr.notes)
        raise
    b = "alpha" if rec.rule == "grad_avg" else "beta1"  # RMSprop's average is by alpha
    lines = [f"reconstructed: {rec.kind}: g_t = (m_t - {b} * m_(t-1)) / (1 - {b}) from "
             f"{rec.rule} ({', '.join(rec.state_dtypes)} state, computed in float64)"
             + _adjustments(rec), found.sentence()]
    if rec.idle:
        more = f" and {len(rec.idle) - 3} more" if len(rec.idle) > 3 else ""
        lines.append(f"no gradient at step {rec.step} (state unchanged): "
                     f"{visible(', '.join(rec.idle[:3]))}{more}")
    return Loaded(curr, rec.selection(found)), Checked(found, lines), \
        [*curr.files, *prev.files]


def _adjustments(rec) -> str:
    """What the rule did beyond the formula, in words (L2 decay, maximize)."""
    parts = []
    if any(len(d.reads) == 3 for d in rec.derivations):
        parts.append(f"minus weight_decay * the weights of {rec.prev} (L2 decay)")
    if any(getattr(d.compute, "keywords", {}).get("maximize") for d in rec.derivations):
        parts.append("negated (maximize)")
    return "; " + ", ".join(parts) if parts else ""
