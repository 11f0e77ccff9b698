"""Per-tensor norms, maxima and non-finite counts, accurate in every dtype.

``tensor_power_sums`` is the one entry point. It works in three steps:

1. Group tensors by (device, dtype), as ``torch.nn.utils.clip_grad`` does, and
   run a fast kernel per group (kernels.py): ``max |x|`` and a float32- (or
   float64-) accumulated p-norm for every row of at most 65,536 elements.
2. Trust a row's fast norm only where it cannot have overflowed or lost
   precision to underflow (``_trusted``); recompute the few others exactly,
   in float64 after an exact power-of-two rescale. Finite gradients near 1e20
   or 1e-25 therefore give the right total, where torch gives inf or 0.
3. Count NaN / +inf / -inf only in tensors whose maximum says they hold one:
   a finite max proves every element finite, so healthy checkpoints never
   pay for an ``isfinite`` pass.

Rows combine into tensors in float64 (power_sums.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .elements import Elements, measurable, readable
from .kernels import Rows, rows_by_foreach, rows_on_cpu
from .power_sums import F64, PowerSums, from_rows

# A fast row norm is trusted when its largest term max|x|**p is at least this
# many times the accumulator's smallest normal number, per element: then every
# term lost to underflow together moves the sum by under 2**-24 (6e-8).
_UNDERFLOW_MARGIN = 2.0**24

DEFAULT_BATCH_BYTES = 64 << 20


def tensor_power_sums(
    tensors: Sequence[torch.Tensor],
    norm_type: float,
    *,
    device: torch.device | str | None = None,
    foreach: bool | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    on_batch: Callable[[Sequence[torch.Tensor]], None] | None = None,
    workers: int = 1,
) -> PowerSums:
    """Norm summaries of each tensor, in input order.

    Args:
        tensors: floating-point tensors, on any devices and in any mix of dtypes.
        norm_type: p > 0, or ``inf``.
        device: where to compute. Tensors elsewhere are copied there in
            batches of about ``batch_bytes``, so a checkpoint never has to fit
            on the device at once. None: where each tensor already is.
        foreach: True forces the ``_foreach_norm`` kernel, False forbids it;
            None picks the faster one for the device (CPU: 2-D row views).
        batch_bytes: tensors are processed (and moved) in batches of about
            this many bytes.
        on_batch: called with each batch's input tensors once they are done
            (progress display; releasing the memory of mapped files).
        workers: CPU threads to spread the work over. The CLI runs torch's
            own ops single-threaded and uses this instead: two-thread OpenMP
            regions on 1 MiB pieces slow down 30-fold when another process
            holds a core, while independent threads only lose that core.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    tensors = [measurable(readable(t)) for t in tensors]
    n = len(tensors)
    if n == 0:
        return from_rows(norm_type, torch.empty(0, dtype=F64), None).reduce(
            torch.empty(0, dtype=torch.int64), 0
        )

    target = torch.device(device) if device is not None else None
    pending = []
    grouped = _group_tensors_by_device_and_dtype([list(tensors)], with_indices=True)
    for (group_device, _), ([group], indices) in grouped.items():
        compute_on = target or group_device
        for batch in _batches(list(zip(indices, group)), batch_bytes):
            index = [i for i, _ in batch]
            originals = [t for _, t in batch]
            moved = originals
            if compute_on != group_device:
                moved = [t.to(compute_on) for t in originals]
            if compute_on.type == "cpu" and not foreach:
                rows = rows_on_cpu(moved, norm_type, workers)
            else:
                rows = rows_by_foreach(moved, norm_type)
            # Kept on the compute device until every batch is queued: reading
            # results back is the one host-device synchronisation.
            pending.append((rows, originals, index))
            if on_batch is not None:
                on_batch(originals)

    row_parts = [_finish_rows(rows, originals, norm_type) for rows, originals, _ in pending]
    row_owner = [torch.tensor(index, dtype=torch.int64)[rows.tensor]
                 for rows, _, index in pending]
    rows_all = _concat(norm_type, row_parts)
    per_tensor = rows_all.reduce(torch.cat(row_owner), n)
    return _with_nonfinite_counts(per_tensor, tensors)


def element_power_sums(
    elements: Elements, norm_type: float, measured=None, **options
) -> tuple[PowerSums, PowerSums]:
    """Summaries of each tensor's own elements, and of the elements each owns.

    Every distinct element is read once (``Elements.measured``). The first
    result describes each tensor as it is (its row in a report); the second
    partitions the elements, so its ``reduce`` and ``total`` count each once.
    ``measured`` is ``elements.measured()`` when the caller has it already;
    ``options`` are ``tensor_power_sums``'.
    """
    pieces, rows = measured or elements.measured()
    sums = tensor_power_sums(pieces, norm_type, **options)
    n = len(elements)
    return sums.take(torch.tensor(rows, dtype=torch.int64)), sums.take(torch.arange(n))


