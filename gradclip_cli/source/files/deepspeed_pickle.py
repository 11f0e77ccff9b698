"""The DeepSpeed objects a ZeRO checkpoint pickles, as inert stand-ins.

DeepSpeed's ``*_optim_states.pt`` files are ``torch.save`` files whose pickle
names a few of DeepSpeed's own classes beside the tensors (DeepSpeed 0.19,
``runtime/zero/stage_1_and_2.py`` and ``stage3.py`` ``state_dict``):

* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler``:
  the loss scaler, pickled as the object (NEWOBJ, then BUILD with its
  ``__dict__``: numbers, flags and the low-precision dtype);
* ``deepspeed.runtime.zero.config.ZeroStageEnum``: the ZeRO stage, an
  ``int`` enum pickled as ``ZeroStageEnum(2)``;
* ``deepspeed.utils.tensor_fragment.fragment_address``: a dataclass
  ``(numel, start)`` per parameter, where its slice lies in the rank's
  partition (``param_slice_mappings``).

``GLOBALS`` maps exactly these to stand-ins defined here; read a file inside
``weights_pickle.allowing(GLOBALS)``. Each stand-in checks what the pickle
gives it and keeps plain values only, so reading never imports DeepSpeed and
nothing from the file is called. Any other global is refused as before.
"""

from __future__ import annotations

from gradclip_cli.source.files.weights_pickle import DTypeMarker, Opaque, Outside

_PLAIN = (int, float, bool, str, type(None))


class LossScalerState(Opaque):
    """A DeepSpeed loss scaler's attributes (``cur_scale``, ``dynamic``...), as plain values."""

    __slots__ = ("state",)

    def __new__(cls, *args):
        if args:
            raise Outside("unexpected loss scaler arguments")
        self = super().__new__(cls)
        self.state = {}
        return self

    def __setstate__(self, state):
        if type(state) is not dict:
            raise Outside("loss scaler state is not a dict")
        kept: dict[str, object] = {}
        for key, value in state.items():
            if type(key) is not str:
                raise Outside("loss scaler state keyed by a non-string")
            if type(value) is DTypeMarker and value.is_dtype:
                value = value.dtype
            elif type(value) not in _PLAIN:
                raise Outside(f"loss scaler attribute {key!r} is not a plain value")
            kept[key] = value
        self.state = kept


class DynamicLossScalerState(LossScalerState):
    __slots__ = ()


class FragmentAddress(Opaque):
    """``fragment_address(numel, start)``: a parameter's slice of one rank's partition."""

    __slots__ = ("numel", "start")

    def __new__(cls, *args):
        if args:
            raise Outside("unexpected fragment_address arguments")
        self = super().__new__(cls)
        self.numel = self.start = None
        return self

    def __setstate__(self, state):
        if type(state) is not dict or set(state) != {"numel", "start"} or any(
                type(v) is not int or v < 0 for v in state.values()):
            raise Outside("fragment_address state is not (numel, start)")
        self.numel = state["numel"]
        self.start = state["start"]


def zero_stage(*args) -> int:
    """``ZeroStageEnum(n)`` as the plain int ``n`` (0 to 3)."""
    if len(args) != 1 or type(args[0]) is not int or not 0 <= args[0] <= 3:
        raise Outside("unexpected ZeroStageEnum value")
    return args[0]


GLOBALS: dict[tuple[str, str], object] = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScalerState,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): DynamicLossScalerState,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): zero_stage,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
}

__all__ = ["GLOBALS", "DynamicLossScalerState", "FragmentAddress", "LossScalerState",
           "zero_stage"]
