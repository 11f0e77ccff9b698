"""The norm audit: a framework's own logged total norm held against gradclip's, step by step.

A run folder may keep the same steps' total gradient norm twice: once as the
framework computed and logged it (a Trainer's ``grad_norm`` in
``trainer_state.json``; a tracker's ``grad_norm`` series) and once as
gradclip's monitor measured it (its JSON Lines log, or the ``gradclip/``
tags its callbacks logged). Both are the 2-norm of the same gradients, so
they agree to the rounding of the framework's arithmetic, and a step where
they do not is a framework that computed its norm over the wrong tensors:
the expert- and tensor-parallel norm bugs of 2026 (Megatron-LM PR#5916,
DeepSpeed#8469 with a 34% gap, NeMo-Automodel#3816, torchtune#2420), whose
clipping then scaled every update by a wrong factor while the curve looked
healthy.

The audit compares two generic series (``NormSeries``, step -> norm) over
the steps both hold; where the two come from is the caller's business, so
any reader that yields a framework total plugs in.

The tolerance comes from the dtype the framework's numbers were stored in
(``stored_precision``: the narrowest of float16, bfloat16, float32 and
float64 that holds every finite value exactly; a Trainer's ``grad_norm`` is
torch's float32 total, TensorBoard keeps float32) and the arithmetic behind
them: torch sums the squares of half and float32 gradients in float32 (its
``opmath`` type) and of float64 ones in float64, and rounds each tensor's
norm, their squares and sum, and the total to the gradients' dtype. So

    tolerance = 4 * u_stored + 2**16 * u_accumulated

relative to the larger of the two norms, with ``u`` the unit roundoff (2**-24
for float32). The first term is the roundings to the stored dtype. The
second bounds the accumulation: a sum of ``m`` terms added one after another
is off by at most ``(m - 1) * u`` (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., eq. 4.4), and typically by about
``sqrt(m) * u``. A GPU reduction adds at most some thousands of terms in one
chain; torch's CPU norm adds a thread's whole share in one (measured: 1.0e-4
off for 2**22 float32 elements on one thread, 2.2e-3 for float16's total,
tests/report/test_norm_audit.py), which at ``sqrt(m) * u`` stays below
2**16 * u up to a billion elements a thread. For a float32 total that is
2**-22 + 2**-8, about 3.9e-3: float32 arithmetic passes, a missing shard
(the half of the parameters an expert-parallel bug left out, a 34% gap)
does not; a gap below 0.4% goes unseen. gradclip's side is float64,
certified (its error is far below either term).

A framework may log its total after gradclip scaled the gradients: Lightning
calls a LightningModule's ``on_before_optimizer_step`` (where its docs log
``grad_norm``) after the callbacks', so after the callback's spike clip. At a
step gradclip scaled, a framework total that agrees with the norm the
gradients were left with (``total_norm * clip_coef``, gradclip's series'
``scaled``) is of the same gradients, measured later: it agrees, and the audit
names the step (``after_clip``) instead of calling it a norm of other gradients.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Unit roundoff (half an ulp of 1) of each dtype a logged norm may be stored in,
# and the dtype torch accumulates its squares in for gradients of that dtype.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24,
                 "float64": 2.0**-53}
ACCUMULATED_IN = {"float16": "float32", "bfloat16": "float32", "float32": "float32",
                  "float64": "float64"}
# The roundings to the stored dtype, and the chain of additions, the tolerance
# allows for (see the module).
ROUNDINGS = 4
CHAIN = 2.0**16


@dataclass(frozen=True)
class NormSeries:
    """One series of total norms by step: ``source`` (a file), ``kind`` (what logged
    it, e.g. ``trainer-state grad_norm``, ``gradclip-monitor``)."""

    source: str
    kind: str
    norms: Mapping[int, float]
    # Steps where gradclip scaled the gradients after measuring them: the total norm
    # they were left with (``total_norm * clip_coef``). Empty for a framework's series.
    scaled: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Disagreement:
    step: int
    framework: float
    gradclip: float
    relative: float  # |framework - gradclip| / max(|framework|, |gradclip|); inf for NaN vs number


@dataclass(frozen=True)
class NormAudit:
    """The framework's series against gradclip's over the steps both hold."""

    framework: NormSeries
    gradclip: NormSeries
    precision: str  # the dtype the framework's numbers were stored in
    tolerance: float  # relative
    compared: tuple[int, ...]  # the steps both series hold, in order
    disagreements: tuple[Disagreement, ...]
    # Steps where the framework's total is that of the gradients gradclip had scaled.
    after_clip: tuple[int, ...] = ()

    @property
    def agrees(self) -> bool:
        return not self.disagreements

    @property
    def largest(self) -> Disagreement | None:
        """The disagreement with the largest relative difference."""
        return max(self.disagreements, key=lambda d: d.relative, default=None)


def stored_precision(values: Iterable[float]) -> str:
    """The narrowest dtype that holds every finite value of ``values`` exactly
    (float32 when there is none: the Trainer's and TensorBoard's)."""
    widest = 0
    order = ["bfloat16", "float16", "float32", "float64"]
    seen = False
    for value in values:
        if not math.isfinite(value):
            continue
        seen = True
        widest = max(widest, order.index(_narrowest(value)))
    return order[widest] if seen else "float32"


def _narrowest(value: float) -> str:
    try:
        single = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return "float64"
    if single != value:
        return "float64"
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if bits & 0xFFFF == 0:
        return "bfloat16"  # a float32 whose low 16 bits are zero: a bfloat16 value
    try:
        if struct.unpack("<e", struct.pack("<e", value))[0] == value:
            return "float16"
    except OverflowError:
        pass
    return "float32"


def tolerance(precision: str) -> float:
    """The relative difference a total stored in ``precision`` may have from the
    exact norm: roundings to it, and a chain of additions in its accumulation type."""
    return ROUNDINGS * UNIT_ROUNDOFF[precision] + CHAIN * UNIT_ROUNDOFF[ACCUMULATED_IN[precision]]


def relative_difference(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)``: 0 for equal values (NaN and NaN, inf and inf
    included), inf where one is non-finite and the other is not."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def audit_norms(framework: NormSeries, gradclip: NormSeries) -> NormAudit | None:
    """Hold ``framework``'s totals against ``gradclip``'s at every step both hold;
    None when they share no step."""
    steps = tuple(sorted(framework.norms.keys() & gradclip.norms.keys()))
    if not steps:
        return None
    precision = stored_precision(framework.norms[s] for s in steps)
    limit = tolerance(precision)
    # A difference below the smallest normal float32 is none: subnormal totals
    # lose their relative precision in any dtype.
    tiny = 2.0**-126
    found, after_clip = [], []
    for step in steps:
        a, b = framework.norms[step], gradclip.norms[step]
        rel = relative_difference(a, b)
        if rel <= limit or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tiny):
            continue
        scaled = gradclip.scaled.get(step)
        if scaled is not None and relative_difference(a, scaled) <= limit:
            after_clip.append(step)
        else:
            found.append(Disagreement(step, a, b, rel))
    return NormAudit(framework, gradclip, precision, limit, steps, tuple(found),
                     tuple(after_clip))
