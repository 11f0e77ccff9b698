"""The spike rule that ``gradclip trend`` and ``GradMonitor`` share.

A point is a spike when its z-score against the run's own history is above a
threshold: ``z = (x - mean) / std``, where ``mean`` and ``var`` are
exponential moving averages (factor ``alpha``) of the earlier points, seeded
by the plain mean and variance of the first ``warmup`` of them. Points with
fewer than ``MIN_HISTORY`` earlier points are not judged. Four refinements,
each measured on real short runs (BENCHMARKS.md, "Spike-rule rates" and the
autopsy's rates; ``benchmarks/spike_rates.py``,
``benchmarks/autopsy_rates_olmo_core.py``; the last in
``tests/integrations/test_zero_history.py``):

- ``std`` is at least ``MIN_RELATIVE_STD`` (one half) of ``|mean|``. Mini-batch
  noise in small models and early steps moves a norm by up to 1.8x its
  running mean, and a history of a few calm points has a small ``std``: on
  90 clean real runs without the floor the rule flagged 219 of 4,950 steps
  (z up to 11.2), with it none (largest z 1.63), while every injected 10x
  spike still scored z >= 7.0. At the default ``z`` of 2.5 a norm below 2.25x
  the running mean is never a spike.
- A spike enters the history clipped to ``limit = mean + z * std`` (the norm
  at the threshold), as ZClip updates its averages with the clipped norm,
  instead of being left out: a lasting rise in the norm is taken in over the
  following steps rather than flagged at every one of them.
- The groups of one point are judged at once, each against
  ``group_threshold(z, G)`` for ``G`` groups (Sidak's correction): the chance
  that any of them crosses by noise is then the chance that one series
  crosses ``z``, where judging each at ``z`` made it up to ``G`` times that.
  The total keeps ``z``. On OLMo-core's ``olmo2_1M`` (5 groups), 30 clean
  runs with every group judged at 2.5 had 9 group crossings by batch noise
  in 7 runs (2.34x to 3.45x the running mean); at 5 groups' 3.02 (2.51x
  under the floor) 4 are left, in 4 runs, while every injected
  20-100x spike of one group still scored z 16.9 or more (BENCHMARKS.md).
- A history of exact zeros is no history: it says nothing of a norm's scale.
  Where every earlier point is exactly 0 (``zeros()``: mean and spread both
  0), the point is not judged, and the series' first nonzero point starts
  its history afresh: the warm-up seeds from it and ``MIN_HISTORY`` counts
  from it. Under DDP, FSDP or DeepSpeed's flat gradient buffers a parameter
  no step has used yet (an MoE expert no token reached, a branch gated off
  at init) has a gradient of exact zeros, not None. Against a history of
  zeros (std 0) its first nonzero norm scored z = inf, entered the history
  as its limit, 0, and every later point was a spike: in a real run whose
  one layer was gated off for 10 steps, that layer was flagged at 30 of the
  30 steps after its gate opened, now at none; a total that was 0 made
  every later step a spike of limit 0, which ``clip_spikes`` cannot clip
  to, so it clipped none (a real 10x spike included). A series that was
  nonzero and decays toward 0 keeps its history (its mean is not 0);
  non-finite points are as before.

References:
    Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM Pre-Training",
    2025 (arXiv:2504.02507): ``mu_t = alpha mu + (1 - alpha) g_t``,
    ``var_t = alpha var + (1 - alpha) (g_t - mu_t)^2`` with ``g_t`` the
    clipped norm, z-score threshold 2.5, alpha 0.97, a warm-up of 25 steps.

``SpikeDetector`` judges one series in plain float arithmetic;
``SpikeDetectors`` judges many at once (the monitor's 1,000 groups) in
float64 tensor arithmetic, with the same decisions, z-scores and limits bit
for bit. No I/O.
"""

from __future__ import annotations

import functools
import math
from array import array
from dataclasses import dataclass
from itertools import repeat
from statistics import NormalDist

import torch

MIN_HISTORY = 5
MIN_RELATIVE_STD = 0.5
DEFAULT_Z = 2.5
DEFAULT_ALPHA = 0.97
DEFAULT_WARMUP = 25
# Up to this many series, SpikeSeries keeps one SpikeDetector each (plain
# floats) rather than tensors. CPU time of one logged step, one thread (AMD
# EPYC; benchmarks/spike_series_bench.py): 16 series 29 us after the warm-up
# against 90 us in tensors, 48 series 79 us against 98 us; during the warm-up
# floats cost more from about 20 series on (48: 314 us against 153 us). Over
# a run of 1,000 logged steps (25 of warm-up) floats cost less up to between
# 48 and 64 series. Llama-2-7B's layers make 35 groups, GPT-2's 15.
FEW_SERIES = 48


