"""The Megatron objects a checkpoint's ``common.pt`` pickles, as inert stand-ins.

Megatron-LM's ``save_checkpoint`` puts its command line, an
``argparse.Namespace``, in every checkpoint (``args``), beside the iteration
and the optimizer's hyperparameters. A ``Namespace`` pickles as the object
(NEWOBJ, then BUILD with its ``__dict__``); ``GLOBALS`` maps it to
``NamespaceState``, which keeps the attributes as the restricted unpickler
built them (plain values, tensors, dtypes), so reading never constructs a
``Namespace`` and nothing from the file is called. Read a file inside
``weights_pickle.allowing(GLOBALS)``; any other global is refused as before.
"""

from __future__ import annotations

from gradclip_cli.source.files.weights_pickle import Opaque, Outside


class NamespaceState(Opaque):
    """An ``argparse.Namespace``'s attributes, by name."""

    __slots__ = ("state",)

    def __new__(cls, *args):
        if args:
            raise Outside("unexpected argparse.Namespace arguments")
        self = super().__new__(cls)
        self.state = {}
        return self

    def __setstate__(self, state):
        if type(state) is not dict or any(type(k) is not str for k in state):
            raise Outside("argparse.Namespace state is not a dict of names")
        self.state = dict(state)


GLOBALS: dict[tuple[str, str], object] = {
    ("argparse", "Namespace"): NamespaceState,
}

__all__ = ["GLOBALS", "NamespaceState"]
