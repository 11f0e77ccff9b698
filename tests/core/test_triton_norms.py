"""The Triton multi-tensor norm kernel (core/triton_norms.py), against float64: on
CUDA where there is a GPU, else on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py before Triton is imported).

Small tiles (64 elements, 4 a program) make tensors of a few hundred elements
span several tiles and programs, so the interpreter's tests stay quick while
every combining step runs. Each (dtype, p) is one call over tensors of every
kind at once: empty, one element, odd sizes, values near the dtype's largest,
subnormals, magnitudes spread over the range, and NaN/+inf/-inf patterns.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ORDERS = [1.0, 2.0, 3.5, math.inf]
F32_INEXACT_P = 2.2  # float32 holds it 5e-8 off: the kernel must use float64's
F64 = torch.float64


@pytest.fixture(scope="module")
def tn():
    """The kernel module with the interpreter on and small tiles; afterwards as it was."""
    from gradclip_cli.core import triton_norms

    if DEVICE == "cpu" and not triton_norms.interpreted():
        pytest.skip("no GPU, and Triton's interpreter was not chosen before Triton loaded")
    patch = pytest.MonkeyPatch()
    patch.setattr(triton_norms, "BLOCK", 64)
    patch.setattr(triton_norms, "TILES", 4)
    yield triton_norms
    patch.undo()


def cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(11)
    subnormal = info.smallest_normal * info.eps  # the smallest subnormal

    def uniform(n, low, high):
        return (low + (high - low) * torch.rand(n, generator=g, dtype=F64)).to(dtype)

    def signs(x):
        return x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1, 1).to(x.dtype)

    # Magnitudes spread from the smallest normal to half the largest, across tiles.
    spread = torch.logspace(math.log2(info.smallest_normal), math.log2(info.max) - 1, 601,
                            base=2, dtype=F64).to(dtype)
    mixed = uniform(517, 0.25, 1.0) * (info.max / 4)
    mixed[::7] = info.smallest_normal * 3
    with_nan = torch.randn(333, generator=g, dtype=F64).to(dtype)
    with_nan[-1] = math.nan
    every_kind = torch.randn(260, generator=g, dtype=F64).to(dtype)
    every_kind[[0, 100]] = math.nan
    every_kind[[5, 64, 259]] = math.inf
    every_kind[200] = -math.inf
    return {
        "empty": torch.empty(0, dtype=dtype),
        "one": torch.tensor([3.0], dtype=dtype),
        "odd": torch.randn(1001, generator=g, dtype=F64).to(dtype),
        "near the largest": signs(uniform(700, 0.5, 1.0) * info.max),
        "subnormal": signs(torch.randint(1, 8, (300,), generator=g).to(F64) * subnormal)
        .to(dtype),
        "spread": signs(spread),
        "mixed": mixed,
        "2-d": torch.randn(37, 11, generator=g, dtype=F64).to(dtype),
        "NaN last": with_nan,
        "NaN and infinities": every_kind,
        "-inf only": torch.full((5,), -math.inf, dtype=dtype),
    }


def reference(x: torch.Tensor, p: float) -> tuple[float, int, float]:
    """(max finite |x|, its frexp exponent e, ||finite x / 2^e||_p) in float64:
    the norm as a mantissa and a power of two, whatever its size."""
    a = x.to(F64).abs().flatten()
    a = a[torch.isfinite(a)]
    top = float(a.max()) if a.numel() else 0.0
    e = math.frexp(top)[1] if top > 0 else 0
    scaled = a * 2.0 ** (-(e // 2)) * 2.0 ** (-(e - e // 2))
    return top, e, float(torch.linalg.vector_norm(scaled, p)) if a.numel() else 0.0


def counts(x: torch.Tensor) -> tuple[int, int, int]:
    return (int(torch.isnan(x).sum()), int(torch.isposinf(x).sum()),
            int(torch.isneginf(x).sum()))


@pytest.mark.parametrize("p", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_tensor_matches_float64(tn, dtype, p):
    tensors = cases(dtype)
    sums = tn.tensor_sums([t.to(DEVICE) for t in tensors.values()], p)
    norms, maxima = sums.norms().tolist(), sums.maxima().tolist()
    for i, (name, x) in enumerate(tensors.items()):
        top, e, mantissa = reference(x, p)
        nan, posinf, neginf = counts(x)
        assert (int(sums.nan[i]), int(sums.posinf[i]), int(sums.neginf[i])) == counts(x), name
        assert float(sums.max_abs[i]) == top, name  # the max of the finite elements, exactly
        if nan:
            assert math.isnan(norms[i]) and math.isnan(maxima[i]), name
            continue
        if posinf or neginf:
            assert norms[i] == maxima[i] == math.inf, name
            continue
        assert maxima[i] == top, name
        if math.isinf(p):
            assert norms[i] == top, name
            continue
        # The power sum S 2^(p E) as the norm's mantissa at the reference's exponent.
        got = (float(sums.power_sum[i]) ** (1 / p)
               * 2.0 ** (int(sums.exponent[i]) - e // 2) * 2.0 ** (-(e - e // 2)))
        if mantissa == 0:
            assert got == 0, name
        else:
            assert math.isclose(got, mantissa, rel_tol=1e-6), (name, got, mantissa)


@pytest.mark.parametrize("p", [2.0, 3.5, math.inf])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_totals_over_tensors_of_every_magnitude(tn, dtype, p):
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(n, generator=g, dtype=F64).mul(scale).to(dtype) for n, scale in
               [(300, info.max / 8), (129, 1.0), (0, 1.0), (77, info.smallest_normal * 8)]]
    whole = torch.cat([t.to(F64) for t in tensors])
    top = float(whole.abs().max())
    want = top * float(torch.linalg.vector_norm(whole / top, p))
    sums = tn.tensor_sums([t.to(DEVICE) for t in tensors], p)
    assert math.isclose(float(sums.total_norm()), want, rel_tol=1e-6)
    assert math.isclose(float(sums.total_power_sum()),
                        top if math.isinf(p) else want**p, rel_tol=1e-5)


def test_an_order_float32_cannot_hold_is_used_exactly(tn):
    # Values spread over 2^-40 .. 1: a p off by 5e-8 would move the small terms by
    # 5e-8 * |ln x| relative, and the sum by more than float64's rounding.
    x = torch.logspace(-40, 0, 1000, base=2, dtype=F64)
    sums = tn.tensor_sums([x.to(DEVICE)], F32_INEXACT_P)
    got = float(sums.power_sum[0]) * 2.0 ** (F32_INEXACT_P * int(sums.exponent[0]))
    want = float(x.pow(F32_INEXACT_P).sum())
    assert math.isclose(got, want, rel_tol=1e-12)


def test_nonfinite_totals_propagate_nan_before_inf(tn):
    finite = torch.ones(10, device=DEVICE)
    inf = torch.tensor([1.0, math.inf], device=DEVICE)
    nan = torch.tensor([math.nan, -math.inf], device=DEVICE)
    assert math.isinf(float(tn.tensor_sums([finite, inf], 2.0).total_norm()))
    assert math.isnan(float(tn.tensor_sums([finite, inf, nan], 2.0).total_norm()))
    assert math.isnan(float(tn.tensor_sums([nan, finite], math.inf).total_power_sum()))


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's choice")
def test_usable_only_on_cuda_or_the_interpreters_tests(tn, monkeypatch):
    x = [torch.ones(3)]
    assert not tn.usable(x, 2.0)  # the CPU: gradclip's own path
    monkeypatch.setenv("GRADCLIP_TRITON", "interpret")
    assert tn.usable(x, 2.0)
    assert not tn.usable([torch.ones(3, dtype=torch.int32)], 2.0)
    assert not tn.usable([torch.ones(4, 4).t()], 2.0)  # not contiguous: today's path
    assert not tn.usable(x, 0.0)
    monkeypatch.setenv("GRADCLIP_TRITON", "0")
    assert not tn.usable(x, 2.0)


@pytest.mark.parametrize("p", [2.0, 3.5])
def test_every_caller_takes_the_kernel_where_it_serves(tn, monkeypatch, p):
    # The callers' own paths (get_total_norm's, the monitor's and the CLI's rows, the
    # DTensor total) run through the interpreter, and agree with float64.
    from gradclip_cli.core import kernels
    from gradclip_cli.core.norms import tensor_power_sums
    from gradclip_cli.distributed import dtensor

    monkeypatch.setenv("GRADCLIP_TRITON", "interpret")
    calls = []
    real = tn.tensor_sums
    monkeypatch.setattr(tn, "tensor_sums", lambda ts, q: calls.append(len(ts)) or real(ts, q))
    assert tn.failure is None
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(n, generator=g).mul(1e20).to(DEVICE) for n in (300, 5, 0, 130)]
    wide = [t.to("cpu", F64) for t in tensors]
    want = [float(torch.linalg.vector_norm(w, p)) for w in wide]
    total = float(torch.linalg.vector_norm(torch.cat(wide), p))

    sums = tensor_power_sums(tensors, p, foreach=True)  # the accelerator's rows
    for got, w in zip(sums.norm.tolist(), want):
        assert math.isclose(got, w, rel_tol=1e-6, abs_tol=0.0)
    assert math.isclose(float(kernels.total_on_device(tensors, p)), total, rel_tol=1e-6)
    power = float(dtensor._local_power_sum(tensors, p, torch.device(DEVICE)))
    assert math.isclose(power, total**p, rel_tol=1e-6)
    if p == 2.0:
        for got, w in zip(kernels.norms_by_foreach(tensors).tolist(), want):
            assert math.isclose(got, w, rel_tol=1e-6)
    assert len(calls) == (4 if p == 2.0 else 3)
    assert kernels.sums_by_foreach(tensors, p, foreach=False).norm is not None
    assert len(calls) == (4 if p == 2.0 else 3)  # foreach=False keeps the loop


def test_a_kernel_that_cannot_run_here_falls_back_once_with_a_warning(tn, monkeypatch):
    # A Triton that cannot compile or launch the kernel on some machine: the norms
    # come from the _foreach path, exact as well, and it is said once.
    from gradclip_cli.core import kernels

    monkeypatch.setenv("GRADCLIP_TRITON", "interpret")
    monkeypatch.setattr(tn, "failure", None)

    def broken(tensors, p):
        raise RuntimeError("PassManager::run failed\nout of shared memory")

    monkeypatch.setattr(tn, "tensor_sums", broken)
    x = [torch.tensor([3.0, 4.0], device=DEVICE), torch.tensor([12.0], device=DEVICE)]
    with pytest.warns(RuntimeWarning, match="Triton norm kernel cannot run here "
                                            r"\(RuntimeError: out of shared memory\)"):
        assert float(kernels.total_on_device(x, 2.0)) == 13.0
    assert tn.failure is not None and not tn.usable(x, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(kernels.total_on_device(x, 2.0)) == 13.0  # no second warning


@pytest.mark.parametrize("p", [0.1, 0.25])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_small_orders_keep_terms_far_below_the_tiles_largest(tn, dtype, p):
    # Below p = 1 an element 2^-160 of its tile's largest still adds 2^(-160 p) of
    # the largest's term (2^-16 at p = 0.1): scaled in float32 it would vanish.
    info = torch.finfo(dtype)
    x = torch.full((255,), info.smallest_normal * 4, dtype=F64)
    x[::64] = info.max / 2
    x = x.to(dtype)
    wide = x.to(F64)
    top = float(wide.abs().max())
    want = top * float(torch.linalg.vector_norm(wide / top, p))
    sums = tn.tensor_sums([x.to(DEVICE)], p)
    assert math.isclose(float(sums.norms()[0]), want, rel_tol=1e-6)
    assert math.isclose(float(sums.total_norm()), want, rel_tol=1e-6)


@pytest.mark.parametrize("p", [1100.0, 1e6])
def test_an_order_beyond_the_kernels_range_is_left_to_the_foreach_path(tn, monkeypatch, p):
    # A tile's largest term is (m 2^-k)^p >= 2^-p: at p = 1e6 every term underflowed,
    # and the norm of [3, 1, -2.5] came out 0. The _foreach path divides by the
    # largest |x| first (its largest term is 1).
    from gradclip_cli.core import kernels

    monkeypatch.setenv("GRADCLIP_TRITON", "interpret")
    x = [torch.tensor([0.5, 0.25, -0.5], device=DEVICE), torch.tensor([3.0, 1.0, -2.5])]
    for t in x:
        wide = t.to("cpu", F64)
        top = float(wide.abs().max())
        want = top * float(torch.linalg.vector_norm(wide / top, p))
        assert math.isclose(float(kernels.total_on_device([t.to(DEVICE)], p)), want,
                            rel_tol=1e-6)
        rows = kernels.sums_by_foreach([t.to(DEVICE)], p)
        assert math.isclose(float(rows.norm[0] * (1 if rows.unit is None else rows.unit)),
                            want, rel_tol=1e-6)
    assert tn.usable(x, 512.0) and not tn.usable(x, p)


def test_a_root_that_overflows_alone_gives_the_norm(tn):
    # Subnormal float64 values at p = 0.01: the root of the scaled sum (4096 ** 100)
    # overflows float64, the norm (2^-1074 times it, about 2^126) does not.
    p = 0.01
    x = [torch.full((4096,), 2.0**-1074, dtype=F64), torch.full((10,), 2.0**-1000, dtype=F64)]
    logs = [math.log2(float(t.abs().pow(p).sum())) / p for t in x]
    total_log = math.log2(sum(float(t.abs().pow(p).sum()) for t in x)) / p
    sums = tn.tensor_sums([t.to(DEVICE) for t in x], p)
    got = [math.log2(float(v)) for v in sums.norms()]
    assert all(abs(a - b) <= 1e-6 / math.log(2) for a, b in zip(got, logs))
    assert abs(math.log2(float(sums.total_norm())) - total_log) <= 1e-6 / math.log(2)
