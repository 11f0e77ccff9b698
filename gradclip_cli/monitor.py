"""Watch gradients in the training loop: a JSON Lines log, spikes, and dumps.

``GradMonitor`` is called once per optimizer step, after ``loss.backward()``
and before clipping::

    monitor = GradMonitor(model, log="grads.jsonl", dump_dir="spikes/")
    for step, batch in enumerate(loader):
        loss = model(batch).loss
        loss.backward()
        total = monitor.clip_grad_norm_(1.0, step=step)  # or monitor.step(step), then clip
        optimizer.step()
        optimizer.zero_grad()

Each logged step measures the gradients once, the way ``gradclip inspect``
does (``tensor_power_sums``: accurate in every dtype, tied parameters once),
and appends one line to the log::

    {"schema": "gradclip.monitor/1", "step": 120, "total_norm": 0.84,
     "norm_type": 2.0, "groups": {"transformer.h.0": 0.21, ...},
     "nonfinite": {"nan": 0, "posinf": 0, "neginf": 0},
     "z": 0.4, "spike": false, "spike_groups": [], "dump": null,
     "clipped_to": null, "clip_coef": null, "dump_skipped": null}

Non-finite numbers are the strings ``"nan"`` and ``"inf"``, as in every
gradclip JSON document. ``gradclip trend grads.jsonl`` reads the log.

A spike is judged by the rule ``gradclip trend`` uses (``core.spikes``, ZClip):
the total and every group each have their own history, the step's groups
judged at once against the groups' threshold (``core.spikes.group_threshold``),
and ``spike`` is true when the total or any group spikes; ``z`` is the total's z-score (null while
there is too little history) and ``spike_groups`` names the groups that
spiked. On a non-finite gradient, or a spike once the spiking series has
``warmup`` earlier points, the gradients are saved with
:func:`gradclip_cli.producer.save_grads` to ``dump_dir/step-N.pt`` (with a
``step`` entry), so that ``gradclip inspect dump_dir/step-N.pt`` shows the
culprit layer.

With ``clip_spikes=True`` the monitor also clips a spike, as ZClip's ``percentile``
mode does (docs/guides/training-loop.md): when
the total's z-score is above ``z``, the gradients are scaled so that their
total is the history's ``mean + z * std`` (the spike rule's limit).

Every step whose gradients the monitor scaled records it, whichever limit
did it (``clip_grad_norm_``'s ``max_norm``, the Trainer callback's
``max_norm``, or a spike clip): ``"clipped_to"`` is the total aimed at,
``"clip_coef"`` the factor the gradients were multiplied by (torch's
``min(1, max_norm / (total + 1e-6))``); both are null where nothing was
scaled (a coefficient of 1 changes no gradient). ``gradclip trend`` reads
them back, and says in a run folder's notes that the optimizer saw clipped
gradients.

``"dump"`` is null on most steps; where a spike or a non-finite step has no
dump, ``"dump_skipped"`` says why: the warm-up (a spike is dumped once its
series has ``warmup`` earlier logged steps), ``max_dumps`` reached, no
``dump_dir``, or a write that failed.

``log`` and ``dump_dir`` are checked when the monitor is made (a bad path is
a ``ValueError`` then, not a failure mid-run). A write that fails later (a
full disk, a folder removed) is reported on stderr once and training goes
on: a failed dump leaves its step's line with ``"dump": null``.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import warnings
from array import array
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, is_, is_not
from pathlib import Path
from typing import Any

import torch

from . import api
from .core import (
    Coefficient,
    Elements,
    distinct_elements,
    element_power_sums,
    exact_clip_coefficient,
    find_ties,
    scale_,
    scale_elements_,
    tensor_power_sums,
)
from .core.clipping import EPS
from .core.elements import ApartAgain
from .core.norms import certified_group_norms
from .core.spikes import (
    DEFAULT_ALPHA,
    DEFAULT_WARMUP,
    DEFAULT_Z,
    SpikeDetector,
    SpikeSeries,
    group_threshold,
)
from .distributed import dtensor
from .errors import OutputError, UsageError
from .format.json import nonfinite_object, number
from .nonfinite_origin import NonfiniteLocator
from .producer import save_grads
from .report.grouping import parse_group_by
from .report.groups import Grouping, GroupSums, nonfinite_counts
from .tracker_scalars import TensorBoardScalars, scalars

__all__ = ["SCHEMA", "GradMonitor"]

SCHEMA = "gradclip.monitor/1"

# Each dump is a full copy of the gradients (a 7B model's float32 gradients
# are 28 GB), so only a few are kept; see ``max_dumps``.
DEFAULT_MAX_DUMPS = 5


@dataclass(frozen=True)
class _Plan:
    """What a logged step works out from the parameters' names alone, kept while they
    stay the same: the groups, each group's spike series, and its key in the log line."""

    grouping: Grouping
    series: list[int] | None  # each group's series in the group detectors; None: all, in order
    rows: torch.Tensor | None  # series as a tensor
    groups: str  # '{"name": %s, ...}': the groups' object, names as json writes them