@functools.lru_cache(maxsize=256)
def group_threshold(z: float, groups: int) -> float:
    """The z each of ``groups`` groups judged at one point must exceed: the one at
    which the chance that any of them crosses by noise is the chance that one
    series crosses ``z`` (Sidak's correction, under the normal model the z-score
    stands on): ``1 - (1 - Q(z_g)) ** groups = Q(z)``, ``Q`` the normal tail.

    ``z`` itself for one group (or none). Past float64's reach of the tail
    (``z`` above about 37) it is the tail's own asymptote, ``sqrt(z**2 + 2 ln groups)``.
    """
    if groups <= 1:
        return z
    tail = 0.5 * math.erfc(z / math.sqrt(2))  # Q(z)
    each = -math.expm1(math.log1p(-tail) / groups)  # 1 - (1 - Q(z)) ** (1 / groups)
    if not each > 0:
        return math.sqrt(z * z + 2 * math.log(groups))
    return max(z, -NormalDist().inv_cdf(each))


@dataclass(frozen=True)
class Judgement:
    """What the rule says of one point.

    ``z`` and ``limit`` are None when the point was not judged; ``limit`` is
    ``mean + z_threshold * std``, the largest value that is not a spike (what
    ZClip clips a spike's norm to).
    """

    z: float | None
    spike: bool
    nonfinite: bool
    limit: float | None = None


class SpikeDetector:
    """Judges one series point by point (one detector per series: total, each group)."""

    def __init__(
        self, z: float = DEFAULT_Z, alpha: float = DEFAULT_ALPHA, warmup: int = DEFAULT_WARMUP
    ):
        if not (z > 0 and math.isfinite(z)):
            raise ValueError(f"z must be a finite number > 0, got {z}")
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup}")
        self.threshold, self.alpha, self.warmup = z, alpha, int(warmup)
        self.seen = 0  # earlier points, judged or not
        self.accepted = 0  # earlier points that entered the averages (the finite ones)
        self.mean = 0.0
        self.spread = 0.0  # the history's standard deviation, before the floor
        self._seed: list[float] = []

    def update(self, x: float, threshold: float | None = None) -> Judgement:
        """Judge ``x`` against the points before it, then let it into the history
        (clipped to the limit if it is a spike; not at all if it is not finite).

        ``threshold``: the z to exceed at this point, if not the detector's own
        (a group's, ``group_threshold``, when several groups are judged at once).
        """
        x = float(x)
        threshold = self.threshold if threshold is None else threshold
        finite = math.isfinite(x)
        if finite and x != 0 and self.accepted and self.zeros():
            self._restart()  # earlier points all 0: x starts the history
        earlier, self.seen = self.seen, self.seen + 1
        if not finite:
            return Judgement(None, False, True)
        if earlier < MIN_HISTORY or self.zeros():
            self._accept(x)
            return Judgement(None, False, False)
        std = self.std()
        z = _ratio(x - self.mean, std)
        limit = self.mean + threshold * std
        spike = z > threshold
        self._accept(limit if spike else x)
        return Judgement(z, spike, False, limit)

    def zeros(self) -> bool:
        """Whether the history is no history: no point yet, or only exact zeros (its
        mean and spread both 0). It says nothing of the norm's scale."""
        return self.mean == 0 and self.spread == 0

    def _restart(self) -> None:
        self.seen = self.accepted = 0
        self.mean = self.spread = 0.0
        self._seed = []

    def std(self) -> float:
        """The history's standard deviation, floored at ``MIN_RELATIVE_STD * |mean|``."""
        return max(self.spread, MIN_RELATIVE_STD * abs(self.mean))

    @property
    def var(self) -> float:
        return self.spread * self.spread

    def _accept(self, x: float) -> None:
        # The spread is kept as a standard deviation, each square taken relative to
        # the largest term: a finite norm anywhere in float's range (1e154 squared,
        # 1e308 summed) keeps a finite spread, never an OverflowError or an infinite
        # std that would hide every later spike. Only a warm-up mean whose sum rounds
        # past float's largest is inf, as IEEE rounds it (``fsum``).
        self.accepted += 1
        if self.accepted <= self.warmup:
            self._seed.append(x)
            n = len(self._seed)
            self.mean = fsum([v / n for v in self._seed])
            self.spread = _rms([v - self.mean for v in self._seed], [1 / n] * n)
            if self.accepted == self.warmup:
                self._seed = []
            return
        self.mean = self.alpha * self.mean + (1 - self.alpha) * x
        self.spread = _ema_rms(self.spread, x - self.mean, self.alpha)


def _ema_rms(spread: float, d: float, alpha: float) -> float:
    """``sqrt(alpha * spread**2 + (1 - alpha) * d**2)``, scaled as ``_rms`` is, without its
    lists: the monitor makes this update for every group on every logged step."""
    top = max(spread, abs(d))
    if top == 0 or not math.isfinite(top):
        return top
    a, b = spread / top, d / top
    return top * math.sqrt(alpha * a * a + (1 - alpha) * b * b)


