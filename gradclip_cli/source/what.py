"""What is measured (``--what``): gradients, Adam's moments, the update, or the weights.

A checkpoint rarely holds gradients; what it holds after a divergence is the
optimizer's state. For Adam and AdamW (Kingma & Ba, "Adam: A Method for
Stochastic Optimization", ICLR 2015, Algorithm 1; torch.optim.Adam), with
``t`` each parameter's own ``step``:

* ``exp_avg``:  ``m_hat = m / (1 - beta1 ** t)``, the bias-corrected first
  moment: an exponential average of the gradient;
* ``grad_rms``: ``sqrt(v_hat) = sqrt(v / (1 - beta2 ** t))``: the gradient's
  root mean square over recent steps;
* ``update``:   ``lr * m_hat / (sqrt(v_hat) + eps)``: the step Adam took last,
  without AdamW's decoupled weight decay ``lr * wd * w``;
* ``grads`` and ``weights``: the tensors as stored;
* ``auto``: ``grads`` when the checkpoint holds gradients, else ``exp_avg``.

Bias correction is a scalar per tensor, so ``exp_avg`` is measured on the
stored moment and its norm scaled afterwards, and ``grad_rms`` uses
``||sqrt(v / c)||_p = (||v||_{p/2} / c) ** (1/2)``: in power-sum form the
scale becomes ``sqrt(scale / c)`` and the power sum is unchanged. Neither
copies a tensor. ``update`` is elementwise and is computed a batch of
parameters at a time, so memory stays bounded by a batch.

Optimizer state is keyed by parameter id; names come from ``param_names``
when stored, else from the model's order group by group (``map_names``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradclip_cli.core import Elements, PowerSums, concat, distinct_elements, tensor_power_sums
from gradclip_cli.errors import InputError, UsageError
from gradclip_cli.format.text import visible
from gradclip_cli.source.interface import Contents, OptimizerState, StoredTensor

WHATS = ("auto", "grads", "exp_avg", "grad_rms", "update", "weights")
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
EXPLAIN = {
    "grads": "saved gradients",
    "exp_avg": "Adam first moment exp_avg / (1 - beta1^step), each parameter's own step",
    "grad_rms": "gradient RMS sqrt(exp_avg_sq / (1 - beta2^step))",
    "update": "Adam's last update lr * m_hat / (sqrt(v_hat) + eps), weight decay excluded",
    "weights": "model weights",
}
# What well-known optimizers keep per parameter, to say what a checkpoint holds.
KNOWN_STATE = {
    "momentum_buffer": "SGD momentum",
    "exp_avg_sq_row": "Adafactor factored second moment",
    "exp_avg_sq_col": "Adafactor factored second moment",
    "sum": "Adagrad",
    "square_avg": "RMSprop",
    "acc_delta": "Adadelta",
    "mu_product": "NAdam",
}
_BATCH_BYTES = 64 << 20

# measure(p, device, on_batch, workers, only): power sums of tensors ``only`` (indices
# into ``Selection.tensors``; None: all), in that order.
Measure = Callable[[float, torch.device, Callable | None, int, list[int] | None], PowerSums]


@dataclass
class Selection:
    """The named tensors chosen by ``--what``, in report order, without tie duplicates.

    ``tensors`` are the stored tensors described in the report (for
    ``update``, the ``exp_avg`` each update is computed from);
    ``weights[i]`` is the weight of ``names[i]`` for ``ratio`` (None when
    the checkpoint lacks it or ``what`` is ``weights``).
    """

    what: str
    names: list[str]
    tensors: list[StoredTensor]
    ties: dict[str, list[str]]
    skipped: list[str]
    key: str
    explain: str
    measure: Measure
    weights: list[StoredTensor | None] | None = None
    extra_reads: list[StoredTensor] | None = None  # also read, aligned with ``tensors``
    # The distinct storage elements of ``tensors``, when every one is held and
    # finding the ties already computed them (so loading need not again).
    elements: Elements | None = None

    def read_sizes(self) -> list[int]:
        """Bytes measuring each tensor reads (for progress and for sharing work)."""
        sizes = [t.nbytes for t in self.tensors]
        if self.extra_reads is not None:
            sizes = [a + b.nbytes for a, b in zip(sizes, self.extra_reads)]
        return sizes

    def bytes_to_read(self, only: list[int] | None = None) -> int:
        return sum(_pick(self.read_sizes(), only))


def select(contents: Contents, what: str, *, gradients_only: bool = False) -> Selection:
    """Choose what ``contents`` offers for ``--what``; ``InputError`` says what is available."""
    if what not in WHATS:
        raise UsageError(f"--what must be one of {', '.join(WHATS)}, got {what!r}")
    if gradients_only and what not in ("auto", "grads"):
        raise UsageError(f"clip changes gradients only: --what grads, got {what!r}")
    if what == "auto":
        if contents.gradients or gradients_only or not _has_adam(contents):
            what = "grads"
        else:
            what = "exp_avg"
    if what == "grads":
        return _raw(contents, "grads")
    if what == "weights":
        return _raw(contents, "weights")
    return _from_optimizer(contents, what)


def available(contents: Contents) -> list[str]:
    """The ``--what`` choices this checkpoint can answer."""
    found = []
    if contents.gradients:
        found.append("grads")
    if _has_adam(contents):
        found += ["exp_avg", "grad_rms", "update"]
    if contents.weights:
        found.append("weights")
    return found


def holdings(contents: Contents) -> str:
    """What the optimizer state holds per parameter, named for people."""
    keys: dict[str, None] = {}
    for opt in contents.optimizers:
        for entry in opt.state.values():
            keys.update(dict.fromkeys(k for k, v in entry.items() if isinstance(v, StoredTensor)))
    if not keys:
        return "no optimizer state"
    return "optimizer state " + ", ".join(
        f"{visible(k)} ({KNOWN_STATE[k]})" if k in KNOWN_STATE else visible(k) for k in keys)


def _unavailable(contents: Contents, what: str, why: str) -> InputError:
    offer = available(contents)
    options = ", ".join(f"--what {w}" for w in offer) if offer else "nothing gradclip measures"
    held = holdings(contents)
    held = "" if held in why else f"it holds {held}; "  # said once, not twice
    return InputError(f"{contents.path}: --what {what}: {why}; {held}available: {options}")


def _has_adam(contents: Contents) -> bool:
    opt = contents.optimizer
    return opt is not None and any(all(k in s for k in ADAM_KEYS) for s in opt.state.values())


# ----------------------------------------------------------------- grads, weights


def _raw(contents: Contents, what: str) -> Selection:
    source = contents.gradients if what == "grads" else contents.weights
    if not source:
        if what == "grads" and contents.gradient_error and not contents.optimizers \
                and not contents.weights:
            raise InputError(contents.gradient_error)
        why = "the checkpoint holds no gradients" if what == "grads" else \
            "the checkpoint holds no model weights"
        if what == "grads" and contents.gradient_error:
            why = contents.gradient_error.removeprefix(f"{contents.path}: ")
        raise _unavailable(contents, what, why)
    names, tensors, ties, elements = _untied(source)
    weights = None
    if what == "grads" and contents.weights and contents.weights is not contents.gradients:
        weights = [contents.weights.get(n) for n in names]
    return Selection(
        what=what, names=names, tensors=tensors, ties=ties,
        skipped=list(contents.skipped) if what == "grads" else [],
        key=contents.gradient_key if what == "grads" else "", explain=EXPLAIN[what],
        measure=lambda p, dev, on_batch, workers, only=None: stored_power_sums(
            _pick(tensors, only), p, dev, on_batch, workers),
        weights=weights, elements=elements,
    )


def _pick(items: list, only: list[int] | None) -> list:
    return items if only is None else [items[i] for i in only]


def _untied(source: dict[str, StoredTensor]):
    """Names and stored tensors without tie duplicates, the ties, and the distinct
    elements of what is kept when all of it is held and nothing was dropped."""
    names = list(source)
    stored = list(source.values())
    held = [s.held for s in stored]
    ties: dict[str, list[str]] = {}
    keep = list(range(len(names)))
    candidates = [i for i, h in enumerate(held) if h is not None]
    elements = None
    if candidates:
        elements = distinct_elements([held[i] for i in candidates])
        dropped = set()
        for k, o in enumerate(elements.tie_of):
            if o != k:
                ties.setdefault(names[candidates[o]], []).append(names[candidates[k]])
                dropped.add(candidates[k])
        keep = [i for i in keep if i not in dropped]
        if dropped or len(candidates) < len(names):
            elements = None  # they describe other tensors than those kept
    return [names[i] for i in keep], [stored[i] for i in keep], ties, elements


# A stored tensor may carry requires_grad (torch.save keeps the flag); measuring
# is never differentiated, and out= kernels refuse such inputs under grad mode.
@torch.no_grad()
def stored_power_sums(
    tensors: Sequence[StoredTensor], p: float, device: torch.device | None = None,
    on_batch: Callable | None = None, workers: int = 1,
) -> PowerSums:
    """Per-tensor power sums of stored tensors, reading pieces a batch at a time.

    Tensors held in one piece (mapped) go to the core as they are; pieces
    read on demand are read about ``_BATCH_BYTES`` at a time, measured, and
    dropped, then combined into their tensors (``PowerSums.reduce``).
    """
    held = [s.held for s in tensors]
    if all(h is not None for h in held):
        return tensor_power_sums(held, p, device=device, on_batch=on_batch, workers=workers)
    parts: list[PowerSums] = []
    owners: list[int] = []
    batch: list = []
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if batch:
            read = [piece.read() for _, piece in batch]
            parts.append(tensor_power_sums(read, p, device=device, workers=workers))
            owners.extend(i for i, _ in batch)
            if on_batch is not None:
                on_batch(read)
        batch, size = [], 0

    for i, s in enumerate(tensors):
        for piece in s.pieces:
            batch.append((i, piece))
            size += piece.numel * s.dtype.itemsize
            if size >= _BATCH_BYTES:
                flush()
    flush()
    return concat(p, parts).reduce(torch.tensor(owners, dtype=torch.int64), len(tensors))


# ----------------------------------------------------------------- optimizer state


@dataclass
class _Param:
    name: str
    state: dict
    group: dict


def _from_optimizer(contents: Contents, what: str) -> Selection:
    opt = contents.optimizer
    if opt is None:
        raise _unavailable(contents, what, "the checkpoint holds no optimizer state")
    if not _has_adam(contents):
        raise _unavailable(contents, what, "it needs Adam's exp_avg and exp_avg_sq")
    names = map_names(contents, opt)
    group_of = {pid: group for group in opt.param_groups for pid in group["params"]}
    params = []
    for pid, name in names.items():
        entry = opt.state.get(pid)
        if entry is None:
            continue  # never stepped (no gradient yet): nothing to measure
        if not all(k in entry for k in ADAM_KEYS):
            raise InputError(f"{opt.file}: parameter {visible(name)} has no exp_avg/exp_avg_sq "
                             "while others do")
        params.append(_Param(name, entry, group_of[pid]))
    order = _report_order(contents, [p.name for p in params])
    params.sort(key=lambda p: order.get(p.name, len(order)))
    corrections = [_corrections(p, opt) for p in params]
    moments = [p.state["exp_avg"] for p in params]
    squares = [p.state["exp_avg_sq"] for p in params]
    for p, m, v in zip(params, moments, squares):
        if m.shape != v.shape:
            raise InputError(f"{opt.file}: parameter {visible(p.name)}: exp_avg {list(m.shape)} "
                             f"and exp_avg_sq {list(v.shape)} differ in shape")
        weight = contents.weights.get(p.name) if contents.weights else None
        if weight is not None and weight.shape != m.shape:
            raise InputError(f"{opt.file}: parameter {visible(p.name)}: exp_avg "
                             f"{list(m.shape)} does not fit the weight's shape "
                             f"{list(weight.shape)}")

    if what == "exp_avg":
        def measure(p, dev, on_batch, workers, only=None):
            sums = stored_power_sums(_pick(moments, only), p, dev, on_batch, workers)
            factor = torch.tensor([1.0 / c1 for c1, _ in _pick(corrections, only)],
                                  dtype=torch.float64)
            return _scaled(sums, factor)
        described = moments
    elif what == "grad_rms":
        def measure(p, dev, on_batch, workers, only=None):
            half = p / 2 if math.isfinite(p) else p
            sums = stored_power_sums(_pick(squares, only), half, dev, on_batch, workers)
            c2 = torch.tensor([c for _, c in _pick(corrections, only)], dtype=torch.float64)
            return _square_rooted(sums, c2, p)
        described = squares
    else:
        hyper = [_update_hyper(p, opt) for p in params]

        def measure(p, dev, on_batch, workers, only=None):
            return _update_power_sums(_pick(moments, only), _pick(squares, only),
                                      _pick(corrections, only), _pick(hyper, only), p, dev,
                                      on_batch, workers)
        described = moments
    weights = None
    if contents.weights:
        weights = [contents.weights.get(p.name, contents.fused_weights.get(p.name)) for p in params]
    return Selection(
        what=what, names=[p.name for p in params], tensors=described, ties={}, skipped=[],
        key="", explain=EXPLAIN[what], measure=measure, weights=weights,
        extra_reads=squares if what == "update" else None,
    )


def _report_order(contents: Contents, names: list[str]) -> dict[str, int]:
    if contents.model_order_names:
        return {n: i for i, n in enumerate(contents.model_order_names)}
    if contents.weights and contents.model_order:
        return {n: i for i, n in enumerate(contents.weights)}
    return {n: i for i, n in enumerate(names)}


def _number(value, what: str, p: _Param, opt: OptimizerState) -> float:
    if isinstance(value, StoredTensor):
        value = value.read()
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise InputError(f"{opt.file}: parameter {visible(p.name)}: {what} is a tensor of "
                             f"{value.numel()} values, not a number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{opt.file}: parameter {visible(p.name)}: {what} is "
                         f"{visible(repr(value))}, not a finite number")
    return float(value)


def _betas(p: _Param, opt: OptimizerState) -> tuple[float, float]:
    betas = p.group.get("betas")
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise InputError(f"{opt.file}: the param group of {visible(p.name)} has no betas "
                         "(beta1, beta2); is this Adam's state?")
    return _number(betas[0], "beta1", p, opt), _number(betas[1], "beta2", p, opt)


def _corrections(p: _Param, opt: OptimizerState) -> tuple[float, float]:
    """``(1 - beta1^t, 1 - beta2^t)`` with the parameter's own step ``t``."""
    step = _number(p.state.get("step"), "step", p, opt)
    if step < 1:
        raise InputError(f"{opt.file}: parameter {visible(p.name)}: step {step:g}: the moments "
                         "are not an average of anything yet")
    beta1, beta2 = _betas(p, opt)
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise InputError(f"{opt.file}: the param group of {visible(p.name)} has betas "
                         f"({beta1}, {beta2}) outside [0, 1)")
    # -expm1(t * log(beta)) is 1 - beta^t without cancellation when beta^t is near 1.
    return (_one_minus_power(beta1, step), _one_minus_power(beta2, step))


