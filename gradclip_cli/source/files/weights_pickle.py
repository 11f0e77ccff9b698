"""The restricted unpickler both ``torch.save`` readers share (zip and legacy).

It reads what ``torch.load(weights_only=True)`` reads for the common
checkpoint: nested dicts / lists / tuples / OrderedDicts (with their
``_metadata``) of tensors and ``nn.Parameter``s and plain values (numbers,
strings, bytes, bytearrays, sets of plain values), plus the few torch values a
state dict holds (``torch.Size``, ``torch.device``, dtypes).
It runs the pickle with CPython's C unpickler, so every pickle protocol (2 to
5) is read alike; torch's own weights-only unpickler lacks the opcodes of
protocols 4 and 5 (FRAME, MEMOIZE, STACK_GLOBAL) and refuses such files, which
are harmless when they hold only these objects.

Why it is safe: ``find_class`` hands out only the few callables and markers
defined in this module (anything else raises ``Outside`` naming the global),
nothing from the file is called, and each callable checks the types of its
arguments before building anything. Tensors are built as inert placeholders
while unpickling (so BUILD / SETITEM / APPEND opcodes aimed at them fail
instead of reaching ``Tensor.__setstate__``) and swapped in by a final walk
that also rejects any type outside the subset.

A reader supplies ``resolve(persistent_id) -> StorageRef`` (where a storage's
bytes are) and calls ``unpickle`` then ``finish``.

A layout whose files pickle a framework's own small objects (DeepSpeed's loss
scaler and enums) reads them inside ``allowing(globals)``, the way
``torch.serialization.safe_globals`` widens torch's own list: each named
global maps to a stand-in the layout defines (an ``Opaque`` subclass, or a
checked callable), never to the framework's class, so nothing is imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import copyreg
import gc
import pickle
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import BinaryIO

import torch

__all__ = [
    "Attempt", "DTypeMarker", "Opaque", "Outside", "StorageRef", "TensorSubclass", "allowing",
    "check_storage_id", "finish", "held", "is_allowed", "known_storage", "pickle_protocol",
    "run_restricted", "unpickle",
]  # fmt: skip

_MAX_DIMS = 64
_MAX_DIM = 1 << 62


class Outside(Exception):
    """The file is outside what the restricted reader reads.

    ``culprit`` names the global the pickle imports (``os.system``), when that
    is the reason: only full unpickling could read it. ``unsafe`` is also set
    for other constructs only full unpickling reads (state set on a tensor,
    backward hooks). Otherwise the file is damaged or unusual, and torch's
    own reader may still make sense of it. ``protocol`` is the pickle's
    protocol, once known: torch's weights-only unpickler reads 2 and 3 only.
    ``damaged``: the file contradicts itself in a way torch's own reader would
    refuse too, or would read only partly (a storage that claims more bytes
    than its record holds): no second opinion is asked.
    """

    def __init__(self, reason: str, *, culprit: str | None = None, unsafe: bool = False,
                 damaged: bool = False):
        super().__init__(reason)
        self.culprit = culprit
        self.unsafe = unsafe or culprit is not None
        self.damaged = damaged
        self.protocol: int | None = None


class _Inert:
    """Base for objects the unpickler may hold: no state can be set on them."""

    __slots__ = ()
    __hash__ = None  # not usable as dict keys or set members

    def __setstate__(self, state):
        raise Outside("BUILD on a reader object", unsafe=True)

    def __reduce__(self):
        raise Outside("reader objects are not picklable")


class DTypeMarker(_Inert):
    """What ``find_class`` returns for ``torch.FloatStorage`` and friends, or
    ``torch.float32`` and friends (a dtype: ``_rebuild_tensor_v3``'s argument,
    or a value in its own right)."""

    __slots__ = ("dtype", "untyped", "is_dtype")

    def __init__(self, dtype: torch.dtype, untyped: bool = False, is_dtype: bool = False):
        self.dtype = dtype
        self.untyped = untyped
        self.is_dtype = is_dtype


class StorageRef(_Inert):
    """One storage of the file, as the reader's ``resolve`` hands it out.

    ``storage`` holds (or will hold, for the legacy format, whose bytes come
    after the pickle) ``numel`` elements of ``dtype``; ``data_offset`` is
    where those bytes lie in memory, for the alignment check.
    """

    __slots__ = ("key", "dtype", "untyped", "numel", "nbytes", "storage", "data_offset")

    def __init__(self, key, marker, numel, storage, data_offset):
        self.key = key
        self.dtype = marker.dtype
        self.untyped = marker.untyped
        self.numel = numel
        self.nbytes = numel * ITEMSIZE[marker.dtype]
        self.storage = storage
        self.data_offset = data_offset


class Opaque(_Inert):
    """Base of the stand-ins an ``allowing`` list hands out for a framework's objects.

    A subclass defines its own ``__slots__`` and, when the pickle sets state
    on it (NEWOBJ then BUILD), a ``__setstate__`` that checks every value
    before keeping it. ``finish`` keeps an ``Opaque`` as it is, like a
    plain value.
    """

    __slots__ = ()

    def __reduce__(self):
        # A stand-in is what was read, not the object: writing it back would
        # replace the file's object with gradclip's record of it.
        raise Outside("the checkpoint holds objects read only as inert data (such as an "
                      "argparse.Namespace); writing them back needs the objects themselves: "
                      "pass --trust-pickle only if you trust the file's source")


class TensorSubclass(Opaque):
    """Base of the stand-in an ``allowing`` list hands out for a tensor subclass's type
    (torch's ``DTensor``), which ``torch._tensor._rebuild_from_type_v2(func, type, args,
    state)`` names: ``rebuild`` gets the other three (``func`` as ``find_class`` handed it
    out, nothing called yet) and returns what stands for the tensor, checking every value
    (``held`` gives a tensor's value)."""

    __slots__ = ()

    def rebuild(self, func, args, state):
        raise Outside("a tensor subclass the reader does not rebuild", unsafe=True)


def held(value):
    """What a value the unpickler built holds: a tensor, ``torch.Size`` or ``torch.device``
    for their placeholders (which only ``finish`` swaps in), else ``value`` itself."""
    return value.value if type(value) is _Slot else value


# (module, name) -> stand-in: widened for the duration of ``allowing``.
_ALLOWED: contextvars.ContextVar[Mapping[tuple[str, str], object] | None] = \
    contextvars.ContextVar("gradclip_allowed_globals", default=None)


@contextlib.contextmanager
def allowing(stand_ins: Mapping[tuple[str, str], object]) -> Iterator[None]:
    """Within the block, ``find_class(module, name)`` also hands out ``stand_ins``."""
    token = _ALLOWED.set({**(_ALLOWED.get() or {}), **stand_ins})
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def is_allowed(dotted: str | None) -> bool:
    """True when ``module.name`` is on the list ``allowing`` has widened, now, or
    ``module`` alone holds a global on it (torch names the module alone for a DTensor:
    "``torch.distributed.tensor`` must be imported to load DTensors")."""
    allowed = _ALLOWED.get()
    dotted = dotted.strip("`") if dotted else dotted
    return bool(allowed and dotted) and any(dotted in (f"{m}.{n}", m) for m, n in allowed)


class _Slot(_Inert):
    """Stands for a value (a tensor, a Parameter, a torch.Size...) until ``finish``."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _storage_markers() -> dict[str, DTypeMarker]:
    quantized = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
    markers = {}
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        if dtype not in quantized:
            markers[name] = DTypeMarker(dtype)
    return markers


def _dtype_markers() -> dict[str, DTypeMarker]:
    names = (
        "float32 float64 float16 bfloat16 complex64 complex128 complex32 "
        "int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool "
        "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu"
    ).split()
    markers = {}
    for name in names:
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            markers[name] = DTypeMarker(dtype, is_dtype=True)
    return markers


_STORAGES = _storage_markers()
_DTYPES = _dtype_markers()
_DTYPES_SET = frozenset(m.dtype for m in _DTYPES.values())
_UNTYPED = DTypeMarker(torch.uint8, untyped=True)
ITEMSIZE = {m.dtype: m.dtype.itemsize for m in (*_STORAGES.values(), *_DTYPES.values())}
# Where torch.save recorded a storage; map_location="cpu" brings each one to the CPU.
_LOCATION = re.compile(r"(?:cpu|cuda|mps|xpu|hpu)(?::\d{1,4})?")


def check_storage_id(tag, marker, key, location, numel) -> None:
    """The parts of a storage's persistent id both formats share, checked."""
    if type(tag) is not str or tag != "storage":
        raise Outside("unexpected persistent id")
    if type(marker) is not DTypeMarker or marker.is_dtype or type(key) is not str:
        raise Outside("unexpected persistent id")
    if type(location) is not str or _LOCATION.fullmatch(location) is None:
        raise Outside("storage on an unknown device")
    if type(numel) is not int or numel < 0:
        raise Outside("bad storage size")


def known_storage(refs: dict[str, StorageRef], key: str, marker: DTypeMarker,
                  numel: int) -> StorageRef | None:
    """The storage already made for ``key``, which must be read the same way again."""
    ref = refs.get(key)
    if ref is not None and (
        ref.dtype is not marker.dtype or ref.numel != numel or ref.untyped != marker.untyped
    ):
        raise Outside("one storage key read as two storages")
    return ref


def pickle_protocol(head: bytes) -> int | None:
    """The protocol a pickle declares in its first two bytes (PROTO n), if any."""
    if len(head) >= 2 and head[0] == 0x80:
        return head[1]
    return None


# --- what find_class hands out ---------------------------------------------

_INT_ONLY = {int}
_empty = torch.empty


def _make_tensor(ref, offset, size, stride, requires_grad, hooks, dtype, metadata):
    if type(requires_grad) is not bool:
        raise Outside("bad requires_grad")
    if type(hooks) is not OrderedDict or hooks or vars(hooks):
        raise Outside("backward hooks", unsafe=True)
    if metadata is not None and (type(metadata) is not dict or metadata):
        raise Outside("tensor metadata", unsafe=True)
    if type(offset) is not int or offset < 0:
        raise Outside("bad storage offset")
    if type(size) is not tuple or type(stride) is not tuple:
        raise Outside("bad size or stride")
    ndim = len(size)
    if ndim != len(stride) or ndim > _MAX_DIMS:
        raise Outside("bad size or stride")
    itemsize = ITEMSIZE[dtype]
    if ref.data_offset % itemsize:
        raise Outside("storage misaligned for its dtype")
    capacity = ref.nbytes // itemsize
    if ndim:
        dims = size + stride
        if set(map(type, dims)) != _INT_ONLY or min(dims) < 0 or max(dims) >= _MAX_DIM:
            raise Outside("bad size or stride")
        if 0 in size:
            if offset > capacity:
                raise Outside("empty view past its storage")
        else:
            last = offset
            for n, s in zip(size, stride):
                last += (n - 1) * s
            if last >= capacity:
                raise Outside("view does not fit its storage")
    elif offset >= capacity:
        raise Outside("view does not fit its storage")
    tensor = _empty(0, dtype=dtype).set_(ref.storage, offset, size, stride)
    if requires_grad:
        # As torch's _rebuild_tensor_v2 does; integer dtypes refuse (RuntimeError).
        tensor.requires_grad = True
    return _Slot(tensor)


def _rebuild_v2(*args):
    if len(args) == 6:
        ref, offset, size, stride, requires_grad, hooks = args
        metadata = None
    elif len(args) == 7:
        ref, offset, size, stride, requires_grad, hooks, metadata = args
    else:
        raise Outside("unexpected _rebuild_tensor_v2 arguments")
    if type(ref) is not StorageRef or ref.untyped:
        raise Outside("_rebuild_tensor_v2 needs a typed storage")
    return _make_tensor(ref, offset, size, stride, requires_grad, hooks, ref.dtype, metadata)


def _rebuild_v3(*args):
    if len(args) == 7:
        ref, offset, size, stride, requires_grad, hooks, marker = args
        metadata = None
    elif len(args) == 8:
        ref, offset, size, stride, requires_grad, hooks, marker, metadata = args
    else:
        raise Outside("unexpected _rebuild_tensor_v3 arguments")
    if type(ref) is not StorageRef or not ref.untyped:
        raise Outside("_rebuild_tensor_v3 needs an untyped storage")
    if type(marker) is not DTypeMarker or marker.untyped or marker.dtype not in _DTYPES_SET:
        raise Outside("_rebuild_tensor_v3 needs a dtype")
    return _make_tensor(ref, offset, size, stride, requires_grad, hooks, marker.dtype, metadata)


def _rebuild_parameter(*args):
    """``nn.Parameter(data, requires_grad)``: what ``Parameter.__reduce_ex__`` pickles."""
    if len(args) != 3:
        raise Outside("unexpected _rebuild_parameter arguments")
    data, requires_grad, hooks = args
    if type(data) is not _Slot or type(data.value) is not torch.Tensor:
        raise Outside("_rebuild_parameter needs a tensor")
    if type(requires_grad) is not bool:
        raise Outside("bad requires_grad")
    if type(hooks) is not OrderedDict or hooks or vars(hooks):
        raise Outside("backward hooks", unsafe=True)
    return _Slot(torch.nn.Parameter(data.value, requires_grad))


class _TensorType(_Inert):
    """What ``find_class`` returns for ``torch.Tensor``: only ``_rebuild_from_type_v2`` takes it."""

    __slots__ = ()


_TENSOR_TYPE = _TensorType()


def _rebuild_from_type(*args):
    """``torch._tensor._rebuild_from_type_v2(func, torch.Tensor, args, state)``.

    How ``Tensor.__reduce_ex__`` pickles a plain tensor that carries Python
    attributes (DeepSpeed ZeRO-3 tags its flat buffers with ``ds_id``). Only
    the plain ``torch.Tensor`` type, only this module's tensor rebuilders, and
    only new, non-underscore attribute names with plain values, as torch's
    weights-only unpickler sets them.
    """
    if len(args) != 4:
        raise Outside("unexpected _rebuild_from_type_v2 arguments")
    func, new_type, func_args, state = args
    if isinstance(new_type, TensorSubclass):
        return new_type.rebuild(func, func_args, state)
    if func not in (_rebuild_v2, _rebuild_v3) or new_type is not _TENSOR_TYPE \
            or type(func_args) is not tuple:
        raise Outside("_rebuild_from_type_v2 of something other than a plain tensor",
                      unsafe=True)
    if state is not None and type(state) is not dict:
        raise Outside("tensor state that is not a dict of attributes", unsafe=True)
    slot = func(*func_args)
    for name, value in (state or {}).items():
        if type(name) is not str or not name.isidentifier() or name.startswith("_") \
                or hasattr(torch.Tensor, name) or type(value) not in _PLAIN:
            raise Outside("tensor attribute outside plain values", unsafe=True)
        setattr(slot.value, name, value)
    return slot


def _size(*args):
    if len(args) != 1 or type(args[0]) is not tuple or set(map(type, args[0])) - _INT_ONLY:
        raise Outside("unexpected torch.Size arguments")
    return _Slot(torch.Size(args[0]))


def _device(*args):
    if not args or len(args) > 2 or type(args[0]) is not str or (
        len(args) == 2 and type(args[1]) is not int
    ):
        raise Outside("unexpected torch.device arguments")
    try:
        return _Slot(torch.device(*args))
    except (RuntimeError, ValueError):
        raise Outside("bad torch.device") from None


def _complex(*args):
    if not 1 <= len(args) <= 2 or set(map(type, args)) - {int, float}:
        raise Outside("unexpected complex arguments")
    return complex(*args)


def _bytearray(*args):
    """``bytearray(b"...")``, as protocols 3 and 4 pickle one; never ``bytearray(10**12)``."""
    if args == ():
        return bytearray()
    if len(args) != 1 or type(args[0]) is not bytes:
        raise Outside("unexpected bytearray arguments")
    return bytearray(args[0])


class _Unpickler(pickle.Unpickler):
    """CPython's C unpickler, allowed to import only this module's own objects."""

    def __init__(self, file, resolve):
        super().__init__(file)
        self.persistent_load = resolve  # an attribute: one call less per storage

    def find_class(self, module, name):
        found = self._find_class(module, name)
        if found is None:
            raise Outside(f"global {module}.{name}", culprit=f"{module}.{name}")
        return found

    def _find_class(self, module, name):
        if module == "torch._utils":
            if name == "_rebuild_tensor_v2":
                return _rebuild_v2
            if name == "_rebuild_tensor_v3":
                return _rebuild_v3
            if name == "_rebuild_parameter":
                return _rebuild_parameter
        elif module == "collections" and name == "OrderedDict":
            return OrderedDict
        elif module == "torch":
            marker = _STORAGES.get(name) or _DTYPES.get(name)
            if marker is not None:
                return marker
            if name == "Size":
                return _size
            if name == "device":
                return _device
            if name == "Tensor":
                return _TENSOR_TYPE
        elif module == "torch.storage" and name == "UntypedStorage":
            return _UNTYPED
        elif module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type
        elif module == "builtins":
            # Sets, frozensets and bytes have opcodes of their own from protocol 3 or 4 on.
            if name == "complex":
                return _complex
            if name == "bytearray":
                return _bytearray
        allowed = _ALLOWED.get()
        if allowed is not None and (module, name) in allowed:
            return allowed[(module, name)]
        return None


class Attempt:
    """What a reader has learnt so far, for the ``Outside`` it may raise."""

    __slots__ = ("protocol",)

    def __init__(self):
        self.protocol: int | None = None


def run_restricted(read: Callable[[Attempt], object]) -> object:
    """Run ``read`` with the garbage collector paused; every failure becomes ``Outside``.

    Tens of thousands of small objects would trigger full collections that
    find nothing to free (as they do in torch.load). Any exception other than
    ``Outside`` is a surprise (damage the checks did not name): it becomes an
    ``Outside`` too, never unsafe, so torch's reader may still decide.
    """
    attempt = Attempt()
    collecting = gc.isenabled()
    gc.disable()
    try:
        return read(attempt)
    except Exception as error:  # noqa: BLE001 - see the docstring
        if isinstance(error, Outside):
            outside = error
        else:
            lines = str(error).strip().splitlines()
            outside = Outside(f"{type(error).__name__}: {lines[0] if lines else ''}".strip(": "))
        outside.protocol = attempt.protocol
        raise outside from None
    finally:
        if collecting:
            gc.enable()


def _no_storages(pid):
    raise Outside("unexpected persistent id")


def unpickle(file: BinaryIO, resolve: Callable[[object], StorageRef] = _no_storages) -> object:
    """Run one pickle from ``file`` (left just after its STOP) with the restricted unpickler.

    The result may still hold placeholders: pass it to ``finish``. A file
    kind's own inert records (DCP's metadata classes, DeepSpeed's) are handed
    out inside ``allowing``.
    """
    if copyreg._extension_cache or copyreg._inverted_registry:
        # EXT opcodes resolved through a populated cache bypass find_class.
        raise Outside("copyreg extension codes registered in this process")
    # A damaged pickle can make CPython report an error while freeing what it
    # built ("deallocated bytearray object has exported buffers", from a
    # READONLY_BUFFER opcode on a bytearray): that goes to sys.unraisablehook,
    # which would print a second stderr line. Catch it here and call the file damaged.
    # CPython 3.11's bytearray reports it through PyErr_Print, that is
    # sys.excepthook, not the unraisable hook: listen on both.
    hook, excepthook, unraisable = sys.unraisablehook, sys.excepthook, []
    sys.unraisablehook = unraisable.append
    sys.excepthook = lambda kind, value, traceback: unraisable.append(
        SimpleNamespace(exc_type=kind))
    try:
        unpickler = _Unpickler(file, resolve)
        try:
            result = unpickler.load()
        finally:
            del unpickler  # its stack and memo are freed now, while the hook listens
    except Outside:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, RuntimeError, OverflowError, MemoryError,
            SystemError) as error:
        raise Outside(f"damaged pickle: {type(error).__name__}: {error}") from None
    finally:
        sys.unraisablehook = hook
        sys.excepthook = excepthook
    if unraisable:
        raise Outside(f"damaged pickle: {unraisable[0].exc_type.__name__}")
    return result


