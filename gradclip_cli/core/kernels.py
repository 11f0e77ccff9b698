"""Fast first pass: ``max |x|`` and a p-norm for every row of every tensor.

A *row* is a run of at most ``ROW`` consecutive elements of one flattened
tensor. Norms of rows are accumulated in float32 (float64 for float64 tensors)
over at most ``ROW`` elements, then combined in float64 (see power_sums.py).
That split is what makes the result accurate: torch's single fp32 reduction
over a whole tensor has relative error 2.7e-3 on 38M normal values, while
short rows summed with ``sum``'s cascade and combined in float64 stay near
1e-7 whatever the data (BENCHMARKS.md, accuracy).

Two kernels give the same ``Rows`` and differ only in speed per device:

* ``rows_on_cpu``: 2-D views reduced along dim 1 in cache-sized blocks.
  Each block is read from memory once; the max and norm passes hit L2. Half
  types are widened into a reused float32 buffer block by block, which is
  about 5x faster than ``vector_norm(..., dtype=torch.float32)`` on CPU.
* ``rows_by_foreach``: one ``torch._foreach_norm`` call per group for the
  maxima and one for the norms, over views of the rows (fused kernels on CUDA,
  as ``torch.nn.utils.clip_grad`` uses).

Neither does any I/O or host-device synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils._foreach_utils import _device_has_foreach_support

ROW = 1 << 12
BLOCK_BYTES = 1 << 20


@dataclass
class Rows:
    """Row results for tensors of one (device, dtype) group.

    ``tensor``, ``start`` and ``length`` locate each row (int64, CPU);
    ``max_abs`` and ``norm`` are per row on the compute device (``norm`` is
    None for p = inf, where the max is the norm). ``acc_dtype`` is the type
    the norms were accumulated in.
    """

    tensor: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    max_abs: torch.Tensor
    norm: torch.Tensor | None
    acc_dtype: torch.dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every narrower float accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flat(t: torch.Tensor) -> torch.Tensor:
    # reshape is a view for contiguous tensors; only strided ones are copied.
    return t.reshape(-1)


def row_layout(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(tensor index, start, length) of every row, tensor by tensor."""
    layout = []
    for i, t in enumerate(tensors):
        n = t.numel()
        layout.extend((i, s, min(ROW, n - s)) for s in range(0, n, ROW))
    return layout


def rows_by_foreach(tensors: Sequence[torch.Tensor], norm_type: float) -> Rows:
    """Row maxima and norms with one fused ``_foreach_norm`` call each."""
    flats = [_flat(t) for t in tensors]
    layout = row_layout(tensors)
    chunks = [flats[i][s : s + n] for i, s, n in layout]
    acc = accumulation_dtype(tensors[0].dtype)
    device = tensors[0].device
    if not chunks:
        empty = torch.empty(0, dtype=acc, device=device)
        return _rows(layout, empty, None if math.isinf(norm_type) else empty, acc)
    norms = None
    if _device_has_foreach_support(device):
        maxima = torch._foreach_norm(chunks, math.inf)
        if norm_type == 2.0 and device.type == "cuda":
            # CUDA reduces each chunk as a tree: accurate, and one fused kernel.
            norms = torch._foreach_norm(chunks, 2.0, dtype=acc)
        elif not math.isinf(norm_type):
            # Elsewhere vector_norm accumulates lane by lane (see row_norms):
            # form |x|**p and sum it in float64 instead.
            powers = torch._foreach_abs([c.to(acc) for c in chunks])
            if norm_type != 1.0:
                torch._foreach_pow_(powers, norm_type)
            norms = [x.sum(dtype=torch.float64).pow(1.0 / norm_type) for x in powers]
    else:
        maxima = [torch.linalg.vector_norm(c, math.inf) for c in chunks]
        if not math.isinf(norm_type):
            norms = [row_norms(c.to(acc).view(1, -1), norm_type)[0] for c in chunks]
    return _rows(
        layout,
        torch.stack(maxima).to(acc),
        None if norms is None else torch.stack(norms),
        acc,
    )


