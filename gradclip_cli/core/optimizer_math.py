"""What an optimizer's saved state says about the gradient and the last step.

Small pure functions, one rule each, written from each optimizer's own
update rule (torch.optim's ``_single_tensor_*`` functions, transformers'
``Adafactor.step``). ``t`` is the parameter's own step count after its last
update, as the state stores it. Elementwise results are computed in the
state's dtype promoted to float32 at least (float64 state stays float64);
square roots are taken before dividing, so a large second moment never
overflows.

Three quantities (the contract's ``--what``):

* the first moment ``exp_avg``: the gradient's exponential average,
  debiased, ``m / (1 - beta^t)``, where a state holds ``m`` updated as
  ``m <- beta * m + (1 - beta) * g`` (Adam and every optimizer that keeps
  Adam's ``exp_avg``: its weights on past gradients sum to one);
* the gradient's RMS ``grad_rms``: the square root of the debiased second
  moment (or the optimizer's own second-moment estimate, for Adafactor's
  factored one);
* the last ``update``: the step the optimizer took, where the state alone
  determines it (not where it needs the last gradient itself), without
  decoupled weight decay ``lr * wd * w``.

A negative second moment is corrupt state: its square root is NaN, so every
quantity that reads it reports a non-finite finding (never ``|v|``).
"""

from __future__ import annotations

import math

import torch


def one_minus_power(beta: float, step: float) -> float:
    """``1 - beta ** step``, without cancellation when ``beta ** step`` is near 1."""
    return 1.0 if beta == 0 else -math.expm1(step * math.log(beta))


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def debiased_rms(second: torch.Tensor, beta: float, step: float) -> torch.Tensor:
    """``sqrt(v / (1 - beta^t))``: the gradient's RMS from an exponential second moment.

    References:
        Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015,
        Algorithm 1 (``v_hat``); torch.optim.Adam, NAdam, RAdam.
    """
    return _wide(second).sqrt().div_(math.sqrt(one_minus_power(beta, step)))


def adam_update(exp_avg: torch.Tensor, second: torch.Tensor, *, lr: float, beta1: float,
                beta2: float, eps: float, step: float, debias: bool = True) -> torch.Tensor:
    """``lr * m_hat / (sqrt(v_hat) + eps)``: Adam's and AdamW's step (AdamW's decay aside).

    ``second`` is ``exp_avg_sq``, or ``max_exp_avg_sq`` under AMSGrad (torch
    keeps the running maximum and divides by it). ``debias=False`` is the
    step without bias correction, ``lr * m / (sqrt(v) + eps)`` (DeepSpeed's
    and apex's Adam with ``bias_correction=False``).

    References:
        Kingma & Ba 2015, Algorithm 1; Reddi et al., "On the Convergence of
        Adam and Beyond", ICLR 2018 (AMSGrad); torch.optim.Adam.
    """
    m = _wide(exp_avg)
    # m_hat / (sqrt(v_hat) + eps) = m * sqrt(b2') / ((1 - b1^t) (sqrt(v) + eps sqrt(b2'))),
    # b2' = 1 - b2^t: one division an element instead of two (0.75x the time), and
    # one rounding fewer. The factor (below 1 where lr is) comes first, so m times it
    # cannot overflow where the update itself does not.
    root = math.sqrt(one_minus_power(beta2, step)) if debias else 1.0
    first = one_minus_power(beta1, step) if debias else 1.0
    denom = second.to(m.dtype).sqrt().add_(eps * root)
    return m.mul(lr * root / first).div_(denom)


def radam_rectification(beta2: float, step: float) -> float | None:
    """RAdam's variance rectification ``r_t``, or None while ``rho_t <= 5`` (no adaptive step).

    References:
        Liu et al., "On the Variance of the Adaptive Learning Rate and
        Beyond", ICLR 2020, Algorithm 2; torch.optim.RAdam.
    """
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2**step / one_minus_power(beta2, step)
    if rho_t <= 5.0:
        return None
    return math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                     / ((rho_inf - 4) * (rho_inf - 2) * rho_t))


def radam_update(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, lr: float, beta1: float,
                 beta2: float, eps: float, step: float) -> torch.Tensor:
    """RAdam's step: ``lr * m_hat * r_t * sqrt(1 - beta2^t) / (sqrt(v) + eps)`` once
    rectified, else ``lr * m_hat`` (note: eps is added to ``sqrt(v)``, not ``sqrt(v_hat)``).

    References: Liu et al. 2020, Algorithm 2; torch.optim.RAdam.
    """
    m_hat = _wide(exp_avg).mul(lr / one_minus_power(beta1, step))
    rect = radam_rectification(beta2, step)
    if rect is None:
        return m_hat  # the early steps are SGD with momentum: v is not read
    adaptive = _wide(exp_avg_sq).to(m_hat.dtype).sqrt().add_(eps)
    return m_hat.mul_(rect * math.sqrt(one_minus_power(beta2, step))).div_(adaptive)