def _batches(items, batch_bytes):
    """Consecutive runs of about ``batch_bytes``: what is on the device at once."""
    batch, size = [], 0
    for item in items:
        nbytes = item[1].nbytes
        if batch and size + nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes
    if batch:
        yield batch


def _finish_rows(rows: Rows, tensors: Sequence[torch.Tensor], norm_type: float) -> PowerSums:
    """Row summaries, with every untrustworthy fast norm recomputed exactly.

    Recomputation reads ``tensors``, the inputs where they were (for the CLI,
    the memory-mapped file), not copies on the device.
    """
    row_max = rows.max_abs.to("cpu", F64)
    row_norm = None if rows.norm is None else rows.norm.to("cpu", F64)
    sums = from_rows(norm_type, row_max, row_norm)
    if row_norm is None:
        return sums
    trusted = _trusted(rows, row_max, row_norm, norm_type)
    suspect = torch.isfinite(row_max) & (row_max > 0) & ~trusted
    if not bool(suspect.any()):
        return sums
    power_sum = sums.power_sum.clone()
    for r in suspect.nonzero().flatten().tolist():
        t, s, n = int(rows.tensor[r]), int(rows.start[r]), int(rows.length[r])
        values = tensors[t].reshape(-1)[s : s + n]
        power_sum[r] = exact_power_sum(values, float(row_max[r]), norm_type)
    return PowerSums(norm_type, sums.scale, power_sum, sums.max_abs, sums.nan, sums.posinf,
                     sums.neginf)


def _trusted(rows: Rows, row_max, row_norm, norm_type: float) -> torch.Tensor:
    """Rows whose fast norm is accurate: no overflow, and underflow cannot matter.

    Two ways small numbers lose precision, each bounded to 2**-24 of the row's
    sum (which is at least ``max ** p``) over its ``n`` elements:
    terms ``|x| ** p`` that underflow (each is off by at most ``tiny``), and
    elements that are themselves subnormal (vectorised ``pow`` is not accurate
    there; each contributes at most ``tiny ** p``).
    """
    tiny = torch.finfo(rows.acc_dtype).tiny
    budget = rows.length.to(F64) * _UNDERFLOW_MARGIN
    terms_ok = row_max.pow(norm_type) >= tiny * budget
    elements_ok = row_max >= tiny * budget.pow(1.0 / norm_type)
    return torch.isfinite(row_norm) & terms_ok & elements_ok


def exact_power_sum(values: torch.Tensor, scale: float, norm_type: float) -> float:
    """``sum (|x| / scale) ** p`` in float64, for ``scale = max |x|`` finite and > 0.

    Values are first multiplied by a power of two that brings ``scale`` into
    [0.5, 1): exact in binary floating point, and safe from overflow even for
    float64 subnormals. The factor is applied in two halves because 2**1074
    itself does not fit in a float64.
    """
    exponent = math.frexp(scale)[1]
    first, second = -exponent // 2, -exponent - (-exponent // 2)
    x = values.detach().to("cpu", F64).abs()
    x = x * math.ldexp(1.0, first) * math.ldexp(1.0, second)
    unit = math.ldexp(math.ldexp(scale, first), second)
    return float((x / unit).pow(norm_type).sum())


def _concat(norm_type: float, parts: list[PowerSums]) -> PowerSums:
    return PowerSums(
        norm_type,
        *(torch.cat([getattr(p, f) for p in parts])
          for f in ("scale", "power_sum", "max_abs", "nan", "posinf", "neginf")),
    )


def _with_nonfinite_counts(sums: PowerSums, tensors: Sequence[torch.Tensor]) -> PowerSums:
    flagged = (~torch.isfinite(sums.max_abs)).nonzero().flatten().tolist()
    if not flagged:
        return sums
    nan, posinf, neginf = sums.nan.clone(), sums.posinf.clone(), sums.neginf.clone()
    for i in flagged:
        t = tensors[i]
        nan[i] = int(torch.isnan(t).sum())
        posinf[i] = int(torch.isposinf(t).sum())
        neginf[i] = int(torch.isneginf(t).sum())
    return PowerSums(sums.norm_type, sums.scale, sums.power_sum, sums.max_abs, nan, posinf, neginf)