def _rms(values: list[float], weights: list[float]) -> float:
    """``sqrt(sum(w * v**2))`` without overflow or underflow: squares of ``v / max|v|``."""
    top = max(abs(v) for v in values)
    if top == 0 or not math.isfinite(top):
        return top
    return top * math.sqrt(fsum([w * (v / top) ** 2 for v, w in zip(values, weights)]))


def fsum(values: list[float]) -> float:
    """``math.fsum`` (the correctly rounded sum of finite floats), where an exact sum that
    rounds past float's largest is ``inf``, as IEEE rounding has it: ``math.fsum`` raises
    OverflowError there, and also when only a partial sum overflows (three thirds of
    float's largest). Then twice the correctly rounded half-sum is the correctly rounded
    sum, or ``inf``: halving is exact but for subnormal terms, whose lost bit (2**-1075)
    cannot move a sum this large across a rounding boundary, save at an exact tie."""
    try:
        return math.fsum(values)
    except OverflowError:
        return 2.0 * math.fsum([v * 0.5 for v in values])


def _ratio(rise: float, std: float) -> float:
    # A judged history is never all zeros (that is no history), so std is 0 only
    # where half of a subnormal mean rounds to 0 over a spread of 0: any rise from
    # there is infinitely many standard deviations, as the tensors' x / +0 is.
    if std == 0:
        return 0.0 if rise == 0 else math.copysign(math.inf, rise)
    return rise / std


# -- many series at once -------------------------------------------------------

F64 = torch.float64
_SPLIT = 134217729.0  # 2**27 + 1: Veltkamp's split of a float64 into two halves
# A square r * r is taken for Python's r ** 2 (the C library's pow) only where
# the exact square is further than 0.45 ulp from a rounding midpoint: a pow
# within 0.55 ulp of exact (glibc's is within 0.52) rounds it the same way.
# The others, about one in ten, are squared by Python itself.
_SAFE_SQUARE_ERROR = 0.45
_TINY_RATIO = 2.0**-450  # below it Dekker's exact product can underflow
# A warm-up with a point this large has a mean or a spread that is not 0: where
# the mean is 0 the spread is at least the point over the square root of the
# warm-up's length, far above float64's smallest.
_TINY_SEED = 2.0**-900
_ZERO = torch.zeros((), dtype=torch.float64)
# Columns in doubt that math.fsum sums faster than a second pass of TwoSums would.
_FEW_IN_DOUBT = 48


@dataclass(frozen=True)
class Judgements:
    """What the rule says of one point of each series (float64 and bool tensors).

    ``z`` and ``limit`` hold a value only where ``judged`` (NaN elsewhere).
    """

    judged: torch.Tensor
    z: torch.Tensor
    spike: torch.Tensor
    nonfinite: torch.Tensor
    limit: torch.Tensor


