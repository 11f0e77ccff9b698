"""The autopsy's outlier count: the gradient of a step against Adam's second moment of the
step before (``core/outliers.py``), read from whichever inputs hold them.

``gradients_at`` is the one place that knows which inputs hold the gradient
of a step: a monitor dump of that step, else the two checkpoints of that
step and the one before, whose Adam states determine it
(``source/previous.py``, as ``inspect --previous``). Under ``torchrun`` every
rank reads the two checkpoints whole (the count is elementwise over one
gradient, a small part of the work).
"""

from __future__ import annotations

import torch

from ..core.outliers import adam_outliers
from ..format.text import visible
from ..report.autopsy import Outliers
from ..source.layouts import open_checkpoint
from ..source.previous import gradients_between
from .common import load
from .grouped import MeasureOptions


def gradients_at(step: int, placed: dict[int, list], how: MeasureOptions, steps,
                 why_not: list[str] | None = None
                 ) -> tuple[dict[str, torch.Tensor], str] | None:
    """The gradients of ``step`` by parameter name, and the input they come from (raw); None
    when no input holds them (the reasons a pair of states did not go to ``why_not``).

    A monitor dump of that step (``save_grads``'s file), else two checkpoints whose
    Adam-family states are of that step and the one before: they determine the
    gradient the optimizer used (``source/previous.py``, as ``inspect --previous``).
    """
    for point in placed.get(step, []):
        if point.gradients:
            loaded = load(point.path, how.key, how.trust_pickle, how.verify, steps, "grads")
            return ({n: t.read() for n, t in zip(loaded.names, loaded.tensors)},
                    str(point.path))
    states = [[p for p in placed.get(s, []) if "exp_avg" in p.measured] for s in (step, step - 1)]
    for curr in states[0]:
        for prev in states[1]:
            found = gradients_between(*(
                open_checkpoint(p.path, key=how.key, trust_pickle=how.trust_pickle,
                                verify=how.verify) for p in (curr, prev)))
            if found.gradients is not None:
                return ({n: g for n, g in found.gradients.items()},
                        f"the gradients reconstructed from {prev.path} and "
                        f"{curr.path} (their Adam states, steps apart by one)")
            if why_not is not None:
                why_not.append(found.refusal)
    return None


def second_moment_rms(step: int, placed: dict[int, list], how: MeasureOptions, steps
                      ) -> tuple[dict[str, torch.Tensor], str] | None:
    """``sqrt(v_hat)`` by parameter name from a checkpoint placed at ``step`` (its
    optimizer's own rule: ``grad_rms``), and the checkpoint; None when none holds it."""
    for point in placed.get(step, []):
        if "grad_rms" in point.measured:
            loaded = load(point.path, how.key, how.trust_pickle, how.verify, steps, "grad_rms")
            rms = {}
            for name, d in zip(loaded.names, loaded.selection.derivations):
                rms[name] = d.compute(*[t.read() for t in d.reads])
            return rms, str(point.path)
    return None


def count_outliers(step: int, placed: dict[int, list], how: MeasureOptions, steps, k: float,
                   rule) -> tuple[dict[str, Outliers], list[str]]:
    """Per group (``rule``), the gradient elements of ``step`` with ``|g| > k * sqrt(v_hat)``
    (``core.outliers``) against the second moment of the step before; else no counts
    and the notes that say what the inputs lack."""
    refused: list[str] = []
    grads = gradients_at(step, placed, how, steps, refused)
    if grads is None:
        return {}, [f"outliers: no gradient of step {step} among the inputs (a monitor dump "
                    "of that step holds one, or checkpoints of that step and the one before "
                    "with Adam's state)", *(f"outliers: {visible(why)}" for why in refused)]
    moment = second_moment_rms(step - 1, placed, how, steps)
    if moment is None:
        return {}, [f"outliers: no optimizer state of step {step - 1} (the step before) "
                    "among the inputs: save a checkpoint there to count them"]
    (g, g_source), (rms, m_source) = grads, moment
    counts: dict[str, list[int]] = {}
    for name, tensor in g.items():
        if name not in rms or tuple(rms[name].shape) != tuple(tensor.shape):
            continue
        c = counts.setdefault(rule(name), [0, 0])
        c[0] += adam_outliers(tensor, rms[name], k)
        c[1] += tensor.numel()
    if not counts:
        return {}, [f"outliers: {visible(g_source)} and {visible(m_source)} name no parameter "
                    "alike"]
    return ({group: Outliers(c, n, g_source, m_source) for group, (c, n) in counts.items()},
            [])
