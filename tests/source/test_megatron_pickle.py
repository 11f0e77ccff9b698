"""The stand-ins for what Megatron-LM's legacy ``model_optim_rng.pt`` pickles beside its
tensors: ``argparse.Namespace`` (with ``signal.Signals`` in it) and numpy's RNG state, read
without constructing either, and refused when their arguments are not what those objects
pickle. The files are written by ``torch.save`` of the real objects (numpy's own state, a
real ``Namespace``); the layout itself is tested on Megatron-LM's own files
(``tests/frameworks/test_megatron_legacy.py``)."""

from __future__ import annotations

import argparse
import signal

import numpy as np
import pytest
import torch

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint
from gradclip_cli.source.files.megatron_pickle import GLOBALS, NamespaceState, NumpyArray
from gradclip_cli.source.files.weights_pickle import allowing


def _load(path, **kwargs):
    with allowing(GLOBALS):
        return load_checkpoint(path, trust_pickle=False, verify=False, **kwargs).root


def test_namespace_and_numpy_rng_state_read_as_data(tmp_path):
    path = tmp_path / "model_optim_rng.pt"
    args = argparse.Namespace(hidden_size=16, exit_signal=signal.SIGTERM, lr=1e-2)
    rng = np.random.RandomState(0).get_state()
    torch.save(
        {"iteration": 3, "args": args, "rng_state": [{"np_rng_state": rng}], "w": torch.ones(2)},
        path,
    )
    root = _load(path)
    assert root["iteration"] == 3 and torch.equal(root["w"], torch.ones(2))
    assert isinstance(root["args"], NamespaceState)
    state = root["args"].state
    assert (state["hidden_size"], state["lr"]) == (16, 1e-2)
    assert (state["exit_signal"].enum, state["exit_signal"].value) == ("Signals", 15)
    name, array, *rest = root["rng_state"][0]["np_rng_state"]
    assert name == "MT19937" and isinstance(array, NumpyArray) and array.shape == (624,)
    assert tuple(rest) == tuple(rng[2:])
    with pytest.raises(InputError, match="--trust-pickle"):  # outside the stand-ins' block
        load_checkpoint(path, trust_pickle=False, verify=False)


class _Reduces:
    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return (self.call, self.args)


@pytest.mark.parametrize(
    "value",
    [
        _Reduces(np.dtype, ("u4", 1, 2)),  # numpy pickles (code, align, copy) as two bools
        _Reduces(signal.Signals, ([15],)),  # an enum's value: an int or a string
        _Reduces(argparse.Namespace, (1,)),  # a Namespace pickles with no arguments
    ],
    ids=["dtype", "signal", "namespace"],
)
def test_unexpected_arguments_are_refused(tmp_path, value):
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": value}, path)
    with pytest.raises(InputError) as refused:
        _load(path)
    assert str(refused.value).startswith(str(path)) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "call",
    [("ā", "latin1"), ("text", "utf-8"), ("text", "rot13")],
    ids=["not-latin-1", "utf-8", "another-codec"],
)
def test_a_refused_encode_in_args_names_encode_not_the_namespace(tmp_path, call):
    # Protocol 2 pickles bytes as _codecs.encode(text, 'latin1'); anything else reaching
    # it is refused, and the message names the global that was refused: argparse.Namespace,
    # around it, is an allowed stand-in (torch's own reader stops there first).
    import codecs

    path = tmp_path / "model_optim_rng.pt"
    args = argparse.Namespace(hidden_size=16, data=_Reduces(codecs.encode, call))
    torch.save({"iteration": 1, "args": args, "w": torch.ones(2)}, path)
    with pytest.raises(InputError) as refused:
        _load(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: refused: loading needs full unpickling")
    assert "(it references _codecs.encode with what its inert stand-in does not take)" in message
    assert "argparse.Namespace" not in message and "\n" not in message


def test_a_refused_numpy_dtype_in_args_is_named(tmp_path):
    path = tmp_path / "model_optim_rng.pt"
    args = argparse.Namespace(dtype=_Reduces(np.dtype, ("u4", 1, 2)))
    torch.save({"iteration": 1, "args": args}, path)
    with pytest.raises(InputError, match=r"\(it references numpy\.dtype with what its inert"):
        _load(path)
