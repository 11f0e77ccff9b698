"""The spike rule that ``gradclip trend`` and ``GradMonitor`` share.

A point is a spike when its z-score against the run's own history is above a
threshold: ``z = (x - mean) / std``, where ``mean`` and ``var`` are
exponential moving averages (factor ``alpha``) of the earlier points, seeded
by the plain mean and variance of the first ``warmup`` of them. Points with
fewer than ``MIN_HISTORY`` earlier points are not judged. Two refinements,
both measured on real short runs (BENCHMARKS.md, "Spike detection on real
runs"; ``benchmarks/spike_rates.py``):

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

References:
    Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM Pre-Training",
    2025 (arXiv:2504.02507): ``mu_t = alpha mu + (1 - alpha) g_t``,
    ``var_t = alpha var + (1 - alpha) (g_t - mu_t)^2`` with ``g_t`` the
    clipped norm, z-score threshold 2.5, alpha 0.97, a warm-up of 25 steps.

Pure float arithmetic: no tensors, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_HISTORY = 5
MIN_RELATIVE_STD = 0.5
DEFAULT_Z = 2.5
DEFAULT_ALPHA = 0.97
DEFAULT_WARMUP = 25


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

    def __init__(self, z: float = DEFAULT_Z, alpha: float = DEFAULT_ALPHA,
                 warmup: int = DEFAULT_WARMUP):
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

    def update(self, x: float) -> Judgement:
        """Judge ``x`` against the points before it, then let it into the history
        (clipped to the limit if it is a spike; not at all if it is not finite)."""
        x = float(x)
        earlier, self.seen = self.seen, self.seen + 1
        if not math.isfinite(x):
            return Judgement(None, False, True)
        if earlier < MIN_HISTORY or self.accepted == 0:
            self._accept(x)
            return Judgement(None, False, False)
        std = self.std()
        z = _ratio(x - self.mean, std)
        limit = self.mean + self.threshold * std
        spike = z > self.threshold
        self._accept(limit if spike else x)
        return Judgement(z, spike, False, limit)

    def std(self) -> float:
        """The history's standard deviation, floored at ``MIN_RELATIVE_STD * |mean|``."""
        return max(self.spread, MIN_RELATIVE_STD * abs(self.mean))

    @property
    def var(self) -> float:
        return self.spread * self.spread

    def _accept(self, x: float) -> None:
        # The spread is kept as a standard deviation, each square taken relative to
        # the largest term: a finite norm anywhere in float's range (1e154 squared,
        # 1e308 summed) keeps a finite mean and spread, never an OverflowError or an
        # infinite std that would hide every later spike.
        self.accepted += 1
        if self.accepted <= self.warmup:
            self._seed.append(x)
            n = len(self._seed)
            self.mean = math.fsum(v / n for v in self._seed)
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
    return top * math.sqrt(math.fsum(w * (v / top) ** 2 for v, w in zip(values, weights)))


def _ratio(rise: float, std: float) -> float:
    # std is 0 only for a history of zeros (a layer whose gradient was zero):
    # any rise from there is infinitely many standard deviations.
    if std == 0:
        return 0.0 if rise == 0 else math.copysign(math.inf, rise)
    return rise / std