@dataclass(frozen=True)
class _Measurement:
    """One step's gradients (tie duplicates dropped) and their norm summaries."""

    grads: list[torch.Tensor]
    sums: GroupSums  # groups in order of first appearance in named_parameters()
    plan: _Plan
    types: set[torch.dtype]  # the gradients' dtypes
    sharded: bool  # some gradients are DTensors
    # The distinct elements of all the gradients, where some share elements
    # short of a tie, or are sparse: measured and scaled as pieces, once each.
    elements: Elements | None = None

    def scale_(self, coef: Coefficient | torch.Tensor, foreach: bool | None = None) -> None:
        """Multiply every distinct gradient element once, in place, by ``coef``."""
        if self.elements is not None:
            scale_elements_(self.elements, coef, foreach)
        else:
            # A DTensor is scaled through its local tensor, whatever its placements.
            scale_(dtensor.local_tensors(self.grads) if self.sharded else self.grads, coef,
                   foreach=foreach)


class GradMonitor:
    """Log per-group gradient norms every step, flag spikes, save the gradients of bad steps.

    Args:
        model: the module whose parameters' ``.grad`` are watched. Parameters
            are looked up on every logged step, so a model wrapped or moved
            after the monitor was made is still seen as it is then.
        log: the JSON Lines file to append to (its folder is created); None
            for no log. Each line is written with one ``write`` to a file
            opened for appending, so a crash leaves whole lines behind (the
            log is not ``fsync``-ed: a power loss may drop the last lines).
        dump_dir: where gradients are saved on a spike or a non-finite
            gradient, as ``step-N.pt``; None for no dumps.
        every: log every ``every``-th step (steps with ``step % every == 0``).
            The other steps cost nothing in ``step()``; in ``clip_grad_norm_``
            they clip exactly as :func:`gradclip_cli.clip_grad_norm_`, which on
            an accelerator needs no host-device synchronisation. Only logged
            steps synchronise (to read the norms back) and only they are judged
            for spikes.
        norm_type: p of the p-norm, > 0 or ``inf``.
        group_by: how parameter names map to groups, as ``--group-by`` of
            ``gradclip inspect``: ``layer`` (default), ``module``, ``tensor``,
            ``depth:N``, ``regex:PATTERN``.
        z, alpha, warmup: the spike rule's threshold, averaging factor and
            warm-up length (``gradclip trend``'s ``--z``, ``--alpha``, ``--warmup``).
            Spikes are flagged in the log from the 6th logged step (of a
            series whose earlier norms were all exactly 0, the 6th from its
            first nonzero one), as ``trend`` flags them, but dumped only once the series that spiked
            has ``warmup`` earlier points: the first steps of a run move fast,
            and their spikes would use up ``max_dumps``.
        clip_spikes: also clip spikes (ZClip): on a logged step whose total
            is a spike, scale the gradients to the total ``mean + z * std``
            of the history (``step()`` does this too; ``clip_grad_norm_``
            takes the smaller of that and ``max_norm``). Steps that are not
            spikes, and spikes of a group that leave the total below its
            limit, are not changed by it, nor are steps the rule does not
            judge (the first 5 logged steps; after steps whose total was
            exactly 0, those and the first 5 from the first nonzero one). A
            spike is judged only on logged steps, so with ``every=N`` only
            they are clipped.
        max_dumps: at most this many dumps are written (0: none). The *first*
            ones are kept and later ones skipped (their log line says
            ``"dump": null``): when a run diverges it usually spikes or goes
            NaN on every step from then on, and the gradients that explain
            it are those of the onset, which rotating out old dumps would
            delete. Nothing the monitor wrote is ever removed.
        locate_nonfinite: also record where a non-finite value began
            (docs/guides/nan-origin.md): a logged step whose gradients hold a
            NaN or an inf logs ``"nonfinite_origin": {"forward": the first
            module, in forward order, whose output held one, or null;
            "backward": the first parameter, in the order autograd
            accumulated the gradients, whose gradient holds one}``, and
            ``null`` on clean steps. Forward hooks keep a flag per module on
            the device (read only on a non-finite step: a clean step reads
            nothing more); the accumulation order is recorded in the first
            backward, and in later ones until every parameter has had a
            gradient. The forward hooks stay on the model.
        tensorboard: a folder to write TensorBoard scalars to as well (torch's
            ``SummaryWriter``; needs ``pip install 'gradclip[tensorboard]'``,
            else ``ImportError`` here): each logged step's total and group
            norms, spike flag and clip coefficient under the tags
            ``gradclip/total_norm``, ``gradclip/norm/<group>``,
            ``gradclip/spike``, ``gradclip/clip_coef`` (``tracker_scalars``),
            the log's numbers rounded to float32, as TensorBoard stores them.
            ``close()`` flushes them; until then torch's writer flushes every
            120 s.

    Under ``torch.distributed`` every rank measures and clips (so all ranks
    apply the same coefficient), but only rank 0 writes the log and the
    dumps. Gradients are read as each rank holds them: the whole gradient
    under DDP (all-reduced before the optimizer step), or a DTensor under
    FSDP2 and tensor parallelism, whose norms are combined over its mesh as
    :func:`gradclip_cli.get_total_norm` combines them (a few numbers per
    tensor gathered on each logged step; every rank gets the same norms). A
    dump of DTensor gradients gathers each one whole (``full_tensor()``, on
    every rank, as the spike is seen by all) and rank 0 writes them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        log: str | os.PathLike[str] | None = "grads.jsonl",
        dump_dir: str | os.PathLike[str] | None = "spikes/",
        *,
        every: int = 1,
        norm_type: float = 2.0,
        group_by: str = "layer",
        z: float = DEFAULT_Z,
        alpha: float = DEFAULT_ALPHA,
        warmup: int = DEFAULT_WARMUP,
        max_dumps: int = DEFAULT_MAX_DUMPS,
        clip_spikes: bool = False,
        locate_nonfinite: bool = False,
        tensorboard: str | os.PathLike[str] | None = None,
    ):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"GradMonitor: every must be a whole number >= 1, got {every!r}")
        if isinstance(max_dumps, bool) or not isinstance(max_dumps, int) or max_dumps < 0:
            raise ValueError(
                f"GradMonitor: max_dumps must be a whole number >= 0, got {max_dumps!r}"
            )
        if not isinstance(clip_spikes, bool):
            raise ValueError(f"GradMonitor: clip_spikes must be True or False, got {clip_spikes!r}")
        if not isinstance(locate_nonfinite, bool):
            raise ValueError(
                f"GradMonitor: locate_nonfinite must be True or False, got {locate_nonfinite!r}")
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"GradMonitor: norm_type must be > 0 or inf, got {norm_type}")
        try:
            self._group_rule = parse_group_by(group_by)
        except UsageError as e:
            raise ValueError(f"GradMonitor: {e}") from None
        self._total_detector = SpikeDetector(z, alpha, warmup)  # validates z, alpha, warmup
        # Every group's series, judged as one SpikeDetector each would judge it.
        self._group_detectors = SpikeSeries(z, alpha, warmup)
        self._series_of: dict[str, int] = {}

        self.model = model
        self.log_path = None if log is None else _checked_path(log, "log", folder=False)
        self.dump_dir = (
            None if dump_dir is None else _checked_path(dump_dir, "dump_dir", folder=True)
        )
        self.clip_spikes = clip_spikes
        self.every = every
        self.norm_type = norm_type
        self.max_dumps = max_dumps
        self.dumps: list[Path] = []  # written by this monitor, oldest first
        self._group_of: dict[str, str] = {}
        self._parameters = ParameterListing()
        self._apart = ApartAgain()  # the common step's range check, kept between steps
        self._plan_key: tuple | None = None
        self._plan: _Plan | None = None
        self._calls = 0
        self._log_file = None
        self._log_broken = False  # a line was cut short: nothing more is appended
        self._warned_full = False
        self._warned_empty = False
        self._reported: set[str] = set()  # write failures already told on stderr
        self._locator = NonfiniteLocator(model) if locate_nonfinite else None
        # The newest logged record (what the framework adapters pass to their loggers).
        self.last_record: dict[str, Any] | None = None
        self._tensorboard = None if tensorboard is None else TensorBoardScalars(
            _checked_path(tensorboard, "tensorboard", folder=True))

    # -- public --------------------------------------------------------------

    def step(self, step: int | None = None) -> dict[str, Any] | None:
        """Measure, judge and log the gradients as they are now.

        Call after ``backward()`` and before clipping (or use
        :meth:`clip_grad_norm_`). ``step`` defaults to the number of earlier
        calls. Returns the logged record (the JSON line as a dict), or None on
        a step that is not logged (``every``) or when no parameter has a
        gradient. With ``clip_spikes``, a spike's gradients are clipped to
        the limit (see the class).
        """
        step = self._step_number(step)
        if step % self.every:
            return None
        measured = self._measure()
        if measured is None:
            self._warn_no_gradients(step)
            return None
        record, spike_coef = self._observe(step, measured)
        if spike_coef is not None:
            measured.scale_(spike_coef)
        return record

    def clip_grad_norm_(
        self,
        max_norm: float,
        step: int | None = None,
        *,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """:meth:`step`, then clip the gradients to total norm ``max_norm``, in one pass.

        On a logged step, the norms written to the log and the total that
        sets the clip coefficient ``min(1, max_norm / (total + 1e-6))`` come
        from one measurement. Other steps clip as
        :func:`gradclip_cli.clip_grad_norm_` does. Returns the total norm
        before clipping, as that function does: a 0-dim float32 tensor
        (float64 for float64 gradients) on the first gradient's device.

        With ``clip_spikes``, a logged step whose total is a spike is clipped
        to the smaller of ``max_norm`` and the spike rule's limit.

        With ``error_if_nonfinite``, a non-finite total raises ``RuntimeError``
        after the step is logged (and its gradients dumped), before any
        gradient is changed.
        """
        step = self._step_number(step)
        measured = None if step % self.every else self._measure()
        if measured is None:
            if not step % self.every:
                self._warn_no_gradients(step)
            # The parameters as model.parameters() lists them; a model without
            # any still passes the generator, for the drop-in's warning about it.
            params = self._parameters.named(self.model)[1] or self.model.parameters()
            return api.clip_grad_norm_(
                params, max_norm, self.norm_type, error_if_nonfinite, foreach
            )
        max_norm = float(max_norm)
        total_norm = measured.sums.total.norm[0]
        # A refused clip scales nothing, and its line says so (no clip_coef).
        refused = error_if_nonfinite and not math.isfinite(float(total_norm))
        _, coef = self._observe(step, measured, max_norm, scales=not refused)
        first = measured.grads[0]
        wide = torch.float64 in measured.types
        total = total_norm.to(first.device, torch.float64 if wide else torch.float32)
        if refused:
            raise RuntimeError(
                f"The total norm of order {self.norm_type} for gradients from "
                "`parameters` is non-finite, so it cannot be clipped. To disable "
                "this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        measured.scale_(coef, foreach=foreach)
        return total

    def close(self) -> None:
        """Close the log file (it is reopened, for appending, if the monitor logs again)
        and flush the TensorBoard scalars (a later step opens a new event file)."""
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> GradMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workers -------------------------------------------------------------

    def _warn_no_gradients(self, step: int) -> None:
        """Say once that a step to log found no gradient: an empty log is otherwise silent."""
        if self._warned_empty:
            return
        self._warned_empty = True
        warnings.warn(
            f"GradMonitor: no parameter of the model has a gradient at step {step}, so "
            "nothing is logged: call it after backward(). (DeepSpeed keeps the gradients "
            "in its own buffers, not in the parameters' .grad.)",
            stacklevel=3,
        )

    def _step_number(self, step: int | None) -> int:
        if step is None:
            step = self._calls
        self._calls += 1
        if self._locator is not None:
            self._locator.step_taken()  # the next forward starts the next step's flags
        return int(step)

    def _group(self, name: str) -> str:
        group = self._group_of.get(name)
        if group is None:
            group = self._group_of[name] = self._group_rule(name)
        return group

    def _measure(self) -> _Measurement | None:
        """Per-group and total norm summaries of the gradients: one pass over them."""
        names, params = self._parameters.named(self.model)
        grads = list(map(_GRAD, params))
        if all(map(is_not, grads, repeat(None))):
            present = None
        else:
            present = [i for i, g in enumerate(grads) if g is not None]
            if not present:
                return None
            grads = [grads[i] for i in present]
        sharded = dtensor.has_dtensor(grads)
        types = set(map(_DTYPE, grads))  # ties hold one dtype: dropping them keeps these
        # The common step: groups' squares certified as they are summed, on the
        # CPU or on one accelerator.
        certifiable = not sharded and self.norm_type == 2.0 and _one_type(grads, types)
        sizes = numels = None
        if certifiable:
            sizes = list(map(_NUMEL, grads))
            numels = array("q", sizes)  # read once, for the range check and the budget
        elements = None
        if certifiable and self._apart(grads, numels, grads[0].element_size()):
            owner = None  # every gradient dense and its own allocation: the common step
        elif sharded:
            owner = find_ties(dtensor.local_tensors(grads))
        else:
            elements = distinct_elements(grads)
            owner = list(elements.tie_of)
            if _as_pieces(elements, grads):
                certifiable = False
            else:
                elements = None  # each its own elements, or a tie: measured as they are
        kept = None if owner is None or owner == list(range(len(owner))) else [
            i for i, o in enumerate(owner) if o == i]
        if kept is not None:
            grads, sizes, numels = [grads[i] for i in kept], None, None
        plan = self._plan_for(names, present, kept)
        grouping = plan.grouping
        if certifiable:
            certified = certified_group_norms(
                grads, grouping.index, len(grouping.names), sizes, numels)
            if certified is not None:
                sums = GroupSums(grouping.names, grouping.index, *certified)
                return _Measurement(grads, sums, plan, types, sharded)
        # No max |g|: the record does not report it, and the power sums certify
        # the norms by themselves (one pass; on an accelerator, one read).
        if sharded:
            sums = dtensor.tensor_sums(grads, self.norm_type, with_max=False)
        elif elements is not None:
            # Each tensor's own pieces: a tie owns none, overlaps count in the first.
            sums = element_power_sums(elements, self.norm_type, with_max=False)[1]
            if kept is not None:
                sums = sums.take(torch.tensor(kept, dtype=torch.int64))
        else:
            sums = tensor_power_sums(grads, self.norm_type, with_max=False)
        return _Measurement(grads, grouping.sums(sums), plan, types, sharded, elements)

    def _plan_for(
        self, names: list[str], present: list[int] | None, kept: list[int] | None
    ) -> _Plan:
        """The groups of the measured names (``names`` with a gradient, ties once)."""
        key = (self._parameters.version, present, kept)
        if key == self._plan_key:
            return self._plan
        if present is not None:
            names = [names[i] for i in present]
        if kept is not None:
            names = [names[i] for i in kept]
        grouping = Grouping.of([self._group(n) for n in names])
        for group in grouping.names:  # a group seen for the first time: a new series
            self._series_of.setdefault(group, len(self._series_of))
        self._group_detectors.add(len(self._series_of) - len(self._group_detectors))
        series = [self._series_of[g] for g in grouping.names]
        every = series == list(range(len(self._series_of)))
        keys = (json.dumps(g).replace("%", "%%") + ": %s" for g in grouping.names)
        groups = "{" + ", ".join(keys) + "}"
        if every:
            plan = _Plan(grouping, None, None, groups)
        else:
            plan = _Plan(grouping, series, torch.tensor(series, dtype=torch.int64), groups)
        self._plan_key, self._plan = key, plan
        return plan

    def _observe(
        self,
        step: int,
        m: _Measurement,
        max_norm: float | None = None,
        *,
        scales: bool = True,
    ) -> tuple[dict[str, Any], Coefficient | None]:
        """Judge one measurement, dump if needed, log it.

        Returns the record and the coefficient to scale the gradients by:
        with ``max_norm`` (the fixed limit the caller clips to) always, the
        spike rule's limit taken where it is the smaller; without, the spike
        clip's when ``clip_spikes`` clips this step, else None. The record's
        ``clip_coef`` and ``clipped_to`` say what that coefficient does
        wherever it changes the gradients (is not 1). ``scales=False``: the caller
        will not scale this step (``error_if_nonfinite`` refused it): no coefficient.
        """
        total_norm = float(m.sums.total.norm[0])
        norms = m.sums.groups.norm
        group_norms = norms.tolist()
        # A spike is worth a dump only once its series has ``warmup`` earlier
        # points: early training moves fast, and a z-score against a handful
        # of points flags steps that are only a trend.
        settled = self._total_detector.seen >= self._total_detector.warmup
        judged = self._total_detector.update(total_norm)
        worth_a_dump = judged.spike and settled
        # Only the groups' decisions are logged, not their z-scores.
        # The step's groups are judged at once, against the groups' threshold (as trend).
        spiked, settled_spike = self._group_detectors.spikes(
            norms, m.plan.series, m.plan.rows,
            group_threshold(self._total_detector.threshold, len(group_norms)),
        )
        worth_a_dump = worth_a_dump or settled_spike
        names = m.sums.names
        spike_groups = [names[i] for i in spiked]
        nonfinite = nonfinite_object(nonfinite_counts(m.sums.total)[0])
        spike = judged.spike or bool(spike_groups)
        clipped_to = coef = None
        # A history of zero gradients is no history (core.spikes): such a step
        # is not judged. A limit of 0 is kept from clipping all the same, as
        # clipping to it would zero every gradient.
        if (scales and self.clip_spikes and judged.spike and judged.limit is not None
                and judged.limit > 0 and (max_norm is None or judged.limit < max_norm)):
            clipped_to = judged.limit
            # torch's formula, in float64 from the total already read back.
            coef = Coefficient.of(min(1.0, clipped_to / (total_norm + EPS)))
        elif scales and max_norm is not None:
            # From the summary already read back, as the drop-in's on the CPU: known to
            # the host (see core.clipping.scale_), and a total beyond the returned
            # dtype's range (inf there) still clips to max_norm instead of to zero.
            coef = exact_clip_coefficient(m.sums.total, max_norm)
            clipped_to = max_norm
        # A coefficient of 1 changes nothing (scale_ skips it): nothing was clipped.
        scaled = coef is not None and not coef.is_one
        dump = dump_skipped = None
        if worth_a_dump or any(nonfinite.values()):
            # The gradients as they came, before any clip.
            dump, dump_skipped = self._dump(step)
        elif spike:
            dump_skipped = (
                f"warm-up: a spike is dumped once its series has {self._total_detector.warmup} "
                "earlier logged steps (warmup)"
            )
        # A finite sum has finite terms; one that overflows writes them as json does.
        finite = math.isfinite(sum(group_norms))
        values = group_norms if finite else [number(v) for v in group_norms]
        head = {
            "schema": SCHEMA,
            "step": step,
            "total_norm": number(total_norm),
            "norm_type": number(self.norm_type),
        }
        tail = {
            "nonfinite": nonfinite,
            "z": number(judged.z),
            "spike": spike,
            "spike_groups": spike_groups,
            "dump": None if dump is None else str(dump),
            "clipped_to": number(clipped_to) if scaled else None,
            "clip_coef": number(coef.value) if scaled else None,
            "dump_skipped": dump_skipped,
        }
        if self._locator is not None:
            tail["nonfinite_origin"] = self._nonfinite_origin() if any(nonfinite.values()) \
                else None
        record = {**head, "groups": dict(zip(names, values)), **tail}
        if self.log_path is not None and not self._log_broken and _is_writer():
            # json.dumps(record) without walking the 1,000 groups in Python: their
            # keys are encoded once per plan, finite norms are written as %s (repr)
            # writes them (json's float format), NaN and inf as json writes strings.
            groups_text = m.plan.groups % tuple(values if finite else map(json.dumps, values))
            line = (
                json.dumps(head, allow_nan=False)[:-1]
                + ', "groups": '
                + groups_text
                + ", "
                + json.dumps(tail, allow_nan=False)[1:]
            )
            self._write_line(line)
        self._publish(record)
        return record, coef

    def _publish(self, record: dict[str, Any]) -> None:
        """Keep the record for the adapters; write its scalars to TensorBoard (rank 0)."""
        self.last_record = record
        if self._tensorboard is not None and _is_writer():
            try:
                self._tensorboard.write(record["step"], scalars(record))
            except OSError as e:
                self._report("tensorboard", f"GradMonitor: cannot write TensorBoard scalars "
                             f"to {self._tensorboard.log_dir}: {e}; training goes on")

    def _nonfinite_origin(self) -> dict[str, str | None]:
        """Where this step's non-finite value began (``locate_nonfinite``): names as
        ``named_parameters`` gives them, read on this non-finite step only."""
        names, params = self._parameters.named(self.model)
        return self._locator.origin(params, dict(zip(map(id, params), names)))

    def _dump(self, step: int) -> tuple[Path | None, str | None]:
        """Save the gradients of ``step``: the file written, or None and why not."""
        if self.dump_dir is None:
            return None, "no dump_dir"
        # Every rank sees the same norms, so all of them reach here together:
        # DTensor gradients are gathered whole by all ranks for rank 0 to write.
        sharded = dtensor.has_dtensor(
            [p.grad for p in self.model.parameters() if p.grad is not None]
        )
        if not sharded and not _is_writer():
            return None, "written by rank 0 only"
        if len(self.dumps) >= self.max_dumps:
            if not self._warned_full and self.max_dumps and _is_writer():
                warnings.warn(
                    f"GradMonitor: {self.max_dumps} dumps written to {self.dump_dir} "
                    f"(max_dumps); later spikes are logged but not dumped",
                    stacklevel=4,
                )
                self._warned_full = True
            return None, f"max_dumps: {self.max_dumps} dumps written already"
        path = self.dump_dir / f"step-{step}.pt"
        try:
            if _is_writer():
                self.dump_dir.mkdir(parents=True, exist_ok=True)
            save_grads(self.model, path, step=step)
        except (OSError, OutputError) as e:
            # Every rank has gathered its part by now, so rank 0 alone failing
            # leaves no collective waiting.
            self._report(
                "dump",
                f"GradMonitor: cannot write {path}: {e}; training goes "
                "on, this step is logged without its dump",
            )
            return None, f"cannot be written: {e}"
        self.dumps.append(path)
        return path, None

    def _write_line(self, text: str) -> None:
        line = (text + "\n").encode()
        view = memoryview(line)
        try:
            if self._log_file is None:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                # Unbuffered append: each line reaches the file in one write() call
                # (no Python buffer to lose in a crash), at the end of the file.
                self._log_file = open(self.log_path, "ab", buffering=0)  # noqa: SIM115
                if stat.S_ISREG(os.fstat(self._log_file.fileno()).st_mode):
                    self._drop_unfinished_line()
            while view:
                view = view[self._log_file.write(view) :]
        except OSError as e:
            if len(view) < len(line):
                # Part of the line is in the file: a line appended after it would
                # make it unreadable, so the log ends here (``trend`` skips an
                # unfinished last line with a warning).
                self._log_broken = True
                self.close()
                self._report(
                    "log",
                    f"GradMonitor: cannot write {self.log_path}: {e}; "
                    "training goes on, the log stops at this step",
                )
            else:  # nothing of the line was written: later steps try again
                self._report(
                    "log",
                    f"GradMonitor: cannot write {self.log_path}: {e}; "
                    "training goes on, lines that cannot be written are "
                    "dropped",
                )

    def _drop_unfinished_line(self) -> None:
        """Cut a last line without its newline from the log about to be appended to.

        It is a write that never finished (a run that stopped mid-line: a full
        disk, a lost node), and ``trend`` skips it only while it is last: a
        resumed run's lines appended after it would make the log unreadable.
        """
        try:
            with open(self.log_path, "rb") as f:
                end = cut = f.seek(0, os.SEEK_END)
                while cut > 0:
                    start = max(0, cut - 65536)
                    f.seek(start)
                    newline = f.read(cut - start).rfind(b"\n")
                    if newline >= 0:
                        cut = start + newline + 1
                        break
                    cut = start
            if cut < end:
                os.truncate(self.log_path, cut)
        except OSError:  # a log that cannot be read back (write-only): append as it is
            return
        if cut < end:
            print(f"GradMonitor: {self.log_path} ended in a line cut short ({end - cut} "
                  "bytes without a newline, a run that stopped mid-write); dropped before "
                  "appending", file=sys.stderr, flush=True)

    def _report(self, what: str, message: str) -> None:
        """Say on stderr, once per kind of write, that a write failed.

        Not a warning: ``-W error`` would turn it into an exception that ends the run.
        """
        if what not in self._reported:
            self._reported.add(what)
            print(message, file=sys.stderr, flush=True)


_GRAD = attrgetter("grad")
_DTYPE = attrgetter("dtype")
_IS_CPU = attrgetter("is_cpu")
_DEVICE = attrgetter("device")
_NUMEL = torch.Tensor.numel


def _as_pieces(elements: Elements, grads: list[torch.Tensor]) -> bool:
    """Whether some gradient's distinct elements are not simply the tensor (ties
    aside): it shares some with another short of a tie (overlapping views),
    repeats its own (an expansion), or is sparse (an nn.Embedding(sparse=True))."""
    if elements.whole is not None:
        return False
    for i, (grad, piece) in enumerate(zip(grads, elements.owned)):
        if elements.tie_of[i] == i and (
            grad.layout != torch.strided or piece.target is None or piece.sparse is not None
            or piece.target.numel() != grad.numel()
        ):
            return True
    return False


def _one_type(grads: list[torch.Tensor], types: set[torch.dtype]) -> bool:
    """Whether ``grads`` (of dtypes ``types``) are of one type that
    ``certified_group_norms`` reads: float32 or float64 on the CPU, float16,
    bfloat16 or float32 on one accelerator."""
    if len(types) != 1:
        return False
    if grads[0].is_cpu:
        return types <= {torch.float32, torch.float64} and all(map(_IS_CPU, grads))
    return (types <= {torch.float16, torch.bfloat16, torch.float32}
            and len(set(map(_DEVICE, grads))) == 1)


class ParameterListing:
    """``model.named_parameters()``, listed again only when the model has changed.

    Listing walks every module (1.2 ms for 1,000 of them, more than torch's
    whole ``clip_grad_norm_`` of their gradients), so the list is kept with
    what it was read from: every module's class, the keys and objects of its
    ``_parameters`` and ``_modules``. Those are what ``named_parameters``
    reads; when all are as they were (a few passes over them at C speed),
    its answer would be the same. The reading holds the objects themselves,
    compared by identity. A model whose class lists its
    parameters in its own way is asked every time.
    """

    def __init__(self) -> None:
        self.version = 0  # changes whenever the lists read differ from the last ones
        self._model: object = None
        self._modules: list[torch.nn.Module] = []
        self._seen: _Reading | None = None
        self._names: list[str] = []
        self._params: list[torch.nn.Parameter] = []

    def named(self, model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Parameter]]:
        """The names and parameters ``model.named_parameters()`` gives now."""
        if model is self._model and self._seen is not None and self._seen.holds(self._modules):
            return self._names, self._params
        named = list(model.named_parameters())
        names, params = [n for n, _ in named], [p for _, p in named]
        # A model asked every time mostly answers as it did: what is made from
        # the lists (the log's groups) is made again only when they change.
        if names != self._names or len(params) != len(self._params) or not all(
            map(is_, params, self._params)
        ):
            self.version += 1
        self._names, self._params = names, params
        modules = [m for _, m in model.named_modules()] if _cacheable(model) else None
        if modules is not None and all(_cacheable(m) for m in modules):
            self._model, self._modules, self._seen = model, modules, _Reading(modules)
        else:
            self._model, self._modules, self._seen = None, [], None
        return names, params


_MODULE = torch.nn.Module


def _cacheable(module: object) -> bool:
    """Whether ``named_parameters`` of ``module`` is ``torch.nn.Module``'s own, reading
    plain dicts (a class with its own listing is asked every time)."""
    kind = type(module)
    return (
        isinstance(module, _MODULE)
        and kind.named_parameters is _MODULE.named_parameters
        and kind.named_modules is _MODULE.named_modules
        and kind._named_members is _MODULE._named_members
        and type(module.__dict__.get("_parameters")) is dict
        and type(module.__dict__.get("_modules")) is dict
    )


class _Reading:
    """Everything of some modules that ``named_parameters`` reads: each one's class,
    and the keys and values of its ``_parameters`` and ``_modules`` dicts (those
    dict objects themselves, which ``_cacheable`` has found to be plain dicts)."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.dicts = _dicts(modules)
        self.types = list(map(type, modules))
        # Most dicts are empty (a leaf's _modules, a container's _parameters):
        # that they still are says all there is, and only the others are walked.
        self.empty = [d for d in self.dicts if not d]
        self.full = [d for d in self.dicts if d]
        self.lens = list(map(len, self.full))
        self.keys = list(chain.from_iterable(self.full))
        self.values = list(chain.from_iterable(map(dict.values, self.full)))

    def holds(self, modules: list[torch.nn.Module]) -> bool:
        """Whether ``modules`` (the ones read) are still as read. The values
        (modules, parameters) are compared as objects: ``==`` on tensors would
        compare their elements."""
        dicts = _dicts(modules)
        return (
            all(map(is_, dicts, self.dicts))  # the same dicts: the full ones are self.full
            and list(map(type, modules)) == self.types
            and not any(self.empty)
            and list(map(len, self.full)) == self.lens
            and list(chain.from_iterable(self.full)) == self.keys
            and all(map(is_, chain.from_iterable(map(dict.values, self.full)), self.values))
        )