def adamax_update(exp_avg: torch.Tensor, exp_inf: torch.Tensor, *, lr: float, beta1: float,
                  step: float) -> torch.Tensor:
    """Adamax's step ``lr / (1 - beta1^t) * m / u``, ``u`` the weighted infinity norm.

    References: Kingma & Ba 2015, Algorithm 2 (AdaMax); torch.optim.Adamax.
    """
    m = _wide(exp_avg)
    return m.mul(lr / one_minus_power(beta1, step)).div_(exp_inf.to(m.dtype))


def momentum_update(momentum_buffer: torch.Tensor, *, lr: float) -> torch.Tensor:
    """``lr * buf``: SGD's step with (non-Nesterov) momentum, and RMSprop's with momentum.

    References: torch.optim.SGD (``param -= lr * buf``), torch.optim.RMSprop.
    """
    return _wide(momentum_buffer).mul(lr)


def rprop_update(prev: torch.Tensor, step_size: torch.Tensor) -> torch.Tensor:
    """``sign(prev) * step_size``: Rprop's last step.

    torch's Rprop adapts each element's step size, moves the element by
    ``sign(grad) * step_size`` with the gradient zeroed where its sign flipped,
    and keeps that gradient as ``prev`` and the adapted sizes as ``step_size``:
    both of the last step.

    References: Riedmiller & Braun, "A Direct Adaptive Method for Faster
    Backpropagation Learning: The RPROP Algorithm", ICNN 1993; torch.optim.Rprop.
    """
    size = _wide(step_size)
    return prev.sign().to(size.dtype).mul_(size)


def accumulated_rms(total: torch.Tensor, initial: float, step: float) -> torch.Tensor:
    """``sqrt((sum - initial) / t)``: the RMS of every gradient so far, from Adagrad's sum.

    References: Duchi et al., "Adaptive Subgradient Methods", JMLR 2011;
    torch.optim.Adagrad (``sum <- sum + g^2``, started at
    ``initial_accumulator_value``).
    """
    return _wide(total).sub(initial).div_(step).sqrt_()


def adafactor_rms(row_var: torch.Tensor, col_var: torch.Tensor) -> torch.Tensor:
    """torch.optim.Adafactor's factored estimate ``sqrt(R C / mean(R))``, before its eps clamp.

    ``row_var`` has shape ``(..., n, 1)`` and ``col_var`` ``(..., 1, m)``.

    References: Shazeer & Stern, "Adafactor: Adaptive Learning Rates with
    Sublinear Memory Cost", ICML 2018, Algorithm 4; torch.optim.Adafactor.
    """
    r, c = _wide(row_var), _wide(col_var)
    return (r / r.mean(dim=-2, keepdim=True)).sqrt_().mul(c.sqrt())


def hf_adafactor_rms(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """transformers' Adafactor estimate ``sqrt(r / mean(r)) * sqrt(c)`` (``_approx_sq_grad``).

    ``row`` has shape ``(..., n)`` and ``col`` ``(..., m)``.

    References: Shazeer & Stern 2018; transformers.optimization.Adafactor.
    """
    r, c = _wide(row), _wide(col)
    return (r / r.mean(dim=-1, keepdim=True)).sqrt_().unsqueeze(-1).mul(c.sqrt().unsqueeze(-2))


def stored_rms(second: torch.Tensor) -> torch.Tensor:
    """``sqrt(v)`` of a second moment that needs no debiasing (Adafactor's ``variance``)."""
    return _wide(second).sqrt()


def as_update(update: torch.Tensor) -> torch.Tensor:
    """A stored tensor that is the step itself (transformers' Adafactor with ``beta1``:
    ``exp_avg`` averages the scaled updates and ``param -= exp_avg``)."""
    return _wide(update)


# ------------------------------------------------- the gradient between two states
#
# Two states of one optimizer, one step apart, determine the input its averages took
# at that step: every torch.optim optimizer below updates its first moment with
# ``m.lerp_(grad, 1 - beta)``, i.e. ``m_t = beta * m_{t-1} + (1 - beta) * x_t``, so
# ``x_t = (m_t - beta * m_{t-1}) / (1 - beta)``. The reconstruction is computed in
# float64 (complex128 for complex state): its own rounding (2^-53) is far below the
# state's, whose storage rounding is all that separates it from the optimizer's input.


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.complex128 if x.is_complex() else torch.float64)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of a floating dtype (2^-24 for float32, 2^-8 for
    bfloat16): the largest relative error of one correctly rounded operation."""
    if dtype.is_complex:
        dtype = dtype.to_real()
    return torch.finfo(dtype).eps / 2


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive value of a floating dtype (2^-24 for float16, 2^-149 for
    float32): below ``finfo.tiny`` rounding is absolute, at most half of it, whatever the
    value (gradual underflow)."""
    if dtype.is_complex:
        dtype = dtype.to_real()
    info = torch.finfo(dtype)
    return info.tiny * info.eps