class SpikeDetectors:
    """``SpikeDetector``'s rule over many series at once, in float64 tensors.

    Series are numbered in the order ``add`` makes them; ``update`` judges one
    point of each series it is given. Every decision, z-score, limit and piece
    of state is what one ``SpikeDetector`` per series computes, bit for bit
    (``tests/core/test_spike_series.py`` holds it to that): the averages are
    the same float64 operations in the same order; the warm-up's ``fsum`` (a
    correctly rounded sum) is an error-free sum whose rounding is certified
    (``_fsum_columns``); Python's squares are ``r * r`` where that is
    certainly what ``pow`` gives (``_python_squares``); square roots are
    ``math.sqrt``'s. A series whose history overflows or is not finite is
    updated by a ``SpikeDetector`` built from its state.

    The monitor asks only for decisions (``scores=False``): then a warm-up
    point far enough from the threshold, by a proven bound, is decided from
    plain sums of the seed, and the exact warm-up mean and spread are worked
    out only when needed (a point near the threshold, a spike, the end of the
    warm-up, a read of ``mean`` or ``spread``). Measured on 1,000 groups: 0.1
    to 0.4 ms a warm-up step, against 1.2 to 3.4 ms with scores and 3 to 5 ms
    for 1,000 ``SpikeDetector`` objects.
    """

    def __init__(
        self, z: float = DEFAULT_Z, alpha: float = DEFAULT_ALPHA, warmup: int = DEFAULT_WARMUP
    ):
        SpikeDetector(z, alpha, warmup)  # the same checks and messages
        self.threshold, self.alpha, self.warmup = z, alpha, int(warmup)
        self._stale: int | None = None  # see below
        self.seen = torch.zeros(0, dtype=torch.int64)
        self.accepted = torch.zeros(0, dtype=torch.int64)
        self.mean = torch.zeros(0, dtype=F64)
        self.spread = torch.zeros(0, dtype=F64)
        # The warm-up points of each series, one row per point (row k: each
        # series' k-th accepted point; series i has accepted[i] of them), as
        # many rows as the longest warm-up so far, dropped once all are past it.
        self.seed = torch.zeros((0, 0), dtype=F64)
        # (seen, accepted) while every series has the same counts and a finite
        # history (the monitor's groups, step after step): no masks needed.
        self._in_step: tuple[int, int] | None = (0, 0)
        # While the series warm up in step and only decisions are asked for
        # (``scores=False``), mean and spread are worked out from the seed only
        # when something needs them (see ``_decide_from_seed``): how many seed
        # points they are to be worked out from, or None when up to date.
        self._stale = None

    def __len__(self) -> int:
        return self.seen.numel()

    @property
    def mean(self) -> torch.Tensor:
        """Each series' running mean (``SpikeDetector.mean``)."""
        self._settle()
        return self._mean

    @mean.setter
    def mean(self, value: torch.Tensor) -> None:
        self._mean = value

    @property
    def spread(self) -> torch.Tensor:
        """Each series' standard deviation before the floor (``SpikeDetector.spread``)."""
        self._settle()
        return self._spread

    @spread.setter
    def spread(self, value: torch.Tensor) -> None:
        self._spread = value

    def _settle(self) -> None:
        """Mean and spread of the seed as ``_accept`` leaves them, if they are behind."""
        if self._stale is not None:
            n, self._stale = self._stale, None
            self._mean, self._spread = _warmup_series(self.seed[:n], n)

    def add(self, count: int) -> None:
        """``count`` new series, with no history, after the existing ones."""
        self._settle()
        if count and len(self) and self._in_step != (0, 0):
            self._in_step = None
        self.seen = torch.cat([self.seen, torch.zeros(count, dtype=torch.int64)])
        self.accepted = torch.cat([self.accepted, torch.zeros(count, dtype=torch.int64)])
        self.mean = torch.cat([self.mean, torch.zeros(count, dtype=F64)])
        self.spread = torch.cat([self.spread, torch.zeros(count, dtype=F64)])
        self.seed = torch.cat(
            [self.seed, torch.zeros((self.seed.shape[0], count), dtype=F64)], dim=1
        )

    @classmethod
    def of(cls, detectors: list[SpikeDetector]) -> SpikeDetectors:
        """The series of ``detectors`` (one rule), each in its detector's state."""
        first = detectors[0]
        many = cls(first.threshold, first.alpha, first.warmup)
        many.add(len(detectors))
        many.seen = torch.tensor([d.seen for d in detectors], dtype=torch.int64)
        many.accepted = torch.tensor([d.accepted for d in detectors], dtype=torch.int64)
        many.mean = torch.tensor([d.mean for d in detectors], dtype=F64)
        many.spread = torch.tensor([d.spread for d in detectors], dtype=F64)
        many._widen(max(len(d._seed) for d in detectors))
        for i, d in enumerate(detectors):
            if d._seed:
                many.seed[: len(d._seed), i] = torch.tensor(d._seed, dtype=F64)
        many._in_step = None  # worked out again by the next update
        return many

    def detector(self, series: int) -> SpikeDetector:
        """A ``SpikeDetector`` in the state of ``series``."""
        d = SpikeDetector(self.threshold, self.alpha, self.warmup)
        d.seen, d.accepted = int(self.seen[series]), int(self.accepted[series])
        d.mean, d.spread = float(self.mean[series]), float(self.spread[series])
        if d.accepted < self.warmup:
            d._seed = self.seed[: d.accepted, series].tolist()
        return d

    def update(
        self, x: torch.Tensor, series: torch.Tensor | None = None, *, scores: bool = True,
        threshold: float | None = None,
    ) -> Judgements:
        """Judge ``x[i]`` as the next point of series ``series[i]`` (of series i when
        ``series`` is None), then let it into that history, as ``SpikeDetector.update``.

        With ``scores=False`` only the decisions are certain to be given: ``z``
        and ``limit`` may be NaN where a point is not a spike (the monitor's
        groups, whose z-scores are not logged). Decisions and state are the same.
        ``threshold``: the z every point given must exceed, if not ``self.threshold``.
        """
        x = x.to(F64)
        threshold = self.threshold if threshold is None else threshold
        if series is None and self._in_step is not None and len(x):
            judged = self._update_in_step(x, scores, threshold)
            if judged is not None:
                return judged
        self._settle()
        self._in_step = None
        judged = self._update(x, series, threshold)
        if len(self) and bool(
            (self.seen == self.seen[0]).all()
            & (self.accepted == self.accepted[0]).all()
        ) and _finite(self.mean, self.spread):
            self._in_step = (int(self.seen[0]), int(self.accepted[0]))
        return judged

    def _update_in_step(
        self, x: torch.Tensor, scores: bool, threshold: float
    ) -> Judgements | None:
        """``update`` of every series when all have the same counts and a finite
        history, and every ``x`` is finite; None (nothing changed) otherwise."""
        seen, accepted = self._in_step
        judged = seen >= MIN_HISTORY and accepted > 0
        # Series whose history is only zeros (no history: not judged), if any. A
        # seed column with a point of at least _TINY_SEED has a mean or a spread
        # that is not 0, one of zeros has both 0: the exact mean and spread are
        # needed only where the largest point is tiny but not 0.
        zeros = None
        if accepted > 0:
            if self._stale is not None:
                top = self.seed[: self._stale].abs().amax(dim=0)
                if bool(((top > 0) & (top < _TINY_SEED)).any()):
                    self._settle()
                else:
                    zeros = top == 0
            if self._stale is None:
                zeros = (self._mean == 0) & (self._spread == 0)
            if not bool(zeros.any()):
                zeros = None
            elif bool((zeros & (x != 0) & torch.isfinite(x)).any()):
                return None  # a series starts its history afresh: counts part
        if judged and self._stale is not None and not scores:
            decided = self._decide_from_seed(x, accepted, threshold)
            if decided is None:
                return None
            z, limit, spike = decided
        elif judged:
            # A history in step is finite (see update); one worked out from the
            # seed just now is checked.
            settled = self._stale is not None
            self._settle()
            mean, spread = self._mean, self._spread
            if settled and not _finite(mean, spread):
                return None
            std = torch.maximum(spread, mean.abs() * MIN_RELATIVE_STD)
            z = torch.nan_to_num((x - mean) / std, nan=0.0, posinf=math.inf, neginf=-math.inf)
            limit = mean + std * threshold
            spike = z > threshold
        else:
            nan = torch.full_like(x, math.nan)
            z, limit, spike = nan, nan, torch.zeros_like(x, dtype=torch.bool)
        if judged and zeros is not None:
            spike = spike & ~zeros
            z, limit = (torch.where(zeros, math.nan, t) for t in (z, limit))
        value = torch.where(spike, limit, x) if judged else x
        # x itself too: an infinite x is a spike, and its value the finite limit.
        if not (_finite(x, value) if judged else _finite(x)):
            return None
        accepted += 1
        if accepted <= self.warmup:
            self._widen(accepted)
            self.seed[accepted - 1] = value
            if scores or accepted == self.warmup:
                stale = None
                mean, spread = _warmup_series(self.seed[:accepted], accepted)
            else:  # worked out when needed, from the seed
                stale, mean, spread = accepted, self._mean, self._spread
        else:
            self._settle()  # up to date already: the warm-up's end settles it
            stale = None
            mean = self._mean * self.alpha + value * (1 - self.alpha)
            spread = _ema_rms_series(self._spread, value - mean, self.alpha)
        if stale is None and not _finite(mean, spread):
            return None  # nothing changed: the seed row written is past what the counts say
        self._mean, self._spread, self._stale = mean, spread, stale
        self.seen = self.seen + 1
        self.accepted = self.accepted + 1
        self._in_step = (seen + 1, accepted)
        if accepted >= self.warmup and self.seed.numel():
            self.seed = torch.zeros((0, len(self)), dtype=F64)
        every = torch.full_like(spike, judged)
        if judged and zeros is not None:
            every &= ~zeros
        return Judgements(every, z, spike, torch.zeros_like(spike), limit)

    def _decide_from_seed(self, x: torch.Tensor, n: int, threshold: float):
        """Spike decisions of every series from its ``n`` warm-up points, without
        their exact mean and spread where a bound shows it needs none.

        A plain float64 mean ``a`` and root mean square ``r`` of the points are
        within ``em`` and ``es`` of ``_accept``'s (the sums' rounding, Higham
        4.2, and that of each step of ``_rms``, bounded generously), so the
        z-score from them is within ``bz`` of the rule's. A series whose score
        is further than that from the threshold is decided; the others, and
        every spike (whose limit enters the history), get the exact rule.
        Returns (z, limit, spike), z and limit NaN where decided so; None if
        something is not finite.
        """
        u = 2.0**-53
        points = self.seed[:n]
        a = points.sum(dim=0) / n
        em = points.abs().sum(dim=0) * ((n + 3) * u / n)
        d = points - a
        r = ((d * d).sum(dim=0) / n).sqrt()
        es = em + (r + em) * (2 * (n + 20) * u)
        std = torch.maximum(r, a.abs() * MIN_RELATIVE_STD)
        est = es + em
        rise = x - a
        z = rise / std
        bz = 2 * (
            (z.abs() + 1) * (4 * u) + em / std + (rise.abs() + em) * est / (std * (std - est))
        )
        # NaN anywhere (an overflow) compares false: not decided here.
        decided = (std > 2 * est) & ((z - threshold).abs() > 2 * bz)
        spike = decided & (z > threshold)
        exact = (~decided | spike).nonzero().flatten()
        nan = torch.full_like(x, math.nan)
        z, limit = nan, nan.clone()
        if exact.numel():
            mean, spread = _warmup_series(points.index_select(1, exact), n)
            if not _finite(mean, spread):
                return None
            std = torch.maximum(spread, mean.abs() * MIN_RELATIVE_STD)
            xs = x.index_select(0, exact)
            z[exact] = torch.nan_to_num(
                (xs - mean) / std, nan=0.0, posinf=math.inf, neginf=-math.inf
            )
            limit[exact] = mean + std * threshold
            spike[exact] = z[exact] > threshold
        return z, limit, spike

    def _update(
        self, x: torch.Tensor, series: torch.Tensor | None, threshold: float
    ) -> Judgements:
        if series is None:
            state = (self.seen, self.accepted, self.mean, self.spread)
        else:
            state = tuple(t[series] for t in (self.seen, self.accepted, self.mean, self.spread))
        seen, accepted, mean, spread = state
        finite = torch.isfinite(x)
        # A history of zeros (mean and spread 0; none at all, too) is no history:
        # a finite nonzero point starts it afresh (SpikeDetector._restart).
        zeros = (mean == 0) & (spread == 0)
        restart = zeros & finite & (x != 0) & (accepted > 0)
        if bool(restart.any()):
            seen = torch.where(restart, 0, seen)
            accepted = torch.where(restart, 0, accepted)
        judged = finite & (seen >= MIN_HISTORY) & ~zeros
        std = torch.maximum(spread, mean.abs() * MIN_RELATIVE_STD)
        rise = x - mean
        # _ratio: std is 0 only where half a subnormal mean rounds to 0 over a spread
        # of 0, where 0 / 0 is 0 and any rise is infinite (IEEE's x / +0 is inf with
        # the sign of x).
        z = torch.nan_to_num(rise / std, nan=0.0, posinf=math.inf, neginf=-math.inf)
        limit = mean + std * threshold
        spike = judged & (z > threshold)
        nan = torch.full_like(x, math.nan)
        z, limit = torch.where(judged, z, nan), torch.where(judged, limit, nan)
        value = torch.where(spike, limit, x)  # what enters the history

        new_accepted = accepted + finite
        new_seen = seen + 1
        # A series the tensors cannot vouch for goes to a SpikeDetector: a
        # history gone infinite (norms near float64's limit), a limit that overflowed.
        odd = ~(torch.isfinite(mean) & torch.isfinite(spread)) | (finite & ~torch.isfinite(value))
        warming = finite & ~odd & (new_accepted <= self.warmup)
        settled = finite & ~odd & (new_accepted > self.warmup)
        new_mean, new_spread = mean.clone(), spread.clone()
        if bool(settled.any()):
            # Past the warm-up: the exponential averages, as ``_accept`` and ``_ema_rms``.
            ema_mean = mean * self.alpha + value * (1 - self.alpha)
            ema_spread = _ema_rms_series(spread, value - ema_mean, self.alpha)
            new_mean = torch.where(settled, ema_mean, new_mean)
            new_spread = torch.where(settled, ema_spread, new_spread)
        index = series if series is not None else torch.arange(len(x))
        if bool(warming.any()):
            warm = warming.nonzero().flatten()
            counts = new_accepted[warm]
            width = int(counts.max())
            self._widen(width)
            if warm.numel() == len(self) and series is None and bool((counts == width).all()):
                self.seed[width - 1] = value  # every series, in step: no gathering
                points = self.seed[:width]
            else:
                self.seed[counts - 1, index[warm]] = value[warm]
                points = self.seed[:width, index[warm]]
            new_mean[warm], new_spread[warm] = _warmup_series(points, counts)
        odd |= finite & ~(torch.isfinite(new_mean) & torch.isfinite(new_spread))

        for i in odd.nonzero().flatten().tolist():
            k = int(index[i])
            d = self.detector(k)
            j = d.update(float(x[i]), threshold)
            judged[i], spike[i] = j.z is not None, j.spike
            z[i] = math.nan if j.z is None else j.z
            limit[i] = math.nan if j.limit is None else j.limit
            new_seen[i], new_accepted[i] = d.seen, d.accepted
            new_mean[i], new_spread[i] = d.mean, d.spread
            if d._seed:
                self._widen(len(d._seed))
                self.seed[: len(d._seed), k] = torch.tensor(d._seed, dtype=F64)
        if series is None:
            self.seen, self.accepted, self.mean, self.spread = (
                new_seen,
                new_accepted,
                new_mean,
                new_spread,
            )
        else:
            for t, new in zip(
                (self.seen, self.accepted, self.mean, self.spread),
                (new_seen, new_accepted, new_mean, new_spread),
            ):
                t[series] = new
        if self.seed.numel() and bool((self.accepted >= self.warmup).all()):
            self.seed = torch.zeros((0, len(self)), dtype=F64)
        return Judgements(judged, z, spike, ~finite, limit)

    def _widen(self, width: int) -> None:
        if width > self.seed.shape[0]:
            width = min(self.warmup, max(width, 2 * self.seed.shape[0]))
            wider = torch.zeros((width, len(self)), dtype=F64)
            wider[: self.seed.shape[0]] = self.seed
            self.seed = wider


