"""The spike rule that ``gradclip trend`` and ``GradMonitor`` share.

A point is a spike when its z-score against the run's own history is above a
threshold: ``z = (x - mean) / std``, where ``mean`` and ``var`` are
exponential moving averages (factor ``alpha``) of the earlier points that were
not spikes, seeded by the plain mean and variance of the first ``warmup`` such
points. Points with fewer than ``MIN_HISTORY`` earlier points are not judged.

References:
    Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM Pre-Training",
    2025 (arXiv:2504.02507): ``mu_t = alpha mu + (1 - alpha) g_t``,
    ``var_t = alpha var + (1 - alpha) (g_t - mu_t)^2``, z-score threshold 2.5,
    alpha 0.97, a warm-up of 25 steps.

Pure float arithmetic: no tensors, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_HISTORY = 5
DEFAULT_Z = 2.5
DEFAULT_ALPHA = 0.97
DEFAULT_WARMUP = 25


@dataclass(frozen=True)
class Judgement:
    """What the rule says of one point: ``z`` is None when it was not judged."""

    z: float | None
    spike: bool
    nonfinite: bool


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
        self.accepted = 0  # earlier points that entered the averages
        self.mean = 0.0
        self.var = 0.0
        self._seed: list[float] = []

    def update(self, x: float) -> Judgement:
        """Judge ``x`` against the points before it, then let it into the history
        unless it is a spike or not finite."""
        x = float(x)
        earlier, self.seen = self.seen, self.seen + 1
        if not math.isfinite(x):
            return Judgement(None, False, True)
        if earlier < MIN_HISTORY or self.accepted == 0:
            self._accept(x)
            return Judgement(None, False, False)
        z = self.z_score(x)
        spike = z > self.threshold
        if not spike:
            self._accept(x)
        return Judgement(z, spike, False)

    def z_score(self, x: float) -> float:
        std = math.sqrt(max(self.var, 0.0))
        # A perfectly flat history has std 0: any rise is then infinitely many
        # standard deviations; a floor relative to the mean keeps rounding noise
        # (1 ulp) from counting as a rise.
        floor = 1e-12 * max(abs(self.mean), math.ulp(0.0))
        return (x - self.mean) / max(std, floor)

    def _accept(self, x: float) -> None:
        self.accepted += 1
        if self.accepted <= self.warmup:
            self._seed.append(x)
            n = len(self._seed)
            self.mean = math.fsum(self._seed) / n
            self.var = math.fsum((v - self.mean) ** 2 for v in self._seed) / n
            if self.accepted == self.warmup:
                self._seed = []
            return
        self.mean = self.alpha * self.mean + (1 - self.alpha) * x
        self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
