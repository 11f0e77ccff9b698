"""Gradient elements far outside what Adam expects of them: the autopsy's outlier count.

Adam keeps, per element, ``v`` (``exp_avg_sq``), an exponential average of
the squared gradient; debiased, ``v_hat = v / (1 - beta2^t)`` is the
element's recent mean square, so ``sqrt(v_hat)`` is the size its gradient
has had. An element of a new gradient ``g`` with ``|g| > k * sqrt(v_hat)``
is ``k`` times larger than its own history: the fraction of such elements
in a layer says whether a spike is a few entries gone wild or the whole
layer scaled up.

References:
    OLMo-core (allenai/OLMo-core) flags, inside the training loop, gradient
    entries beyond ``k`` standard deviations of Adam's moments, with k = 6 by
    default (as described in gradclip issue 37); this is that count, made
    offline from a saved gradient and the optimizer state of the step
    before. Pure math, no I/O.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def adam_outliers(grad: torch.Tensor, rms: torch.Tensor, k: float) -> int:
    """How many elements of ``grad`` have ``|g| > k * rms``; ``rms = sqrt(v_hat)`` of the
    same parameter (the second moment of the step before ``grad``), compared in float64.

    A NaN gradient element compares false (it is not counted: non-finite values are
    counted apart); an infinite one is an outlier wherever ``rms`` is finite.
    """
    if tuple(grad.shape) != tuple(rms.shape):
        raise ValueError(f"gradient of shape {list(grad.shape)} and second moment of shape "
                         f"{list(rms.shape)} are not one parameter's")
    g = grad.detach().reshape(-1).to(torch.float64).abs()
    limit = rms.detach().reshape(-1).to(torch.float64) * float(k)
    return int((g > limit).sum())