class SpikeSeries:
    """The rule's decisions over a growing set of series (the monitor's groups).

    While there are at most ``few`` series, each is one ``SpikeDetector``:
    plain float arithmetic, no tensor op, a few microseconds a series. Past
    that they move, state and all, to one ``SpikeDetectors``, whose few dozen
    tensor ops a step cost the same for 50 series or 1,000. Either way each
    series is decided as its own ``SpikeDetector`` decides it.
    """

    def __init__(
        self,
        z: float = DEFAULT_Z,
        alpha: float = DEFAULT_ALPHA,
        warmup: int = DEFAULT_WARMUP,
        few: int = FEW_SERIES,
    ):
        self._rule = (z, alpha, warmup)
        SpikeDetector(*self._rule)  # the same checks and messages
        self.warmup, self.few = int(warmup), few
        self.detectors: list[SpikeDetector] | None = []  # None once they have moved
        self.many: SpikeDetectors | None = None

    def __len__(self) -> int:
        return len(self.detectors) if self.many is None else len(self.many)

    def add(self, count: int) -> None:
        """``count`` new series, with no history, after the existing ones."""
        if self.many is None and len(self.detectors) + count <= self.few:
            self.detectors += [SpikeDetector(*self._rule) for _ in range(count)]
            return
        if self.many is None:
            if self.detectors:
                self.many = SpikeDetectors.of(self.detectors)
            else:
                self.many = SpikeDetectors(*self._rule)
            self.detectors = None
        self.many.add(count)

    def spikes(
        self, x: torch.Tensor, series: list[int] | None, rows: torch.Tensor | None = None,
        threshold: float | None = None,
    ) -> tuple[list[int], bool]:
        """Judge ``x[i]`` as the next point of series ``series[i]`` (of series i
        when ``series`` is None) and let it into that history.

        Returns the indexes ``i`` that are spikes, and whether any of them is a
        spike of a series that had ``warmup`` earlier points. ``rows`` is
        ``series`` as an int64 tensor, if the caller keeps one; ``threshold``
        the z each point must exceed, if not the rule's own ``z``.
        """
        if self.many is None:
            picked = self.detectors if series is None else [self.detectors[k] for k in series]
            spiked, settled = [], False
            for i, (d, value) in enumerate(zip(picked, x.tolist())):
                earlier = d.seen
                if d.update(value, threshold).spike:
                    spiked.append(i)
                    settled = settled or earlier >= self.warmup
            return spiked, settled
        if series is not None and rows is None:
            rows = torch.tensor(series, dtype=torch.int64)
        seen = self.many.seen if rows is None else self.many.seen[rows]
        judged = self.many.update(x, rows, scores=False, threshold=threshold)
        spiked = judged.spike.nonzero().flatten().tolist()
        settled = bool(spiked) and bool((judged.spike & (seen >= self.warmup)).any())
        return spiked, settled


