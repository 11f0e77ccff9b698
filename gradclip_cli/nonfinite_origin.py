"""Where a non-finite value began: ``GradMonitor(..., locate_nonfinite=True)``.

Two places, because they answer different failures (issue 42, item 4):

* A NaN made in the forward pass reaches the loss, and then every gradient
  downstream of it is NaN: the first non-finite gradient in backward order is
  always the last layer's. What locates it is the first module, in forward
  order, whose output held a non-finite value. A forward hook on every module
  keeps, in a flag of its own on the output's device, the earliest call of
  the step whose output was not all finite: no host read, one ``aminmax``
  pass over each output. The call, not the module's first finish, places it:
  a module called twice (one dropout applied at several places) receives in
  its second call the NaN a module between the calls made.
  The flags are read only on a step whose gradients are non-finite.
  (OLMo-core's ``NaNCheckerCallback`` does this half with a host check per
  module; pytorch#160016 and #143658 ask for it.)
* A NaN made in the backward pass (a gradient that overflows, the derivative
  of ``sqrt`` at 0) leaves the forward clean. The first parameter, in the
  order autograd accumulated the gradients, whose gradient is non-finite
  locates it. Post-accumulate-grad hooks record that order (see below for
  how long they stay on).

"Forward order" is the order in which modules' calls finished in this step:
a module's hook runs when its ``forward`` returns, so a leaf that makes a NaN
finishes before the container around it, and before every module that
receives the NaN. It is this step's order, not the first step's: a layer a
step may skip (LayerDrop, an expert no token was routed to) first finishes
steps after the modules it feeds. Forwards run without gradients
(evaluation under ``torch.no_grad``) are not looked at: they give no
gradients. Modules and parameters registered on the model after the
locator was made are watched from their registration on (torch's global
registration hooks, held weakly). Likewise the accumulation order is that of the latest step
recorded: the hooks stay on until every parameter has had a gradient, so
that one first given a gradient on a later step takes its place among the
others (a parameter that never gets one keeps them on, at a Python call per
parameter and backward).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping

import torch

__all__ = ["NonfiniteLocator"]

# A module's flag while none of its outputs in the step held a non-finite value.
CLEAN = 2**62


class NonfiniteLocator:
    """Forward flags and the gradients' accumulation order, for one model.

    ``origin(params, names)`` answers on a step known to hold a non-finite
    gradient; ``step_taken()`` says a step is over. ``remove()`` takes the
    hooks off.
    """

    def __init__(self, model: torch.nn.Module):
        self._names: dict[int, str] = {}  # id(module) -> its name in the model
        self._slot: dict[int, int] = {}  # id(module) -> its place in forward order
        self._order: list[str] = []  # module names by slot (first forward ever)
        self._calls = 0  # module calls finished in this step's forwards
        # Per device: a flag per slot (the step's first call whose output was not all
        # finite, or CLEAN), and the 0-dim views the hooks lower.
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._views: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._accumulated: list[weakref.ref] = []  # parameters, in accumulation order
        self._this_step: list[weakref.ref] = []  # those accumulated since the last step
        self._seen: set[int] = set()  # accumulated in this step
        self._ever: set[int] = set()  # accumulated in some step
        self._handles = []
        self._grad_handles = []
        self._stale = False
        self._regrown = False  # a parameter was added: hook every one again at the next forward
        self._last = None  # (weak reference, version) of the output checked last
        modules = list(model.named_modules(remove_duplicate=True))
        self._capacity = len(modules)
        self._model = weakref.ref(model)
        self._paths: dict[int, str] = {}  # id(module) -> its dotted path ("" for the model)
        # Run eagerly under torch.compile (a graph break per hooked module): traced, the
        # flags' views mutated in place stop aot_autograd ("non-differentiable view
        # input mutations"), and the call count would be a constant of the graph.
        self._hook = torch.compiler.disable(self._forward_hook)
        for name, module in modules:
            self._watch(name, module)
        self._hook_gradients()
        # A module or parameter set on a watched module later (a layer grown, an
        # adapter put in place of a layer) is watched from then on, before its first
        # forward: else a NaN it makes would be placed in the first watched module it
        # reaches. torch calls these hooks on every registration, in any model (only
        # then, never in a forward); they hold this locator weakly.
        me = weakref.ref(self)

        def on_module(parent, name, module):
            locator = me()
            if locator is not None:
                locator._registered(parent, name, module)

        def on_parameter(parent, name, param):
            locator = me()
            if locator is not None and id(parent) in locator._paths and param is not None:
                locator._regrown = True

        self._global_handles = [
            torch.nn.modules.module.register_module_module_registration_hook(on_module),
            torch.nn.modules.module.register_module_parameter_registration_hook(on_parameter),
        ]
        weakref.finalize(self, _remove_all, list(self._global_handles))

    # -- hooks ---------------------------------------------------------------

    def _watch(self, path: str, module: torch.nn.Module) -> None:
        if id(module) in self._paths:
            return
        self._paths[id(module)] = path
        self._names[id(module)] = path or type(module).__name__
        self._handles.append(module.register_forward_hook(self._hook))

    def _registered(self, parent, name: str, module) -> None:
        """A module set on ``parent`` (torch's registration hook): watched, with
        its submodules and parameters, where ``parent`` is a watched module."""
        path = self._paths.get(id(parent))
        if path is None or not isinstance(module, torch.nn.Module):
            return
        prefix = f"{path}.{name}" if path else name
        for sub, child in module.named_modules(prefix=prefix, remove_duplicate=True):
            self._watch(sub, child)
        if any(p.requires_grad for p in module.parameters()):
            self._regrown = True

    def _hook_gradients(self) -> None:
        """Record the accumulation order of every parameter of the model that
        requires a gradient, anew: on a parameter first watched now, the next
        backward places it among all the others (hooks on it alone would put it
        first). Called when the locator is made and at the first forward after
        a parameter was added (torch's registration hooks run before the model
        holds it)."""
        self._regrown = False
        model = self._model()
        if model is None:
            return
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles = [
            param.register_post_accumulate_grad_hook(self._accumulated_hook)
            for param in model.parameters() if param.requires_grad]
        self._ever = set()

    def _forward_hook(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        if self._regrown:
            self._hook_gradients()
        if self._stale:
            self._stale = False
            self._calls = 0
            for flags in self._flags.values():
                flags.fill_(CLEAN)
        key = id(module)
        slot = self._slot.get(key)
        if slot is None:
            slot = self._slot[key] = len(self._order)
            self._order.append(self._names.get(key, type(module).__name__))
        call = self._calls
        self._calls += 1
        for t in _tensors(output):
            if not t.numel() or not (t.is_floating_point() or t.is_complex()):
                continue
            if self._checked(t):
                continue  # a container returning its last child's output: seen already
            with torch.no_grad():
                # The first call whose output was not all finite, kept on the device,
                # no read (the flag starts CLEAN; the next step's first forward resets it).
                view = self._view(slot, t.device)
                torch.minimum(view, torch.where(_all_finite(t.detach()), CLEAN, call), out=view)

    def _checked(self, t: torch.Tensor) -> bool:
        """Whether ``t`` itself, unchanged, was the output checked last (then the
        module returning it again is no earlier in forward order, and it is
        skipped: the logits of a language model pass through two modules)."""
        last = self._last
        self._last = (weakref.ref(t), t._version)
        return last is not None and last[0]() is t and last[1] == t._version

    def _view(self, slot: int, device: torch.device) -> torch.Tensor:
        view = self._views.get((slot, device))
        if view is None:
            flags = self._flags.get(device)
            if flags is None:
                flags = self._flags[device] = torch.full((self._capacity,), CLEAN,
                                                         dtype=torch.int64, device=device)
            if slot >= flags.numel():  # a module added to the model after the monitor
                grown = torch.full((2 * slot + 1,), CLEAN, dtype=torch.int64, device=device)
                grown[: flags.numel()] = flags
                flags = self._flags[device] = grown
                self._views = {k: v for k, v in self._views.items() if k[1] != device}
            view = self._views[(slot, device)] = flags[slot]
        return view

    def _accumulated_hook(self, param: torch.Tensor) -> None:
        if id(param) not in self._seen:
            self._seen.add(id(param))
            self._ever.add(id(param))
            self._this_step.append(weakref.ref(param))

    # -- per step --------------------------------------------------------------

    def step_taken(self) -> None:
        """The monitor was called for a step: the next forward starts the next step's
        flags (reset then, on the device, so this call costs nothing); the step's
        accumulation order goes first in the order, ahead of parameters it did not
        reach, and once every parameter has been seen the hooks come off: backward
        runs as without them."""
        self._stale = True
        if self._this_step:
            ids = self._seen
            self._accumulated = self._this_step + [
                r for r in self._accumulated if id(r()) not in ids]
            self._this_step, self._seen = [], set()
        if self._grad_handles and len(self._ever) >= len(self._grad_handles):
            for handle in self._grad_handles:
                handle.remove()
            self._grad_handles = []

    def origin(self, params: Iterable[torch.Tensor], names: Mapping[int, str]) -> dict:
        """``{"forward": module or None, "backward": parameter or None}`` for this step.

        ``params`` are the model's parameters in ``named_parameters`` order and
        ``names`` maps ``id(param)`` to its name. Reads the flags and one
        number per gradient: called only on a step already known to be
        non-finite.
        """
        return {"forward": self._first_forward(), "backward": self._first_backward(params, names)}

    def _first_forward(self) -> str | None:
        if not self._flags:
            return None
        hits = []
        for flags in self._flags.values():
            calls = flags.tolist()  # the one read per device
            hits += [(call, slot) for slot, call in enumerate(calls) if call != CLEAN]
        if not hits:
            return None
        # Slots number modules by their first forward ever; this step's calls decide.
        return self._order[min(hits)[1]]

    def _first_backward(self, params: Iterable[torch.Tensor], names: Mapping[int, str]):
        params = list(params)
        recorded = [p for p in (r() for r in self._accumulated) if p is not None]
        known = {id(p) for p in recorded}
        # Parameters never seen accumulating (no gradient on the first step) come last,
        # in the model's order.
        ordered = recorded + [p for p in params if id(p) not in known]
        ordered = [p for p in ordered if p.grad is not None and id(p) in names]
        if not ordered:
            return None
        grads = [_local(p.grad) for p in ordered]
        first = grads[0].device
        bad = torch.stack([_holds_nonfinite(g).to(first) for g in grads])
        hit = bad.nonzero().flatten().tolist()  # one read
        return names[id(ordered[hit[0]])] if hit else None

    def remove(self) -> None:
        for handle in [*self._handles, *self._grad_handles, *self._global_handles]:
            handle.remove()
        self._handles, self._grad_handles, self._global_handles = [], [], []


def _remove_all(handles) -> None:
    for handle in handles:
        handle.remove()


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a 0-dim bool tensor on its device.

    ``aminmax`` reads the tensor once without writing anything (NaN propagates
    into both, an infinity shows as the min or the max): on 4M float32 values
    on one CPU thread 0.9 ms, against 10.4 ms for ``isfinite(t).all()``, which
    writes a bool per element first. Complex values have no order.
    """
    if t.is_complex():
        return torch.isfinite(t).all()
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _holds_nonfinite(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided:
        t = t.coalesce().values() if t.layout == torch.sparse_coo else t.to_dense()
    if not t.numel():
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return ~torch.isfinite(t).all()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (each rank names the first it sees), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensors(output) -> list[torch.Tensor]:
    """The tensors of a module's output: a tensor, or those in tuples, lists and dicts
    (a Hugging Face ``ModelOutput`` is a dict), one level of nesting deep at most twice."""
    if isinstance(output, torch.Tensor):
        return [output]
    found: list[torch.Tensor] = []
    stack = [(output, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif depth < 3 and isinstance(value, (tuple, list)):
            stack.extend((v, depth + 1) for v in value)
        elif depth < 3 and isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
    return found
