"""torch's ``DTensor`` as ``torch.save`` pickles it, read as one rank's shard and its place.

``torch.save`` of an FSDP2 model's or optimizer's ``state_dict()`` (verl's
``FSDPCheckpointManager``, torch 2.13) pickles each sharded tensor as
``torch._tensor._rebuild_from_type_v2(torch._utils._rebuild_wrapper_subclass,
DTensor, (DTensor, dtype, size, stride, offset, layout, device, requires_grad),
(None, {"_local_tensor": <this rank's tensor>, "_spec": DTensorSpec}))
(no ``__dict__``, its ``__slots__``)``; the spec is
built as objects (NEWOBJ, then BUILD with their ``__dict__``): a ``DeviceMesh``
(its layout, this rank's coordinate on it, its rank map), the ``placements``
(``Shard(dim)`` or ``Replicate()``), a ``TensorMeta`` (the full tensor's shape,
stride and dtype) and the ``shard_order``. Unpickled by torch, a ``DTensor``
needs a process group to be used; here nothing of ``torch.distributed`` is
imported or called.

``GLOBALS`` maps exactly those names to stand-ins defined here; read a file
inside ``weights_pickle.allowing(GLOBALS)``. Each stand-in checks what the
pickle hands it and keeps plain values only; the tensor itself becomes a
``DTensorShard``: the local tensor, the full tensor's shape and dtype, the
placements, the mesh's sizes and this rank's coordinate on it, from which
``box()`` places the shard in the full tensor (torch's ``Shard`` splits a
dimension as ``torch.chunk`` does). A ``Partial`` placement is kept by name
for the layout to refuse; ``_StridedShard`` and any other global is refused
as before.
"""

from __future__ import annotations

import math

import torch

from gradclip_cli.source.files.weights_pickle import (
    DTypeMarker,
    Opaque,
    Outside,
    TensorSubclass,
    held,
)

_PLACEMENTS = "torch.distributed.tensor.placement_types"
_SPEC = "torch.distributed.tensor._dtensor_spec"


def _refused(global_name: str, reason: str) -> Outside:
    """What a stand-in raises for what only the real ``global_name`` would take."""
    return Outside(reason, culprit=f"{global_name} with what its inert stand-in does not take")


def _ints(value, *, nested: bool = False) -> bool:
    """A tuple of non-negative ints (of such tuples too, when ``nested``)."""
    return type(value) is tuple and all(
        (type(v) is int and v >= 0) or (nested and _ints(v, nested=True)) for v in value
    )


def _flat(value) -> tuple[int, ...]:
    out: list[int] = []
    pending = [value]
    while pending:
        item = pending.pop()
        if type(item) is tuple:
            pending.extend(reversed(item))
        else:
            out.append(item)
    return tuple(out)


class _Built(Opaque):
    """A stand-in made by NEWOBJ with no arguments, then given its ``__dict__`` by BUILD."""

    __slots__ = ()
    NAME = ""

    def __new__(cls, *args):
        if args:
            raise _refused(cls.NAME, f"unexpected {cls.NAME} arguments")
        return super().__new__(cls)

    def __setstate__(self, state):
        if type(state) is not dict or any(type(k) is not str for k in state):
            raise _refused(self.NAME, f"{self.NAME} state is not a dict of names")
        self.take(state)

    def take(self, state: dict) -> None:
        raise NotImplementedError


class FlatLayout(_Built):
    """``_FlatLayout``: one mesh dimension's ``shape`` and ``stride`` (nested ints)."""

    __slots__ = ("size",)
    NAME = "torch.distributed._mesh_layout._FlatLayout"

    def take(self, state):
        shape, stride = state.get("shape"), state.get("stride")
        if set(state) != {"shape", "stride"} or not _ints(shape, nested=True) \
                or not _ints(stride, nested=True):
            raise _refused(self.NAME, "_FlatLayout state is not its shape and stride")
        self.size = math.prod(_flat(shape))