def _ema_rms_series(spread: torch.Tensor, d: torch.Tensor, alpha: float) -> torch.Tensor:
    """``_ema_rms`` of each series, the same operations in the same order."""
    top = torch.maximum(spread, d.abs())
    a, b = spread / top, d / top
    out = top * _sqrt(a * alpha * a + b * (1 - alpha) * b)
    return torch.where(_positive_finite(top), out, top)


def _warmup_series(points: torch.Tensor, counts: torch.Tensor | int):
    """The warm-up ``mean`` and ``spread`` of series (columns) whose first
    ``counts[i]`` points (``counts`` of each, if a number) are ``points[:, i]``,
    as ``_accept`` computes them."""
    width = points.shape[0]
    if isinstance(counts, int) or bool((counts == width).all()):
        n, used = float(width), None
    else:
        n, used = counts.to(F64), torch.arange(width)[:, None] < counts
    terms = points / n
    mean = _fsum_columns(terms if used is None else torch.where(used, terms, 0.0))
    values = points - mean
    if used is not None:
        values = torch.where(used, values, 0.0)
    top = values.abs().amax(dim=0)
    ratio = values / torch.where(top == 0, 1.0, top)
    sums = _fsum_columns(_python_squares(ratio) * (1 / n))
    return mean, torch.where(_positive_finite(top), top * _sqrt(sums), top)


