"""The drop-ins' total norm over DTensor gradients (FSDP2, tensor parallel).

A DTensor gradient is a local tensor on each rank plus a placement per mesh
dimension. Its p-norm is combined from the local tensors' scaled power sums:

* ``Shard(d)`` (FSDP2's parameters, tensor parallel's column/row shards):
  the locals are disjoint parts, so their sums are combined over the
  process group of that mesh dimension;
* ``Replicate()``: every rank holds the whole, which is counted once (no
  combination over that dimension);
* ``Partial()``: the gradient is the sum of the locals, whose norm no local
  tells; it is reduced to ``Replicate`` first (one all-reduce, as torch's
  own DTensor ops would do).

Gradients on different meshes (pytorch/pytorch#180346, where torch's
``clip_grad_norm_`` fails stacking norms across meshes) are combined per mesh
and then added as plain numbers. The result is equal on every rank and is
returned as a DTensor replicated on the first gradient's mesh (``replicated``),
as torch returns one (whose placement can be ``Partial``,
pytorch/pytorch#170862).

Two ways to combine, as for plain tensors in api.py:

* exact (``PowerSums``): each tensor's ``(scale, power_sum, max, counts)``
  are all-gathered over each sharded dimension and reduced in rank order;
  every rank reduces the same numbers in the same order, so the result is
  identical on every rank and accurate as on one device;
* on accelerators, for narrow dtypes and ``p <= 6`` (where float64 cannot
  overflow), float64 ``sum |x|^p`` (or the max, for p = inf) all-reduced on
  the device: no host-device synchronisation, as torch has none.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import torch

from ..core import PowerSums, find_ties, tensor_power_sums
from ..core.power_sums import F64

_FIELDS = ("scale", "power_sum", "max_abs", "nan", "posinf", "neginf")


def has_dtensor(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (without importing DTensor's module)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(isinstance(t, module.DTensor) for t in tensors)


def local_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local tensor, for in-place scaling; plain tensors as they are.

    Scaling the locals scales the DTensor whatever its placements (``Partial``
    included: ``c * sum x_r = sum c * x_r``), and works across meshes, where
    a fused ``_foreach_mul_`` over DTensors of several meshes does not.
    """
    if not has_dtensor(tensors):
        return list(tensors)
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def replicated(total: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The total as torch returns it for DTensor gradients: a DTensor, ``Replicate`` on
    the first DTensor gradient's mesh (every rank holds the same value).

    torch's own total is a DTensor too, whose placement can be ``Partial``
    (pytorch/pytorch#170862); replicated, ``float(total)``,
    ``total.full_tensor()`` and ``total.placements`` work as code written for
    torch expects, and ``full_tensor()`` needs no communication.
    """
    from torch.distributed.tensor import DTensor, Replicate

    mesh = next(t.device_mesh for t in tensors if isinstance(t, DTensor))
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)


def as_plain(total_norm: torch.Tensor) -> torch.Tensor:
    """A total norm that is a DTensor (torch's ``get_total_norm`` of DTensors) made whole."""
    if has_dtensor([total_norm]):
        return total_norm.full_tensor()
    return total_norm


def get_total_norm(
    tensors: Sequence[torch.Tensor],
    norm_type: float,
    foreach: bool | None,
    sync_free_ok: Callable[[list[torch.Tensor], float], bool],
) -> torch.Tensor:
    """The p-norm of all elements of ``tensors`` (DTensors and plain tensors mixed).

    ``sync_free_ok(locals, p)`` says whether the float64 on-device path is
    exact enough (api.py's rule). Returns a 0-dim tensor on the first local
    tensor's device, float32 (float64 if any tensor is), equal on every rank.
    """
    parts = _local_parts(tensors)
    locals_ = [local for _, _, local in parts]
    device = locals_[0].device
    out_dtype = F64 if any(t.dtype == F64 for t in locals_) else torch.float32
    if device.type != "cpu" and sync_free_ok(locals_, norm_type):
        total = _total_in_float64(parts, norm_type)
    else:
        total = _total_exact(parts, norm_type, foreach)
    return total.to(device=device, dtype=out_dtype)


def _local_parts(tensors, drop_ties: bool = True):
    """(mesh, sharded mesh dims, local tensor) per tensor, Partial made Replicate, ties dropped."""
    from torch.distributed.tensor import DTensor, Replicate

    parts = []
    for t in tensors:
        if not isinstance(t, DTensor):
            parts.append((None, (), t))
            continue
        if any(p.is_partial() for p in t.placements):
            t = t.redistribute(t.device_mesh,
                               [Replicate() if p.is_partial() else p for p in t.placements])
        # Every placement but Replicate splits the tensor: Shard, and FSDP2's
        # _StridedShard over a tensor-parallel shard (whose is_shard() is False).
        dims = tuple(d for d, p in enumerate(t.placements) if not p.is_replicate())
        parts.append((t.device_mesh, dims, t.to_local()))
    if not drop_ties:
        return parts
    owner = find_ties([local for _, _, local in parts])
    return [part for i, part in enumerate(parts) if owner[i] == i]


def _by_reduction(parts) -> dict:
    """Indices of parts grouped by (mesh, sharded dims): one collective per group and dim."""
    groups: dict = {}
    for i, (mesh, dims, _) in enumerate(parts):
        key = (None, ()) if mesh is None or not dims else (mesh, dims)
        groups.setdefault(key, []).append(i)
    return groups


def _total_exact(parts, norm_type: float, foreach) -> torch.Tensor:
    return _part_sums(parts, norm_type, foreach).total().norm[0]


def tensor_sums(tensors: Sequence[torch.Tensor], norm_type: float,
                foreach: bool | None = None, with_max: bool = True) -> PowerSums:
    """Each tensor's power sums, DTensors combined over their meshes, in the given order.

    Every rank gets the same numbers (the monitor's per-group norms). Ties are
    not looked for: the caller passes each gradient once. ``with_max`` as
    ``tensor_power_sums``'.
    """
    return _part_sums(_local_parts(tensors, drop_ties=False), norm_type, foreach, with_max)


def _part_sums(parts, norm_type: float, foreach, with_max: bool = True) -> PowerSums:
    """The parts' sums in their order: one ``tensor_power_sums`` and one collective per
    (mesh, sharded dim) group."""
    rows = torch.empty(len(parts), dtype=torch.int64)
    pieces = []
    start = 0
    for (mesh, dims), indices in _by_reduction(parts).items():
        sums = tensor_power_sums([parts[i][2] for i in indices], norm_type, foreach=foreach,
                                 with_max=with_max)
        for dim in dims:
            sums = _combine_over(sums, mesh, dim)
        pieces.append(sums)
        rows[torch.tensor(indices, dtype=torch.int64)] = torch.arange(start, start + len(indices))
        start += len(indices)
    joined = PowerSums(norm_type, *(torch.cat([getattr(s, f).to(_dtype(f)) for s in pieces])
                                    for f in _FIELDS))
    return joined.take(rows)


def _dtype(field: str) -> torch.dtype:
    return F64 if field in ("scale", "power_sum", "max_abs") else torch.int64


def _combine_over(sums: PowerSums, mesh, dim: int) -> PowerSums:
    """Each tensor's sums combined over mesh dimension ``dim``: gathered, reduced in rank order.

    Counts travel as float64, exact below 2**53 elements.
    """
    import torch.distributed as dist

    group = mesh.get_group(dim)
    ranks = dist.get_world_size(group)
    n = len(sums)
    packed = torch.stack([getattr(sums, f).to(F64) for f in _FIELDS], dim=1)
    packed = packed.to(_collective_device(mesh))
    gathered = [torch.empty_like(packed) for _ in range(ranks)]
    dist.all_gather(gathered, packed, group=group)
    rows = torch.cat(gathered).to("cpu")
    every = PowerSums(sums.norm_type, *(rows[:, k].to(_dtype(f)) for k, f in enumerate(_FIELDS)))
    index = torch.arange(n, dtype=torch.int64).repeat(ranks)
    return every.reduce(index, n)


def _collective_device(mesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _total_in_float64(parts, norm_type: float) -> torch.Tensor:
    """Accelerator path, no host-device sync: float64 ``sum |x|^p`` (or max) all-reduced."""
    import torch.distributed as dist

    first = parts[0][2].device
    is_max = math.isinf(norm_type)
    combined = []
    for (mesh, dims), indices in _by_reduction(parts).items():
        locals_ = [parts[i][2] for i in indices]
        value = _local_power_sum(locals_, norm_type, first)
        op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM
        for dim in dims:
            dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        combined.append(value)
    stacked = torch.stack(combined)
    return stacked.max() if is_max else stacked.sum().pow(1.0 / norm_type)


def _local_power_sum(tensors: list[torch.Tensor], norm_type: float,
                     first: torch.device) -> torch.Tensor:
    """float64 ``sum |x|^p`` of local tensors (the max for p = inf), on ``first``, no read.

    Per (device, dtype) group, the Triton pass where it serves (CUDA: every
    element read once, two launches; ``core.triton_norms``), else one float64
    ``vector_norm`` per tensor (42.9 ms for Llama-2-7B's shapes on an H200).
    """
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    from ..core.kernels import fused_pass_sums

    is_max = math.isinf(norm_type)
    values = []
    live = [t for t in tensors if t.numel()]
    if not live:
        return torch.zeros((), dtype=F64, device=first)
    for [group], _ in _group_tensors_by_device_and_dtype([live]).values():
        fused_pass = fused_pass_sums(group, norm_type)
        if fused_pass is not None:
            values.append(fused_pass.total_power_sum().to(first))
            continue
        norms = torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=F64).to(first)
                             for t in group])
        values.append(norms.max() if is_max else norms.pow(norm_type).sum())
    stacked = torch.stack(values)
    return stacked.max() if is_max else stacked.sum()