def _one_minus_power(beta: float, step: float) -> float:
    return 1.0 if beta == 0 else -math.expm1(step * math.log(beta))


def _update_hyper(p: _Param, opt: OptimizerState) -> tuple[float, float]:
    lr = _number(p.group.get("lr"), "lr", p, opt)
    eps = _number(p.group.get("eps"), "eps", p, opt)
    return lr, eps


def _scaled(sums: PowerSums, factor: torch.Tensor) -> PowerSums:
    """Summaries of ``factor[i] * x_i``: scale and max move, the power sum does not."""
    return PowerSums(sums.norm_type, sums.scale * factor, sums.power_sum,
                     sums.max_abs * factor, sums.nan, sums.posinf, sums.neginf)


def _square_rooted(sums: PowerSums, divisor: torch.Tensor, p: float) -> PowerSums:
    """From summaries of ``v`` at p/2 to those of ``sqrt(|v| / c)`` at p.

    ``(sqrt(v / c) / sqrt(s / c)) ** p == (v / s) ** (p / 2)``: the power sum
    carries over, the scale becomes ``sqrt(s / c)``.
    """
    return PowerSums(p, torch.sqrt(sums.scale / divisor), sums.power_sum,
                     torch.sqrt(sums.max_abs.abs() / divisor), sums.nan, sums.posinf,
                     sums.neginf)


