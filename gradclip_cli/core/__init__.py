"""Pure tensor math: norms, non-finite counts, shared elements and clipping. No I/O."""

from .clipping import (
    Coefficient,
    clamp_,
    clamp_elements_,
    clip_coefficient,
    exact_clip_coefficient,
    lowered_coefficient,
    rounds_to_zero,
    scale_,
    scale_elements_,
    unit_roundoff,
)
from .elements import Elements, apart, distinct_elements, find_ties, readable
from .norms import element_power_sums, tensor_power_sums, total_power_sums
from .power_sums import PowerSums, concat

__all__ = [
    "Coefficient", "Elements", "PowerSums", "apart", "clamp_", "clamp_elements_",
    "clip_coefficient",
    "concat", "distinct_elements", "element_power_sums", "exact_clip_coefficient", "find_ties",
    "lowered_coefficient",
    "readable", "rounds_to_zero", "scale_", "scale_elements_", "tensor_power_sums",
    "total_power_sums",
    "unit_roundoff",
]
