"""Pure tensor math: norms, non-finite counts, ties and clipping. No I/O."""

from .clipping import clamp_, clip_coefficient, scale_
from .norms import tensor_power_sums
from .power_sums import PowerSums, concat
from .ties import find_ties

__all__ = [
    "PowerSums", "clamp_", "clip_coefficient", "concat", "find_ties", "scale_",
    "tensor_power_sums",
]