def average_input(average: torch.Tensor, previous: torch.Tensor, beta: float) -> torch.Tensor:
    """``(m_t - beta * m_{t-1}) / (1 - beta)``: what an exponential average
    ``m_t = beta * m_{t-1} + (1 - beta) * x_t`` took at its last update.

    References:
        torch.optim.Adam, AdamW, NAdam, RAdam, Adamax (``exp_avg.lerp_(grad,
        1 - beta1)``) and RMSprop centered (``grad_avg.lerp_(grad, 1 - alpha)``).
    """
    return _f64(average).sub_(_f64(previous), alpha=beta).div_(1.0 - beta)


def adam_gradient(exp_avg: torch.Tensor, prev_exp_avg: torch.Tensor,
                  weight: torch.Tensor | None = None, *, beta1: float,
                  weight_decay: float = 0.0, maximize: bool = False) -> torch.Tensor:
    """The gradient an Adam-family step was given, from its first moments before and after.

    torch.optim's step takes ``grad`` (negated under ``maximize``), adds
    ``weight_decay * param`` to it where weight decay is L2 (Adam, NAdam,
    RAdam, Adamax and RMSprop without ``decoupled_weight_decay``; ``param``
    the weights before the step), and averages the result into ``exp_avg``.
    So ``g = s * (x_t - weight_decay * p_{t-1})`` with ``x_t`` the average's
    input (``average_input``) and ``s = -1`` under ``maximize``. Decoupled
    weight decay (AdamW) scales the weights, not the moments: pass
    ``weight_decay=0`` for it.

    References:
        torch.optim.Adam ``_single_tensor_adam`` (the ``maximize`` negation,
        ``grad.add(param, alpha=weight_decay)``, ``exp_avg.lerp_``); the
        ``_multi_tensor`` and ``_fused`` paths compute the same moments.
        Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR
        2019 (AdamW).
    """
    g = average_input(exp_avg, prev_exp_avg, beta1)
    if weight_decay != 0.0:
        if weight is None:
            raise ValueError("L2 weight decay needs the weights before the step")
        g.sub_(_f64(weight), alpha=weight_decay)
    return g.neg_() if maximize else g


def _real(x: torch.Tensor) -> torch.Tensor:
    x = _f64(x)
    return torch.view_as_real(x) if x.is_complex() else x


def _in_units(residual: torch.Tensor, scale: torch.Tensor, unit: float,
              finite: torch.Tensor) -> torch.Tensor:
    """``residual / (unit * scale)`` where the inputs are finite, 0 elsewhere (a
    non-finite state is reported as non-finite gradients, not as a disagreement), and
    0 where both are 0."""
    zero = residual == 0
    out = residual.abs().div_(scale.mul_(unit))
    return out.masked_fill_(~finite | zero, 0.0)