@torch.no_grad()
def _update_power_sums(moments, squares, corrections, hyper, p, device, on_batch, workers):
    """Power sums of ``lr * m_hat / (sqrt(v_hat) + eps)``, a batch of parameters at a time."""
    parts = []
    batch: list[int] = []
    size = 0

    def flush():
        nonlocal batch, size
        if not batch:
            return
        updates = []
        for i in batch:
            m, v = moments[i].read(), squares[i].read()
            (c1, c2), (lr, eps) = corrections[i], hyper[i]
            dtype = torch.promote_types(torch.promote_types(m.dtype, v.dtype), torch.float32)
            denom = (v.to(dtype) / c2).sqrt_().add_(eps)
            updates.append(m.to(dtype).mul(lr / c1).div_(denom))
        parts.append(tensor_power_sums(updates, p, device=device, workers=workers))
        if on_batch is not None:
            # The pieces as stored (mapped views), not read()'s assembled copy of a
            # tensor stored in several pieces: their pages are the ones to give back.
            on_batch([piece.read() for t in (moments, squares) for i in batch
                      for piece in t[i].pieces])
        batch, size = [], 0

    for i, m in enumerate(moments):
        batch.append(i)
        size += m.nbytes
        if size >= _BATCH_BYTES:
            flush()
    flush()
    return concat(p, parts)