def _positive_finite(top: torch.Tensor) -> torch.Tensor:
    """Where ``top`` (a maximum of absolute values: >= 0 or NaN) is neither 0, inf
    nor NaN: NaN compares false. Three ops where ``isfinite`` and ``== 0`` are seven."""
    return (top > 0) & (top < math.inf)


def _finite(first: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether every element of ``first`` and ``others`` (tensors of one shape) is
    finite, judged from the sum of them all.

    A sum is finite only if every term is: NaN and inf carry through, and
    inf - inf is NaN. A sum of finite values can still overflow and say
    False; every caller then takes the general path, which is right for any
    values. One op a tensor and two, where ``isfinite(t).all()`` is six a tensor.
    """
    return math.isfinite(float(sum(others, first).sum()))


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """``math.sqrt`` of each element: torch's float64 ``sqrt`` on the CPU is not
    always correctly rounded (SLEEF's, within 0.5001 ulp: 662 of 100,000 random
    inputs differ from ``math.sqrt`` in the last bit)."""
    if not t.numel():
        return t.clone()
    return torch.frombuffer(array("d", map(math.sqrt, t.tolist())), dtype=F64).view(t.shape)


def _fsum_columns(terms: torch.Tensor) -> torch.Tensor:
    """``math.fsum`` of each column (a correctly rounded sum), in tensor arithmetic.

    TwoSums (``_two_sums``) leave ``s`` and errors ``e`` with
    ``s + sum(e)`` exactly the column's sum. ``sum(e)`` in float64 is off by
    at most ``(m - 1) u sum|e|`` (Higham, "Accuracy and Stability of
    Numerical Algorithms", 4.2); the correctly rounded result is
    ``r = s + sum(e)`` rounded, certain when what is left over, bound
    included, stays inside half of the gap to ``r``'s neighbour on its side.
    The columns left in doubt (about 1 in 100 of random norms, half of a
    steady series' sums) are mostly exact ties: a sum of equal norms, a last
    addition that drops one bit. A few are summed by ``math.fsum``; many, by
    the same TwoSums over ``e``, which find ``sum(e)`` exactly, after which one
    rounded addition gives fsum's round-half-even answer (what is still in
    doubt then asks ``math.fsum``).
    """
    s, e = _two_sums(terms)
    if e is None:
        return s + 0.0
    rest, bound = e.sum(dim=0), e.abs().sum(dim=0) * (e.shape[0] * 2.0**-52)
    r = s + rest
    rb = r - s
    left = (s - (r - rb)) + (rest - rb)  # r + left == s + rest exactly
    toward = torch.where(left >= 0, math.inf, -math.inf)
    half = (torch.nextafter(r, toward) - r).abs() * 0.5
    # An overflow anywhere makes a NaN here, and NaN compares false: in doubt.
    doubt = ~((left.abs() + bound) < half * (1 - 2.0**-40))
    doubt = doubt.nonzero().flatten()
    if doubt.numel() <= _FEW_IN_DOUBT:
        return _fsum_in_python(r, terms, doubt)
    s2, e2 = _two_sums(e.index_select(1, doubt))
    exact = torch.ones_like(s2, dtype=torch.bool) if e2 is None else (e2 == 0).all(dim=0)
    # Where the errors summed exactly, s + s2 is the exact sum: its one rounding is fsum's.
    r[doubt] = torch.where(exact, s.index_select(0, doubt) + s2, r.index_select(0, doubt))
    return _fsum_in_python(r, terms, doubt[~(exact & torch.isfinite(r.index_select(0, doubt)))])


def _fsum_in_python(r: torch.Tensor, terms: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``r`` with ``columns`` summed by ``math.fsum`` itself."""
    if columns.numel():
        values = terms.index_select(1, columns).T.contiguous().tolist()
        r[columns] = torch.tensor([fsum(c) for c in values], dtype=F64)
    return r


def _two_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each column of ``x`` as ``s + sum(e)`` exactly: a float sum ``s`` and every
    addition's rounding error (TwoSum, Knuth; error-free without overflow).

    The additions are ``cumsum``'s, one rounded addition per row, which is
    checked (``s_k == s_(k-1) + x_k``, so each error is that addition's): a
    handful of ops whatever the number of rows. Should torch ever sum in
    another order, a pairwise tree of TwoSums does it instead.
    """
    if x.shape[0] < 2:
        return (x[0] if x.shape[0] else torch.zeros(x.shape[1], dtype=F64)), None
    sums = torch.cumsum(x, dim=0)
    before, after, added = sums[:-1], sums[1:], x[1:]
    if bool((after == before + added).all()):
        bb = after - before
        return sums[-1], (before - (after - bb)) + (added - bb)
    s, errors = x, []
    while s.shape[0] > 1:
        if s.shape[0] % 2:
            s = torch.cat([s, torch.zeros_like(s[:1])])
        a, b = s[0::2], s[1::2]
        s = a + b
        bb = s - a
        errors.append((a - (s - bb)) + (b - bb))
    return s[0], torch.cat(errors)


def _python_squares(r: torch.Tensor) -> torch.Tensor:
    """``r ** 2`` elementwise as Python computes it (the C library's ``pow``, which is
    not always ``r * r``: about one square in a thousand differs in its last bit)."""
    p = r * r
    c = r * _SPLIT
    hi = c - (c - r)
    lo = r - hi
    err = ((hi * hi - p) + hi * lo * 2) + lo * lo  # Dekker: p + err == r * r exactly
    gap = p - torch.nextafter(p, _ZERO)
    # |r| >= 2**-450 keeps Dekker's products clear of underflow; 0 ** 2 is 0 * 0.
    sure = ((err.abs() < gap * _SAFE_SQUARE_ERROR) & (p >= _TINY_RATIO * _TINY_RATIO)) | (r == 0)
    unsure = ~sure
    ask = r.masked_select(unsure).tolist()
    if ask:
        p.masked_scatter_(
            unsure, torch.tensor(list(map(float.__pow__, ask, repeat(2.0))), dtype=F64)
        )
    return p
