"""Half-precision gradients are scaled as torch scales them (the contract, Python API).

On an accelerator: the coefficient in the gradients' dtype, through one fused
``_foreach_mul_`` per group. Without a GPU the accelerator's path is followed
on ``meta`` tensors (benchmarks/host_ops.py), where every op it issues is seen
with its arguments. On the CPU torch multiplies a half tensor by a 0-dim
coefficient in float32 (its CPU ``mul`` reads the coefficient unrounded), and
so does gradclip: there the results equal torch's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradclip_cli as gc
from benchmarks import host_ops
from gradclip_cli import GradMonitor
from gradclip_cli.core import Coefficient, scale_

HALF = [torch.float16, torch.bfloat16]
aten = torch.ops.aten


class _Calls(TorchDispatchMode):
    """Every aten op issued, with its arguments (reads of meta answered by host_ops)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))

    def multiplies(self):
        """The multiplications of half tensors (the norm's own float32 ops left out)."""
        return [(f, a) for f, a in self.calls if f.overloadpacket in (
            aten._foreach_mul_, aten.mul_, aten.mul, aten._foreach_mul)
            and _dtype_of(a[0]) in HALF]


def _dtype_of(arg):
    return arg[0].dtype if isinstance(arg, (list, tuple)) else arg.dtype


def _meta_params(dtype, shapes=((64, 32), (7,), (3, 5))):
    params = [torch.nn.Parameter(torch.empty(s, device="meta", dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.empty_like(p)
    return params


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_drop_ins_scale_half_on_an_accelerator_in_their_dtype_with_one_fused_multiply(dtype):
    params = _meta_params(dtype)
    total = torch.zeros((), device="meta")
    for call in (lambda: gc.clip_grad_norm_(params, 1.0),
                 lambda: gc.clip_grads_with_norm_(params, 1.0, total)):
        with host_ops.foreach_on_meta(), host_ops.HostOpCounter() as counter, _Calls() as seen:
            call()
        assert counter.reads == 0
        [(func, args)] = seen.multiplies()
        assert func is aten._foreach_mul_.Tensor
        tensors, coef = args
        assert [t.dtype for t in tensors] == [dtype] * len(params)
        # A device coefficient of the gradients' own dtype: torch's fused kernel takes it
        # (its fast route needs that dtype), where a float32 one falls back per tensor.
        assert coef.device.type == "meta" and coef.dtype == dtype and coef.dim() == 0


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_without_fused_kernels_each_tensor_is_multiplied_by_the_coefficient_in_its_dtype(dtype):
    params = _meta_params(dtype)
    with host_ops.HostOpCounter(), _Calls() as seen:
        gc.clip_grad_norm_(params, 1.0)
    calls = seen.multiplies()
    assert len(calls) == len(params)
    assert all(func is aten.mul_.Tensor and args[1].dtype == dtype for func, args in calls)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_logged_monitor_step_on_an_accelerator_multiplies_by_the_rounded_coefficient(
        dtype, tmp_path):
    # The logged step knows its coefficient on the host (read back with the norms);
    # it goes to the fused kernel as the number the dtype rounds it to.
    model = host_ops.meta_model([("a.weight", (64, 32)), ("b.bias", (7,))])
    for p in model.parameters():
        p.data = p.data.to(dtype)
        p.grad = torch.empty_like(p.data)
    monitor = GradMonitor(model, tmp_path / "grads.jsonl", None)
    with host_ops.foreach_on_meta(), host_ops.HostOpCounter() as counter, _Calls() as seen:
        monitor.clip_grad_norm_(1e-3)  # the counter's made-up norms (1 to 2) are clipped
    assert counter.reads == 1
    [(func, (tensors, coef))] = seen.multiplies()
    assert func is aten._foreach_mul_.Scalar and len(tensors) == 2
    assert 0 < coef < 1e-3 and float(torch.tensor(coef).to(dtype)) == coef


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_host_coefficients_round_to_the_dtype_unless_below_its_normal_range(dtype):
    from gradclip_cli.core.clipping import _as_torch_on_device

    meta = torch.device("meta")
    c = torch.tensor(0.123456789, dtype=torch.float32)
    assert _as_torch_on_device(c, dtype, meta, True) == float(c.to(dtype)) != float(c)
    device_c = _as_torch_on_device(c, dtype, meta, False)
    assert device_c.dtype == dtype and device_c.device == meta
    # Below the normal range, a rounded coefficient would lose its precision or be zero.
    tiny = torch.tensor(torch.finfo(dtype).tiny / 3, dtype=torch.float32)
    assert _as_torch_on_device(tiny, dtype, meta, True) == float(tiny)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("max_norm", [1.0, 0.37, 5e-5])
def test_on_the_cpu_half_results_equal_torchs_own_clip_bit_for_bit(dtype, max_norm):
    g = torch.Generator().manual_seed(3)
    shapes = [(300, 17), (4097,), (3,), (1,)]
    ours = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    for a, b in zip(ours, theirs):
        a.grad = (torch.randn(a.shape, generator=g) * 40).to(dtype)
        b.grad = a.grad.clone()
    total = gc.get_total_norm([p.grad for p in ours])
    gc.clip_grads_with_norm_(ours, max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(theirs, max_norm, total.clone())
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)
    # The coefficient is float32 there, not rounded to the dtype: it differs from
    # the rounded one, so this comparison could tell the two apart.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    assert float(coef.to(dtype)) != float(coef)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_on_the_cpu_a_host_coefficient_multiplies_in_float32(dtype):
    t = (torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 7).to(dtype)
    want = (t.float() * 0.123456789).to(dtype)
    scale_([t], Coefficient.of(0.123456789))
    assert torch.equal(t, want)