# ----------------------------------------------------------------- ids to names


def map_names(contents: Contents, opt: OptimizerState) -> dict[int, str]:
    """Parameter id -> model name, in optimizer id order.

    ``param_names`` when the optimizer stored them. Otherwise each param group
    lists its parameters in model order, but the groups may split that order
    (the HF Trainer's decay and no-decay groups), so the mapping is the one
    interleaving of the groups that matches every state tensor's shape
    (``interleave``). None or several: ``InputError`` with the reason.
    """
    if opt.param_names is not None:
        return dict(sorted(opt.param_names.items()))
    order = _model_order(contents, opt)
    shapes = {n: tuple(contents.weights[n].shape) if contents.weights and n in contents.weights
              else None for n in order}
    groups = [[(pid, _state_shape(opt.state.get(pid))) for pid in g["params"]]
              for g in opt.param_groups]
    placed = interleave([shapes[n] for n in order], [[s for _, s in g] for g in groups])
    if placed is None:
        sizes = ", ".join(str(len(g)) for g in groups)
        raise InputError(
            f"{opt.file}: cannot map optimizer state to parameter names: no order of the "
            f"{len(order)} model parameters fits the param groups (sizes {sizes}) by shape, "
            "and the optimizer stored no param_names")
    if placed == "ambiguous":
        raise InputError(
            f"{opt.file}: cannot map optimizer state to parameter names: the param groups fit "
            "the model's parameter order in more than one way (parameters of equal shape), and "
            "the optimizer stored no param_names")
    names = {}
    for model_index, spot in enumerate(placed):
        if spot is not None:
            g, j = spot
            names[groups[g][j][0]] = order[model_index]
    return dict(sorted(names.items()))