def second_moment_residual(exp_avg: torch.Tensor, prev_exp_avg: torch.Tensor,
                           exp_avg_sq: torch.Tensor, prev_exp_avg_sq: torch.Tensor, *,
                           beta1: float, beta2: float, unit: float,
                           tiny: float = 0.0) -> torch.Tensor:
    """How far the second moments disagree with the first, elementwise, in units of the
    state's rounding.

    With ``x`` the first moment's input (``average_input``), the second moment
    must satisfy ``v_t = beta2 * v_{t-1} + (1 - beta2) * x**2``, which is
    ``(v_t - beta2 * v_{t-1}) / (1 - beta2) = x**2``. Its residual
    ``r = v_t - beta2 * v_{t-1} - (1 - beta2) * x**2`` is divided by ``unit``
    times the size of the terms that rounding perturbs:
    ``v_t + beta2 * v_{t-1} + (1 - beta2) * (x**2 + 2 |x| (|m_t| + |m_{t-1}|) / (1 - beta1))``
    (the last term: the first moment's storage rounding, ``unit * |m|``,
    divided by ``1 - beta1`` in ``x`` and doubled in ``x**2``). torch's update
    (``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)``, the
    betas rounded to the state's compute type, then ``exp_avg.lerp_``) keeps
    the result below 9 such units; ``docs/guides/previous.md`` gives the count
    and the values measured on real runs. Complex state counts its real and
    imaginary parts apart, as torch's ``view_as_real`` does.

    ``tiny``: the state dtype's smallest subnormal (``smallest_subnormal``).
    Below its smallest normal a rounding errs by up to ``tiny / 2`` whatever the
    value (float16's ``(1 - beta2) * g**2`` is there for any ``|g|`` under
    0.25), so the size above gains ``tiny / unit`` times
    ``2 + 3 (1 - beta2) |x| / (1 - beta1)``: at most 4 such roundings in ``v_t``,
    3 in ``m_t`` carried into ``x**2`` as its relative ones are.

    References: torch.optim.Adam ``_single_tensor_adam``; Higham, "Accuracy and
    Stability of Numerical Algorithms", 2nd ed., section 2.2 (the model of
    rounding: ``fl(a op b) = (a op b)(1 + d) + e``, ``|d| <= u``, ``|e| <= tiny / 2``,
    ``d e = 0``).
    """
    m, mp, v, vp = (_real(t) for t in (exp_avg, prev_exp_avg, exp_avg_sq, prev_exp_avg_sq))
    x = mp.mul(-beta1).add_(m).div_(1.0 - beta1)
    finite = torch.isfinite(x) & torch.isfinite(v) & torch.isfinite(vp)
    drift = m.abs().add_(mp.abs()).div_(1.0 - beta1).mul_(x.abs()).mul_(2.0)
    square = x.square()
    residual = v - vp * beta2 - square * (1.0 - beta2)
    scale = v.abs().add_(vp.abs(), alpha=beta2).add_(square.add_(drift), alpha=1.0 - beta2)
    if tiny:
        scale.add_(x.abs().mul_(3 * (1.0 - beta2) / (1.0 - beta1)).add_(2.0), alpha=tiny / unit)
    return _in_units(residual, scale, unit, finite)


def infinity_norm_residual(exp_avg: torch.Tensor, prev_exp_avg: torch.Tensor,
                           exp_inf: torch.Tensor, prev_exp_inf: torch.Tensor, *,
                           beta1: float, beta2: float, eps: float, unit: float,
                           tiny: float = 0.0) -> torch.Tensor:
    """Adamax's check, elementwise in units of the state's rounding: its weighted infinity
    norm must be ``u_t = max(beta2 * u_{t-1}, |x| + eps)``, ``x`` the first moment's input.

    The residual ``u_t - max(beta2 * u_{t-1}, |x| + eps)`` is divided by ``unit``
    times ``u_t + beta2 * u_{t-1} + |x| + eps + (|m_t| + |m_{t-1}|) / (1 - beta1)``,
    plus ``tiny / unit`` times ``2 + 3 / (1 - beta1)`` for roundings in the
    subnormals (``second_moment_residual``).

    References: Kingma & Ba 2015, Algorithm 2 (AdaMax); torch.optim.Adamax
    ``_single_tensor_adamax`` (``torch.maximum(exp_inf.mul_(beta2),
    grad.abs().add_(eps))``).
    """
    m, mp, u, up = (_real(t) for t in (exp_avg, prev_exp_avg, exp_inf, prev_exp_inf))
    x = mp.mul(-beta1).add_(m).div_(1.0 - beta1).abs_()
    finite = torch.isfinite(x) & torch.isfinite(u) & torch.isfinite(up)
    residual = u - torch.maximum(up * beta2, x + eps)
    scale = (u.abs().add_(up.abs(), alpha=beta2).add_(x).add_(eps)
             .add_(m.abs().add_(mp.abs()).div_(1.0 - beta1)))
    if tiny:
        scale.add_((2.0 + 3.0 / (1.0 - beta1)) * tiny / unit)
    return _in_units(residual, scale, unit, finite)


def running_max_residual(max_sq: torch.Tensor, prev_max_sq: torch.Tensor,
                         exp_avg_sq: torch.Tensor) -> torch.Tensor:
    """AMSGrad's exact check: ``max_exp_avg_sq_t = max(max_exp_avg_sq_{t-1}, v_t)`` holds
    to the bit (a maximum rounds nothing); 0 where it holds, inf where it does not.

    References: Reddi et al. 2018, Algorithm 2; torch.optim.Adam with ``amsgrad``
    (``torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])``).
    """
    a, b, v = (_real(t) for t in (max_sq, prev_max_sq, exp_avg_sq))
    finite = torch.isfinite(a) & torch.isfinite(b) & torch.isfinite(v)
    off = (a != torch.maximum(b, v)) & finite
    return torch.zeros_like(a).masked_fill_(off, math.inf)