# --- the result walk -------------------------------------------------------

_PLAIN = (str, int, float, bool, complex, bytes, type(None))


def finish(root):
    """Swap placeholders for their values and reject any type outside the subset.

    Lists, dicts and OrderedDicts are fixed in place (keeping shared references
    shared); tuples are rebuilt once each. A cycle through a tuple rejects.
    The walk uses its own stack, so any depth torch.load reads is read here.
    """
    done: dict[int, object] = {}

    def leaf(obj):
        """The value of ``obj`` if it needs no walk, else None (and the walk follows)."""
        kind = type(obj)
        if kind is _Slot:
            return obj.value
        if kind in _PLAIN:
            return obj
        if kind is DTypeMarker and obj.is_dtype:
            return obj.dtype
        if kind is set or kind is frozenset:
            for item in obj:
                if type(item) not in _PLAIN and not _plain_key(item):
                    raise Outside("unsupported set member")
            return obj
        if kind is bytearray or isinstance(obj, Opaque):
            return obj
        return None

    result = leaf(root)
    if result is not None or root is None:
        return result
    # Each frame: (container, its items as (slot, child) pairs still to do, results).
    # A tuple is rebuilt after its children; lists and dicts are patched in place.
    active: set[int] = set()
    stack: list[list] = []

    def enter(obj) -> object | None:
        """Start ``obj``; returns its final value at once when already known."""
        ident = id(obj)
        if ident in done:
            return done[ident]
        kind = type(obj)
        if kind is list:
            done[ident] = obj
            stack.append([obj, iter(enumerate(obj)), None])
            return None
        if kind is dict or kind is OrderedDict:
            for key in obj:
                if type(key) not in _PLAIN and not _plain_key(key):
                    raise Outside("unsupported dict key")
            done[ident] = obj
            items = list(obj.items())
            if kind is OrderedDict and vars(obj):
                items += [(_Attribute(k), v) for k, v in vars(obj).items()]
            stack.append([obj, iter(items), None])
            return None
        if kind is tuple:
            if ident in active:
                raise Outside("cycle through a tuple")
            active.add(ident)
            stack.append([obj, iter(enumerate(obj)), []])
            return None
        raise Outside(f"unsupported type {kind.__name__}")

    def store(frame, slot, child, new) -> None:
        obj, _, parts = frame
        if parts is not None:
            parts.append(new)
        elif new is not child:
            if type(slot) is _Attribute:
                vars(obj)[slot.name] = new
            else:
                obj[slot] = new

    enter(root)
    pending: list[tuple] = []  # (slot, child) of the frame below, for when a child finishes
    while stack:
        frame = stack[-1]
        step = next(frame[1], None)
        if step is None:
            stack.pop()
            obj, _, parts = frame
            if parts is not None:  # a tuple: rebuilt from its finished parts
                active.discard(id(obj))
                new = obj if all(a is b for a, b in zip(parts, obj)) else tuple(parts)
                done[id(obj)] = new
            else:
                new = obj
            if stack:
                slot, child = pending.pop()
                store(stack[-1], slot, child, new)
            continue
        slot, child = step
        value = leaf(child)
        if value is not None or child is None:
            store(frame, slot, child, value)
            continue
        known = enter(child)
        if known is not None:
            store(frame, slot, child, known)
        else:
            pending.append((slot, child))
    return done.get(id(root), root)


class _Attribute:
    """A slot of the walk that is an attribute (an OrderedDict's ``_metadata``), not a key."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


def _plain_key(key) -> bool:
    """A tuple key made of plain values (nested tuples too, to any depth: no recursion)."""
    if type(key) is not tuple:
        return False
    pending = [key]
    while pending:
        for part in pending.pop():
            if type(part) is tuple:
                pending.append(part)
            elif type(part) not in _PLAIN:
                return False
    return True