def _model_order(contents: Contents, opt: OptimizerState) -> list[str]:
    if contents.model_order_names:
        return list(contents.model_order_names)
    if contents.weights and contents.model_order:
        names, _, _, _ = _untied(contents.weights)
        return names
    where = "its weights are stored sorted by name" if contents.weights else \
        "it holds no model weights"
    raise InputError(
        f"{opt.file}: cannot map optimizer state to parameter names: the optimizer stored no "
        f"param_names and the model's parameter order is unknown ({where})")


def _state_shape(entry: dict | None) -> tuple[int, ...] | None:
    if not entry:
        return None
    for key in ("exp_avg", "momentum_buffer", *entry):
        value = entry.get(key)
        if isinstance(value, StoredTensor):
            return tuple(value.shape)
    return None


def interleave(model: list, groups: list[list]):
    """Place each group's items, in order, onto the model's sequence by matching shape.

    Returns, per model position, ``(group, index)`` or None (a model
    parameter no group holds: frozen); None when no placement exists;
    ``"ambiguous"`` when several do. A shape of None (no state stored) fits
    anything. Dynamic programming over the groups' positions, counting
    placements up to two.
    """
    total = sum(len(g) for g in groups)
    spare = len(model) - total  # model parameters no group holds
    if spare < 0:
        return None
    start = (0,) * len(groups)
    # layer i: {positions: (count, back)} where back = (previous positions, choice)
    layer: dict[tuple[int, ...], tuple[int, tuple | None]] = {start: (1, None)}
    history = [layer]
    for i, shape in enumerate(model):
        nxt: dict[tuple[int, ...], tuple[int, tuple | None]] = {}
        for pos, (count, _) in layer.items():
            skipped = i - sum(pos)
            if skipped < spare:
                _arrive(nxt, pos, count, (pos, None))
            for g, group in enumerate(groups):
                j = pos[g]
                if j < len(group) and _fits(shape, group[j]):
                    _arrive(nxt, pos[:g] + (j + 1,) + pos[g + 1:], count, (pos, (g, j)))
        layer = nxt
        history.append(layer)
        if not layer:
            return None
    end = tuple(len(g) for g in groups)
    if end not in layer:
        return None
    if layer[end][0] > 1:
        return "ambiguous"
    placed: list = []
    state = end
    for i in range(len(model), 0, -1):
        prev, choice = history[i][state][1]
        placed.append(choice)
        state = prev
    placed.reverse()
    return placed


def _arrive(layer: dict, state: tuple, count: int, back: tuple) -> None:
    """Count the ways into ``state`` (capped at 2); keep the first way's back pointer."""
    old = layer.get(state)
    layer[state] = (min(count, 2), back) if old is None else (min(old[0] + count, 2), old[1])


def _fits(a, b) -> bool:
    return a is None or b is None or tuple(a) == tuple(b)