class MeshLayout(_Built):
    """``_MeshLayout``: its ``axes``, one ``_FlatLayout`` per mesh dimension."""

    __slots__ = ("sizes",)
    NAME = "torch.distributed._mesh_layout._MeshLayout"

    def take(self, state):
        axes = state.get("axes")
        if set(state) != {"axes"} or type(axes) is not tuple or not axes or any(
            type(a) is not FlatLayout or not hasattr(a, "size") for a in axes
        ):
            raise _refused(self.NAME, "_MeshLayout state is not its axes")
        self.sizes = tuple(a.size for a in axes)


# A DeviceMesh's attributes beside the few kept: process-group names and caches, all
# plain values (checked by ``_inert``).
_MESH_KEPT = ("_layout", "_rank", "_coordinate_on_dim", "_rank_map")


class DeviceMesh(_Built):
    """A ``DeviceMesh``'s sizes (one per dimension) and this rank's place on it."""

    __slots__ = ("sizes", "coordinate")
    NAME = "torch.distributed.device_mesh.DeviceMesh"

    def take(self, state):
        layout, rank = state.get("_layout"), state.get("_rank")
        coordinate, rank_map = state.get("_coordinate_on_dim"), held(state.get("_rank_map"))
        if (
            type(layout) is not MeshLayout
            or not hasattr(layout, "sizes")
            or type(rank) is not int
            or not (coordinate is None or _ints(coordinate))
            or type(rank_map) is not torch.Tensor
            or rank_map.dtype not in (torch.int32, torch.int64)
            or rank_map.numel() != math.prod(layout.sizes)
            or any(not _inert(v) for k, v in state.items() if k not in _MESH_KEPT)
        ):
            raise _refused(self.NAME, "DeviceMesh state is not a mesh's layout, rank and "
                                      "coordinate with plain values beside")
        if coordinate is not None and (
            len(coordinate) != len(layout.sizes)
            or any(c >= n for c, n in zip(coordinate, layout.sizes))
        ):
            raise _refused(self.NAME, "DeviceMesh coordinate outside the mesh")
        self.sizes, self.coordinate = layout.sizes, coordinate


class Shard(_Built):
    """``Shard(dim)``: the tensor split along ``dim`` over a mesh dimension."""

    __slots__ = ("dim",)
    NAME = f"{_PLACEMENTS}.Shard"

    def take(self, state):
        if set(state) != {"dim"} or type(state["dim"]) is not int:
            raise _refused(self.NAME, "Shard state is not its dim")
        self.dim = state["dim"]


class Replicate(_Built):
    """``Replicate()``: every rank of a mesh dimension holds the same tensor."""

    __slots__ = ()
    NAME = f"{_PLACEMENTS}.Replicate"

    def take(self, state):
        if state:
            raise _refused(self.NAME, "Replicate with state")


class Partial(_Built):
    """``Partial(reduce_op)``: each rank of a mesh dimension holds a term of the tensor, a
    sum (or other reduction) not yet taken. Kept so the layout can say so by name."""

    __slots__ = ("reduce_op",)
    NAME = f"{_PLACEMENTS}.Partial"

    def take(self, state):
        if set(state) != {"reduce_op"} or type(state["reduce_op"]) is not str:
            raise _refused(self.NAME, "Partial state is not its reduce_op")
        self.reduce_op = state["reduce_op"]


class TensorMeta(Opaque):
    """``TensorMeta(shape, stride, dtype)``: the full tensor's."""

    __slots__ = ("shape", "dtype")
    NAME = f"{_SPEC}.TensorMeta"

    def __new__(cls, *args):
        shape = held(args[0]) if len(args) == 3 else None
        if (
            type(shape) is not torch.Size
            or not _ints(args[1])
            or type(args[2]) is not DTypeMarker
            or not args[2].is_dtype
        ):
            raise _refused(cls.NAME, "unexpected TensorMeta arguments")
        self = super().__new__(cls)
        self.shape, self.dtype = shape, args[2].dtype
        return self


