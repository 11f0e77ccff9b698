"""Per-tensor norms, maxima and non-finite counts, accurate in every dtype.

``tensor_power_sums`` is the entry point (``total_power_sums``, the drop-ins'
total, is its certified shortcut). It works in three steps:

1. Group tensors by (device, dtype), as ``torch.nn.utils.clip_grad`` does, and
   run a fast kernel per group (kernels.py): a float32- or float64-accumulated
   p-norm for every row (a CPU piece of at most 262,144 elements, a whole
   tensor when the drop-ins' 2-norm kernel serves or on an accelerator), and
   ``max |x|`` where it is asked for. Results on an accelerator are read back
   once, together.
2. Trust a row's fast norm only where its own power sum proves it accurate
   (``_trusted``): a finite sum did not overflow, and one above
   ``n * tiny * 2**24`` cannot have lost 2**-24 of itself to underflow.
   Recompute the few others exactly, in float64 after an exact power-of-two
   rescale. Finite gradients near 1e20 or 1e-25 therefore give the right
   total, where torch gives inf or 0.
3. Count NaN / +inf / -inf only in tensors whose sum says they hold one:
   a finite sum proves every element finite, so healthy gradients never
   pay for an ``isfinite`` pass.

Rows combine into tensors in float64 (power_sums.py).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .elements import Elements, measurable, readable
from .kernels import (
    FLOAT64_SAFE_P,
    Rows,
    norms_by_foreach,
    rows_on_cpu,
    square_norms_on_cpu,
    squares_on_cpu,
    sums_by_foreach,
)
from .power_sums import F64, PowerSums, from_rows, pointwise_pow

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
    with_max: bool = True,
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
        with_max: measure ``max |x|`` too (one more pass on the CPU; a
            reduction more on an accelerator). Without it (p finite),
            ``max_abs`` is NaN for tensors whose elements are all finite, and
            ``scale`` is not necessarily the max: the norms, totals and counts
            are the same. The drop-ins and the monitor need no max.
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
        # Batches bound what is copied to the device at once, and pace on_batch;
        # otherwise a group is one batch, and its host work does not grow with
        # the tensors' sizes.
        limit = batch_bytes if compute_on != group_device or on_batch is not None else math.inf
        for batch in _batches(list(zip(indices, group)), limit):
            index = [i for i, _ in batch]
            originals = [t for _, t in batch]
            moved = originals
            if compute_on != group_device:
                moved = [t.to(compute_on) for t in originals]
            if compute_on.type == "cpu" and not foreach:
                if _by_squares(moved, norm_type, workers, with_max):
                    rows = squares_on_cpu(moved)
                else:
                    rows = rows_on_cpu(moved, norm_type, workers, with_max)
            else:
                rows = sums_by_foreach(moved, norm_type, with_max)
            # Kept on the compute device until every batch is queued: reading
            # results back is the one host-device synchronisation.
            pending.append((rows, originals, index))
            if on_batch is not None:
                on_batch(originals)

    host_rows = read_back([rows for rows, _, _ in pending])
    finished = [_finish_rows(rows, originals, norm_type)
                for rows, (_, originals, _) in zip(host_rows, pending)]
    row_owner = torch.cat([torch.tensor(index, dtype=torch.int64)[rows.tensor]
                           for rows, (_, _, index) in zip(host_rows, pending)])
    rows_all = _concat(norm_type, [sums for sums, _ in finished])
    per_tensor = rows_all.reduce(row_owner, n)
    flagged = torch.zeros(n, dtype=torch.int64).index_add(
        0, row_owner, torch.cat([bad for _, bad in finished]).to(torch.int64))
    return _with_nonfinite_counts(per_tensor, tensors, flagged > 0)


def total_power_sums(tensors: Sequence[torch.Tensor], norm_type: float,
                     foreach: bool | None = None) -> PowerSums:
    """The summary of all elements of ``tensors`` as one piece (the drop-ins' total).

    ``tensor_power_sums(...).total()``, with the same accuracy, but where the
    one-read 2-norm kernel serves (float32 or float64 CPU tensors of one
    dtype) the total is certified from its own sum: every element's
    underflow together moves a finite sum of ``n`` elements above
    ``n * tiny * 2**24`` by under 2**-24 of itself (``_trusted``'s argument
    over the whole set). Only a total that fails, or holds a NaN or an inf,
    is measured again per tensor, exactly.
    """
    norm_type = float(norm_type)
    count = _squares_count(tensors) if norm_type == 2.0 and not foreach else 0
    if count:
        total = torch.linalg.vector_norm(squares_on_cpu(tensors).norm)
        budget = count * _UNDERFLOW_MARGIN * torch.finfo(tensors[0].dtype).tiny
        value = float(total)
        if math.isfinite(value * value) and value * value >= budget:
            one = torch.ones(1, dtype=F64)
            zero = torch.zeros(1, dtype=torch.int64)
            return PowerSums(norm_type, total.reshape(1), one, torch.full((1,), math.nan,
                             dtype=F64), zero, zero, zero)
    tensors = [measurable(t) for t in tensors]
    return tensor_power_sums(tensors, norm_type, foreach=foreach, with_max=False).total()


def certified_group_norms(
    tensors: Sequence[torch.Tensor],
    index: torch.Tensor,
    size: int,
    sizes: list[int] | None = None,
    numels: array | None = None,
) -> tuple[PowerSums, PowerSums] | None:
    """Groups' and the total's 2-norms of CPU float32 or float64 tensors of one dtype,
    from one read of their elements, or None where they cannot be certified.
    Tensors on one accelerator (float16, bfloat16 or float32, of one dtype) go to
    ``certified_group_norms_on_device``.

    Tensor ``i`` goes to group ``index[i]``. Each tensor's norm comes from
    ``square_norms_on_cpu``; a group's sum of squares is trusted as
    ``total_power_sums`` trusts its total: finite, and at least
    ``n * tiny * 2**24`` for its ``n`` elements, so underflow cannot have
    cost it 2**-24 of itself. When any group fails (a NaN or an inf, a sum
    that overflowed, or gradients too small or all zero), the caller
    measures with ``tensor_power_sums``, which recomputes exactly and counts.
    ``sizes`` are the tensors' numbers of elements, when the caller has them
    (``numels``: the same as an ``array("q")``).
    """
    if not tensors[0].is_cpu:
        return certified_group_norms_on_device(tensors, index, size)
    if sizes is None:
        sizes = list(map(torch.Tensor.numel, tensors))
    squares = square_norms_on_cpu(tensors, sizes).square_()
    if numels is None:
        numels = array("q", sizes)
    counts = torch.frombuffer(numels, dtype=torch.int64).to(F64)
    budget = torch.zeros(size, dtype=F64).index_add_(0, index, counts)
    budget *= _UNDERFLOW_MARGIN * torch.finfo(tensors[0].dtype).tiny
    return _certified_groups(squares, index, size, budget)


def certified_group_norms_on_device(
    tensors: Sequence[torch.Tensor], index: torch.Tensor, size: int
) -> tuple[PowerSums, PowerSums] | None:
    """``certified_group_norms`` for float16, bfloat16 or float32 tensors of one dtype
    on one accelerator: a fixed number of fused ops and one read of a number per
    tensor, whatever their sizes; None where they hold a NaN or an infinity.

    Each tensor's sum of squares is float64 (``kernels.norms_by_foreach``),
    which no finite value of these dtypes can overflow or underflow, so a
    finite total is certified as it stands: no budget, unlike the CPU's
    float32 rows. A total that is not finite has a NaN or an inf among the
    elements; the caller measures again to count them (``tensor_power_sums``).
    The groups are summed on the host (``index`` is a CPU tensor), in a fixed
    order: a device's atomic adds would change the last bits from run to run.
    """
    squares = norms_by_foreach(tensors).to("cpu").square_()  # the one read
    return _certified_groups(squares, index, size, None)


def _certified_groups(
    squares: torch.Tensor, index: torch.Tensor, size: int, budget: torch.Tensor | None
) -> tuple[PowerSums, PowerSums] | None:
    """Groups and total from each tensor's float64 sum of squares, if each group's
    sum is finite and at least its ``budget`` (None: finite is enough)."""
    group_squares = torch.zeros(size, dtype=F64).index_add_(0, index, squares)
    total = group_squares.sum().reshape(1)
    if budget is None:
        # A sum of non-negative squares is finite only if every group's is.
        certain = math.isfinite(float(total))
    else:
        certain = bool(torch.isfinite(total) & (group_squares >= budget).all())
    if not certain:
        return None
    return _certified(group_squares.sqrt_()), _certified(total.sqrt_())


def _certified(norm: torch.Tensor) -> PowerSums:
    """Summaries of pieces whose finite 2-norms are known: scale the norm, sum 1."""
    zeros = torch.zeros(norm.numel(), dtype=torch.int64)
    return PowerSums(2.0, norm, torch.ones_like(norm), torch.full_like(norm, math.nan),
                     zeros, zeros, zeros, certified=norm)


def _squares_count(tensors: Sequence[torch.Tensor]) -> int:
    """How many elements ``tensors`` hold when they are CPU tensors of one type that
    ``squares_on_cpu`` reads, else 0 (one pass: the drop-ins ask on every step)."""
    if not tensors or tensors[0].dtype not in (torch.float32, torch.float64):
        return 0
    dtype, count = tensors[0].dtype, 0
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return 0
        count += t.numel()
    return count


def _by_squares(tensors, norm_type: float, workers: int, with_max: bool) -> bool:
    """Whether the one-read 2-norm kernel serves: float32/float64, no max asked for.

    That is the drop-ins' and the monitor's case, on every step; the CLI asks
    for the max and keeps ``rows_on_cpu``, whose rows do not depend on how
    many workers or ranks share a tensor.
    """
    return (norm_type == 2.0 and not with_max and workers == 1
            and tensors[0].dtype in (torch.float32, torch.float64))


def read_back(parts: list[Rows]) -> list[Rows]:
    """Every row result on the host: one device-to-host copy per device, however
    many groups and batches (the monitor's one read per logged step)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for rows in parts:
        for value in rows.device_values():
            if value.device.type != "cpu":
                by_device.setdefault(value.device, []).append(value)
    host: dict[int, torch.Tensor] = {}
    for values in by_device.values():
        flat = torch.cat([v.reshape(-1).to(F64) for v in values]).to("cpu")
        for v, piece in zip(values, flat.split([v.numel() for v in values])):
            host[id(v)] = piece.reshape(v.shape)
    return [rows.with_values([host.get(id(v), v) for v in rows.device_values()])
            for rows in parts]


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
    if math.isinf(batch_bytes):
        yield list(items)
        return
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


def _finish_rows(rows: Rows, tensors: Sequence[torch.Tensor],
                 norm_type: float) -> tuple[PowerSums, torch.Tensor]:
    """Row summaries, with every untrustworthy fast norm recomputed exactly, and
    which rows hold a NaN or an infinity.

    Recomputation reads ``tensors``, the inputs where they were (for the CLI,
    the memory-mapped file), not copies on the device.
    """
    row_max = None if rows.max_abs is None else rows.max_abs.to(F64)
    if rows.norm is None:  # p = inf: the max is the norm
        return from_rows(norm_type, row_max, None), ~torch.isfinite(row_max)
    norm = rows.norm.to(F64)
    unit = 1.0 if rows.unit is None else float(rows.unit)
    computed = norm.pow(norm_type)  # each row's power sum, of the values / unit
    trusted = _trusted(rows, computed, norm_type)
    # float64 sums of narrower values at p <= 6 neither overflow nor lose a
    # nonzero term (kernels.FLOAT64_SAFE_P): a zero sum is all zeros.
    safe = (rows.acc_dtype == F64 and norm_type <= FLOAT64_SAFE_P
            and bool(tensors) and tensors[0].dtype != F64)
    if row_max is not None:
        bad = ~torch.isfinite(row_max)
        scale = torch.where(bad, 0.0, row_max)
        relative = scale / unit
        ratio = norm / torch.where(relative > 0, relative, 1.0)
        power_sum = torch.where(relative > 0, pointwise_pow(ratio, norm_type), 0.0)
        suspect = (scale > 0) & ~trusted
        max_abs = row_max
    else:
        # No max: a finite norm is its own scale. A non-finite one is a NaN or
        # an inf among the elements, unless the accumulation could overflow.
        finite = torch.isfinite(norm)
        bad = ~finite
        # Below p = 1 the root can overflow where the sum did not: the norm is
        # at least the largest |x| (never underflows) and up to n ** (1/p) times it.
        if not safe or norm_type < 1:
            bad = bad & ~_finite_max(rows, tensors, bad)
        live = finite & (norm > 0)
        if rows.unit is None:
            scale = torch.where(live, norm, 0.0)
            power_sum = live.to(F64)
        else:
            # Norms of values divided by ``unit``: kept as ``unit`` and ``norm ** p``.
            # ``norm * unit`` would round a row's norm to float64 alone, a float64
            # subnormal (5e-324 apart) where the gradients are, which p < 1 carries
            # into the total. Rows whose ``norm ** p`` underflowed are not trusted.
            scale = torch.where(live, torch.full_like(norm, unit), 0.0)
            power_sum = torch.where(live, pointwise_pow(norm, norm_type), 0.0)
        suspect = ~bad & ~trusted & ~(safe & (norm == 0))
        max_abs = torch.where(bad, norm, math.nan)
    if bool(suspect.any()):
        scale, power_sum = scale.clone(), power_sum.clone()
        for r in suspect.nonzero().flatten().tolist():
            t, s, n = int(rows.tensor[r]), int(rows.start[r]), int(rows.length[r])
            values = tensors[t].reshape(-1)[s : s + n]
            top = float(row_max[r]) if row_max is not None else _max_abs(values)
            scale[r] = top
            power_sum[r] = exact_power_sum(values, top, norm_type) if top > 0 else 0.0
    zeros = torch.zeros(len(scale), dtype=torch.int64)
    return PowerSums(norm_type, scale, power_sum, max_abs, zeros, zeros, zeros), bad


def _trusted(rows: Rows, computed: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Rows whose fast power sum is accurate: no overflow, and underflow cannot matter.

    Certified from the computed sum itself (at least ``max ** p``, so a
    stronger test than the max alone would give). A finite sum did not
    overflow. Two ways small numbers lose precision, each bounded to 2**-24
    of the sum over the row's ``n`` elements: terms ``|x| ** p`` that
    underflow (each off by at most ``tiny``), and elements that are
    themselves subnormal (vectorised ``pow`` is not accurate there; each
    contributes at most ``tiny ** p``).
    """
    tiny = torch.finfo(rows.acc_dtype).tiny
    floor = max(tiny, tiny**norm_type) if norm_type > 0 else tiny
    budget = rows.length.to(F64) * _UNDERFLOW_MARGIN * floor
    return torch.isfinite(computed) & (computed >= budget)


def _finite_max(rows: Rows, tensors, rows_mask: torch.Tensor) -> torch.Tensor:
    """For each row in ``rows_mask``, whether its max is finite (its sum overflowed)."""
    out = torch.zeros_like(rows_mask)
    for r in rows_mask.nonzero().flatten().tolist():
        t, s, n = int(rows.tensor[r]), int(rows.start[r]), int(rows.length[r])
        out[r] = math.isfinite(_max_abs(tensors[t].reshape(-1)[s : s + n]))
    return out


def _max_abs(values: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(values.detach(), math.inf))


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


def _with_nonfinite_counts(sums: PowerSums, tensors: Sequence[torch.Tensor],
                           flagged: torch.Tensor) -> PowerSums:
    """Counts for the tensors ``flagged`` (a non-finite row), read back in one copy."""
    flagged = flagged.nonzero().flatten().tolist()
    if not flagged:
        return sums
    first = tensors[flagged[0]].device
    counts = torch.stack([
        torch.stack([torch.isnan(t).sum(), torch.isposinf(t).sum(), torch.isneginf(t).sum()])
        .to(first) for t in (tensors[i] for i in flagged)
    ]).to("cpu")
    nan, posinf, neginf = sums.nan.clone(), sums.posinf.clone(), sums.neginf.clone()
    index = torch.tensor(flagged, dtype=torch.int64)
    nan[index], posinf[index], neginf[index] = counts[:, 0], counts[:, 1], counts[:, 2]
    return PowerSums(sums.norm_type, sums.scale, sums.power_sum, sums.max_abs, nan, posinf, neginf)