def _dicts(modules: list[torch.nn.Module]) -> list[dict]:
    dicts = list(map(_PARAMETERS, modules))
    dicts += map(_CHILDREN, modules)
    return dicts


_PARAMETERS = attrgetter("_parameters")
_CHILDREN = attrgetter("_modules")


def _checked_path(path: str | os.PathLike[str], what: str, *, folder: bool) -> Path:
    """``path`` as a Path, once it is clear that the monitor can write there.

    The log (``folder=False``) must be a file to append to, or a character
    device such as ``/dev/stdout``; ``dump_dir`` a folder. Either may not
    exist yet: then the nearest existing folder above it must be one that
    can be written to. Raises ``ValueError`` naming the option otherwise.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # a part of the path is a file, a loop of links, ...
        raise ValueError(
            f"GradMonitor: {what}={str(path)!r} cannot be used: {e.strerror}"
        ) from None
    if mode is not None:
        if folder and not stat.S_ISDIR(mode):
            raise ValueError(f"GradMonitor: {what}={str(path)!r} is not a folder")
        if not folder and not (stat.S_ISREG(mode) or stat.S_ISCHR(mode)):
            kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise ValueError(f"GradMonitor: {what}={str(path)!r} is {kind}")
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            raise ValueError(f"GradMonitor: {what}={str(path)!r} cannot be written to")
        return path
    above = path.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ValueError(
            f"GradMonitor: {what}={str(path)!r} cannot be made: {str(above)!r} is not a folder"
        )
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(
            f"GradMonitor: {what}={str(path)!r} cannot be made: {str(above)!r} cannot be written to"
        )
    return path


def _is_writer() -> bool:
    """Rank 0 of an initialised ``torch.distributed`` job, or a single process.

    Asked at every write: launchers (Lightning, accelerate) initialise the
    process group after the monitor is made.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True
