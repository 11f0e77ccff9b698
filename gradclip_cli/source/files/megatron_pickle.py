"""The Megatron objects a checkpoint's ``common.pt`` pickles, as inert stand-ins.

Megatron-LM's ``save_checkpoint`` puts its command line, an
``argparse.Namespace``, in every checkpoint (``args``), beside the iteration
and the optimizer's hyperparameters. A ``Namespace`` pickles as the object
(NEWOBJ, then BUILD with its ``__dict__``); ``GLOBALS`` maps it to
``NamespaceState``, which keeps the attributes as the restricted unpickler
built them (plain values, tensors, dtypes), so reading never constructs a
``Namespace`` and nothing from the file is called. Read a file inside
``weights_pickle.allowing(GLOBALS)``; any other global is refused as before.

The legacy format (``--ckpt-format torch``: one ``model_optim_rng.pt`` per
model-parallel rank, Megatron-LM core_v0.16.1) pickles a little more beside it:

* in ``args``, Megatron's own enums (``AttnBackend``, ``CudaGraphScope``...,
  from ``megatron.core.transformer.enums``) and ``signal.Signals`` (its
  ``exit_signal``), each pickled as a call ``Enum(value)``: ``EnumValue``
  keeps the class's name and the plain value;
* in ``rng_state``, numpy's RNG state (``np.random.get_state()``): an array
  pickled as ``numpy._core.multiarray._reconstruct(ndarray, shape, b'b')``
  then BUILD with ``(version, shape, dtype, fortran, raw bytes)``, its dtype as
  ``numpy.dtype('u4', False, True)`` then BUILD with plain values, and
  protocol 2's bytes as ``_codecs.encode(text, 'latin1')``. ``NumpyArray``
  and ``NumpyDtype`` check those values and keep the shape only: nothing of
  numpy is imported or run.
"""

from __future__ import annotations

from gradclip_cli.source.files.weights_pickle import Opaque, Outside


def _refused(global_name: str, reason: str) -> Outside:
    """A stand-in refusing what the file hands it: only the real ``global_name`` would take
    it, so that global is the one named as the reason for the refusal (torch's own reader,
    which decides next, stops at the first global it lacks: another stand-in's, such as
    ``argparse.Namespace``, which gradclip allows)."""
    return Outside(reason, culprit=f"{global_name} with what its inert stand-in does not take")


_RECONSTRUCT = "numpy._core.multiarray._reconstruct"


class NamespaceState(Opaque):
    """An ``argparse.Namespace``'s attributes, by name."""

    __slots__ = ("state",)

    def __new__(cls, *args):
        if args:
            raise _refused("argparse.Namespace", "unexpected argparse.Namespace arguments")
        self = super().__new__(cls)
        self.state = {}
        return self

    def __setstate__(self, state):
        if type(state) is not dict or any(type(k) is not str for k in state):
            raise _refused("argparse.Namespace",
                           "argparse.Namespace state is not a dict of names")
        self.state = dict(state)


_PLAIN = (int, float, bool, str, bytes, type(None))


class EnumValue(Opaque):
    """A member of an enum named on the list, as ``(class name, value)``."""

    __slots__ = ("enum", "value")

    def __repr__(self):
        return f"{self.enum}({self.value!r})"


def _enum(name: str, module: str):
    def member(*args) -> EnumValue:
        if len(args) != 1 or type(args[0]) not in (int, str):
            raise _refused(f"{module}.{name}", f"unexpected {name} value")
        value = EnumValue.__new__(EnumValue)
        value.enum, value.value = name, args[0]
        return value

    return member


class NumpyArrayType(Opaque):
    """What ``numpy.ndarray`` stands for: only ``_reconstruct``'s first argument."""

    __slots__ = ()


class NumpyDtype(Opaque):
    """``numpy.dtype(code, align, copy)`` with its pickled state: plain values only."""

    __slots__ = ("code",)

    def __new__(cls, *args):
        if (
            len(args) != 3
            or type(args[0]) is not str
            or len(args[0]) > 8
            or any(type(a) is not bool for a in args[1:])
        ):
            raise _refused("numpy.dtype", "unexpected numpy.dtype arguments")
        self = super().__new__(cls)
        self.code = args[0]
        return self

    def __setstate__(self, state):
        if type(state) is not tuple or len(state) > 9 or any(type(v) not in _PLAIN for v in state):
            raise _refused("numpy.dtype", "numpy.dtype state is not a tuple of plain values")


class NumpyArray(Opaque):
    """A numpy array's shape; its bytes are checked to be bytes, and dropped."""

    __slots__ = ("shape",)

    def __setstate__(self, state):
        if type(state) is not tuple or len(state) != 5:
            raise _refused("numpy.ndarray",
                           "numpy array state is not (version, shape, dtype, fortran, data)")
        version, shape, dtype, fortran, data = state
        if (
            type(version) is not int
            or type(shape) is not tuple
            or any(type(n) is not int or n < 0 for n in shape)
            or type(dtype) is not NumpyDtype
            or type(fortran) is not bool
            or type(data) is not bytes
        ):
            raise _refused("numpy.ndarray",
                           "numpy array state is not (version, shape, dtype, fortran, data)")
        self.shape = shape


def _reconstruct(*args) -> NumpyArray:
    if (
        len(args) != 3
        or type(args[0]) is not NumpyArrayType
        or type(args[1]) is not tuple
        or type(args[2]) is not bytes
    ):
        raise _refused(_RECONSTRUCT, "unexpected numpy _reconstruct arguments")
    array = NumpyArray.__new__(NumpyArray)
    array.shape = None
    return array


def _latin1(*args) -> bytes:
    """``_codecs.encode(text, 'latin1')``: how protocol 2 pickles bytes."""
    if len(args) != 2 or type(args[0]) is not str or args[1] != "latin1":
        raise _refused("_codecs.encode", "unexpected _codecs.encode arguments")
    try:
        return args[0].encode("latin1")
    except UnicodeEncodeError:  # bytes never pickle so: only the real encode takes it
        raise _refused("_codecs.encode", "_codecs.encode of a text outside latin-1") from None


_ENUMS = ("AttnBackend", "AttnMaskType", "AttnType", "CudaGraphScope", "LayerType", "ModelType")
_NDARRAY = NumpyArrayType.__new__(NumpyArrayType)

GLOBALS: dict[tuple[str, str], object] = {
    ("argparse", "Namespace"): NamespaceState,
    **{("megatron.core.transformer.enums", name): _enum(name, "megatron.core.transformer.enums")
       for name in _ENUMS},
    ("signal", "Signals"): _enum("Signals", "signal"),
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,  # numpy before 2
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): NumpyDtype,
    ("_codecs", "encode"): _latin1,
}

__all__ = ["GLOBALS", "EnumValue", "NamespaceState", "NumpyArray", "NumpyDtype"]