class ShardOrderEntry(Opaque):
    """``ShardOrderEntry(tensor_dim, mesh_dims)``: checked, and kept as nothing more."""

    __slots__ = ()
    NAME = f"{_SPEC}.ShardOrderEntry"

    def __new__(cls, *args):
        if len(args) != 2 or type(args[0]) is not int or not _ints(args[1]):
            raise _refused(cls.NAME, "unexpected ShardOrderEntry arguments")
        return super().__new__(cls)


class DTensorSpec(_Built):
    """A ``DTensorSpec``: its mesh, placements and the full tensor's meta."""

    __slots__ = ("mesh", "placements", "meta")
    NAME = f"{_SPEC}.DTensorSpec"

    def take(self, state):
        mesh, placements, meta = (state.get(k) for k in ("mesh", "placements", "tensor_meta"))
        if (
            type(mesh) is not DeviceMesh
            or not hasattr(mesh, "sizes")
            or type(placements) is not tuple
            or len(placements) != len(mesh.sizes)
            or any(type(p) not in (Shard, Replicate, Partial) or not _done(p) for p in placements)
            or type(meta) is not TensorMeta
            or any(not _inert(v) for k, v in state.items()
                   if k not in ("mesh", "placements", "tensor_meta"))
        ):
            raise _refused(self.NAME, "DTensorSpec state is not a mesh, Shard, Replicate or "
                                      "Partial placements and a tensor meta")
        self.mesh, self.placements, self.meta = mesh, placements, meta


def _done(placement) -> bool:
    return type(placement) is Replicate or hasattr(placement, "dim") \
        or hasattr(placement, "reduce_op")


def placement(p) -> tuple:
    """A placement as plain data: ``("shard", dim)``, ``("replicate",)``, or ``("other",
    class name)`` (``Partial``, ``_StridedShard``: the layout refuses those by name)."""
    if type(p).__name__ == "Shard":
        return ("shard", p.dim)
    if type(p).__name__ == "Replicate":
        return ("replicate",)
    return ("other", type(p).__name__)


_PLAIN = (str, int, float, bool, type(None))


def _inert(value) -> bool:
    """Plain values, tuples, lists and string-keyed dicts of them, meshes and shard orders:
    what a spec or mesh holds beside the attributes read (caches, names, hashes)."""
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _PLAIN or kind in (ShardOrderEntry, DeviceMesh):
            continue
        if kind in (tuple, list):
            pending.extend(item)
        elif kind is dict and all(type(k) is str for k in item):
            pending.extend(item.values())
        else:
            return False
    return True


class _Layout(Opaque):
    """What ``torch.serialization._get_layout("torch.strided")`` stands for."""

    __slots__ = ()


_STRIDED = _Layout.__new__(_Layout)


def _get_layout(*args):
    if args != ("torch.strided",):
        raise _refused("torch.serialization._get_layout", "a layout other than torch.strided")
    return _STRIDED


def _wrapper_subclass(*args):
    """Called on its own, not as ``_rebuild_from_type_v2``'s function for a DTensor."""
    raise _refused("torch._utils._rebuild_wrapper_subclass",
                   "_rebuild_wrapper_subclass outside a DTensor's rebuild")