def rows_on_cpu(tensors: Sequence[torch.Tensor], norm_type: float) -> Rows:
    """Row maxima and norms from 2-D views, one cache-sized block at a time."""
    dtype = tensors[0].dtype
    acc = accumulation_dtype(dtype)
    widen = dtype != acc
    block_elems = BLOCK_BYTES // torch.finfo(acc).bits * 8
    # Reused buffers: allocating per block would page-fault on every block.
    wide_buf = torch.empty(max(block_elems, ROW), dtype=acc) if widen else None
    stack_buf = torch.empty(max(block_elems, ROW), dtype=dtype)
    scratch = torch.empty(max(block_elems, ROW), dtype=acc)
    with_norm = not math.isinf(norm_type)

    layout: list[tuple[int, int, int]] = []
    maxima: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []

    def reduce_block(block: torch.Tensor) -> None:
        if widen:
            wide = wide_buf[: block.numel()].view(block.shape)
            wide.copy_(block)
            block = wide
        # max |x| = max(max x, -min x): two vectorised passes, no |x| temporary.
        maxima.append(torch.maximum(block.amax(1), block.amin(1).neg()))
        if with_norm:
            norms.append(row_norms(block, norm_type, scratch))

    short: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        flat = _flat(t)
        n = flat.numel()
        full = n - n % ROW
        if full:
            matrix = flat[:full].view(-1, ROW)
            per_block = max(1, block_elems // ROW)
            for b in range(0, matrix.shape[0], per_block):
                part = matrix[b : b + per_block]
                layout.extend((i, (b + j) * ROW, ROW) for j in range(part.shape[0]))
                reduce_block(part)
        if n > full:
            short.setdefault(n - full, []).append((i, flat[full:]))

    # Small tensors and tails: rows of equal length are stacked into one block,
    # so 20,000 small tensors cost a few hundred reductions, not 60,000.
    for length, items in short.items():
        per_block = max(1, block_elems // length)
        for b in range(0, len(items), per_block):
            part = items[b : b + per_block]
            block = stack_buf[: len(part) * length].view(len(part), length)
            torch.stack([x for _, x in part], out=block)
            layout.extend((i, full_len(tensors[i]), length) for i, _ in part)
            reduce_block(block)

    if not maxima:
        empty = torch.empty(0, dtype=acc)
        return _rows(layout, empty, empty if with_norm else None, acc)
    return _rows(layout, torch.cat(maxima), torch.cat(norms) if with_norm else None, acc)


def row_norms(block: torch.Tensor, norm_type: float, scratch: torch.Tensor | None = None):
    """p-norm of each row of a 2-D block (p finite), as float64.

    ``|x| ** p`` is formed in ``scratch`` (cache-resident) and summed with
    ``sum``, whose cascade summation keeps the relative error near 2e-7 on
    any 4,096-element fp32 row. ``vector_norm`` accumulates lane by lane: it
    loses 4e-6 on rows of equal values (p = 2) and 3e-6 on random ones for
    p = 0.5 (BENCHMARKS.md, accuracy).
    """
    out = torch.empty(block.shape, dtype=block.dtype) if scratch is None else (
        scratch[: block.numel()].view(block.shape))
    if norm_type == 2.0:
        torch.mul(block, block, out=out)
    else:
        torch.abs(block, out=out)
        if norm_type != 1.0:
            out.pow_(norm_type)
    return out.sum(1).double().pow(1.0 / norm_type)


def full_len(t: torch.Tensor) -> int:
    """Where a tensor's short tail row starts: after its last full row."""
    n = t.numel()
    return n - n % ROW


def _rows(layout, max_abs, norm, acc) -> Rows:
    index = torch.tensor(layout, dtype=torch.int64).reshape(-1, 3)
    return Rows(index[:, 0], index[:, 1], index[:, 2], max_abs, norm, acc)