class DTensorShard(Opaque):
    """One rank's shard of a ``DTensor``: ``local`` (the rank's tensor), ``shape`` and
    ``dtype`` (the full tensor's), ``placements`` (``("shard", dim)`` or
    ``("replicate",)`` per mesh dimension), the mesh's ``sizes``, and the rank's
    ``coordinate`` on it (None: the rank is not on the mesh)."""

    __slots__ = ("local", "shape", "dtype", "placements", "sizes", "coordinate")

    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where ``local`` lies in the full tensor: (offsets, sizes). Each mesh dimension
        that shards a tensor dimension splits what the earlier ones left, as
        ``torch.chunk`` does (``Shard._local_shard_size_and_offset``)."""
        offsets = [0] * len(self.shape)
        sizes = list(self.shape)
        for placement, parts, index in zip(self.placements, self.sizes, self.coordinate):
            if placement[0] != "shard":
                continue
            dim = placement[1]
            chunk = -(-sizes[dim] // parts)
            start = min(index * chunk, sizes[dim])
            offsets[dim] += start
            sizes[dim] = min(sizes[dim], start + chunk) - start
        return tuple(offsets), tuple(sizes)

    def replica(self) -> bool:
        """Whether another rank holds this same shard as the first copy (its coordinate on a
        ``Replicate`` mesh dimension is not 0): it counts once, there."""
        return any(p[0] == "replicate" and c for p, c in zip(self.placements, self.coordinate))


class _DTensorType(TensorSubclass):
    """``torch.distributed.tensor.DTensor``, as ``_rebuild_from_type_v2`` names it."""

    __slots__ = ()

    def rebuild(self, func, args, state):
        if func is not _wrapper_subclass or type(args) is not tuple or len(args) != 8:
            raise _refused("torch.distributed.tensor.DTensor", "a DTensor rebuilt otherwise")
        cls, dtype, size, stride, offset, layout, device, requires_grad = args
        # DTensor keeps its fields in __slots__: the state is (no __dict__, the slots).
        if type(state) is tuple and len(state) == 2 and state[0] in (None, {}):
            state = state[1]
        local = held(state.get("_local_tensor")) if type(state) is dict else None
        spec = state.get("_spec") if type(state) is dict else None
        if (
            cls is not self
            or type(dtype) is not DTypeMarker
            or not dtype.is_dtype
            or not _ints(size)
            or not _ints(stride)
            or len(stride) != len(size)
            or offset != 0
            or layout is not _STRIDED
            or type(held(device)) is not torch.device
            or type(requires_grad) is not bool
            or set(state) != {"_local_tensor", "_spec"}
            or type(local) is not torch.Tensor
            or type(spec) is not DTensorSpec
            or not hasattr(spec, "meta")
        ):
            raise _refused("torch.distributed.tensor.DTensor",
                           "DTensor state is not a local tensor and its spec")
        meta, mesh = spec.meta, spec.mesh
        if tuple(meta.shape) != size or meta.dtype is not dtype.dtype \
                or local.dtype is not dtype.dtype:
            raise Outside("a DTensor whose spec disagrees with its size or dtype")
        if any(type(p) is Shard and not 0 <= p.dim < len(size) for p in spec.placements):
            raise Outside("a DTensor sharded along a dimension it does not have")
        shard = DTensorShard.__new__(DTensorShard)
        shard.local, shard.shape, shard.dtype = local, torch.Size(size), dtype.dtype
        shard.placements = tuple(placement(p) for p in spec.placements)
        shard.sizes, shard.coordinate = mesh.sizes, mesh.coordinate
        return shard


GLOBALS: dict[tuple[str, str], object] = {
    ("torch.distributed.tensor", "DTensor"): _DTensorType.__new__(_DTensorType),
    ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper_subclass,
    ("torch.serialization", "_get_layout"): _get_layout,
    (_SPEC, "DTensorSpec"): DTensorSpec,
    (_SPEC, "TensorMeta"): TensorMeta,
    (_SPEC, "ShardOrderEntry"): ShardOrderEntry,
    ("torch.distributed.device_mesh", "DeviceMesh"): DeviceMesh,
    ("torch.distributed._mesh_layout", "_MeshLayout"): MeshLayout,
    ("torch.distributed._mesh_layout", "_FlatLayout"): FlatLayout,
    (_PLACEMENTS, "Shard"): Shard,
    (_PLACEMENTS, "Replicate"): Replicate,
    (_PLACEMENTS, "Partial"): Partial,
}

__all__ = ["GLOBALS", "DTensorShard", "placement"]
