"""Shared elements, complex, sparse and float8 in the core, against float64 references.

The reference for a list of views is computed from first principles: every
index of every view is turned into a storage offset by its strides, the set of
offsets is the set of distinct elements, and their values are read from the
storage itself.
"""

from __future__ import annotations

import itertools
import math
from array import array

import pytest
import torch

from gradclip_cli.core import (
    Coefficient,
    distinct_elements,
    element_power_sums,
    exact_clip_coefficient,
    scale_elements_,
    tensor_power_sums,
)
from gradclip_cli.core.elements import ApartAgain, _apart, apart

from .reference import rel_err


def offsets(t: torch.Tensor) -> set[int]:
    """Storage offsets of every element of ``t``, index by index (small tensors only)."""
    return {
        t.storage_offset() + sum(i * s for i, s in zip(index, t.stride()))
        for index in itertools.product(*(range(n) for n in t.shape))
    }


def storage_values(t: torch.Tensor) -> torch.Tensor:
    numel = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((numel,), (1,), 0)


def ref_norm_of(values: list[float], p: float) -> float:
    x = [abs(v) for v in values]
    top = max(x, default=0.0)
    if top == 0.0 or math.isinf(p):
        return top
    return top * math.fsum((v / top) ** p for v in x) ** (1 / p)


def ref_distinct_norm(tensors, p: float) -> float:
    """The p-norm of the distinct storage elements the views name."""
    flat = storage_values(tensors[0]).double().tolist()
    covered = set().union(*(offsets(t) for t in tensors))
    return ref_norm_of([flat[o] for o in covered], p)


def layouts():
    """(name, tensors) pairs: views of one storage in every way they can share elements."""
    g = torch.Generator().manual_seed(3)
    m = torch.randn(5, 4, generator=g)
    base = torch.randn(40, generator=g)
    s = torch.randn((), generator=g)
    yield "tied", [m, m]
    yield "transpose", [m, m.t()]
    yield "overlapping slices", [base[0:10], base[5:15]]
    yield "nested slices", [base[0:30], base[10:20], base[12:14]]
    yield "stride-0 expansion", [s.expand(1000, 1000)]
    yield "row expansion", [base[:4].expand(7, 4), base[2:6]]
    yield "self-overlapping", [base.as_strided((6, 5), (2, 1))]
    yield "strided and slice", [base[::3], base[0:9]]
    yield "disjoint views of one buffer", [base[0:10].view(2, 5), base[10:25], base[30:40]]
    yield "columns of a matrix", [m[:, 0], m[:, 1:3], m]
    yield "separate storages", [m, base, s]


@pytest.mark.parametrize("p", [1.0, 2.0, 0.5, 3.0, math.inf])
@pytest.mark.parametrize("name,tensors", list(layouts()), ids=[n for n, _ in layouts()])
def test_total_counts_each_storage_element_once(name, tensors, p):
    elements = distinct_elements(tensors)
    per_tensor, owned = element_power_sums(elements, p)
    if name == "separate storages":
        want = ref_norm_of([x for t in tensors for x in t.double().flatten().tolist()], p)
    else:
        want = ref_distinct_norm(tensors, p)
    assert rel_err(float(owned.total().norm[0]), want) <= 1e-6
    # Each tensor's own row: its distinct elements, counted once however often it names them.
    for i, t in enumerate(tensors):
        flat = storage_values(t).double().tolist()
        assert rel_err(float(per_tensor.norm[i]), ref_norm_of([flat[o] for o in offsets(t)], p)) \
            <= 1e-6, i
        assert elements.count(i) == len(offsets(t))


@pytest.mark.parametrize("name,tensors", list(layouts()), ids=[n for n, _ in layouts()])
def test_clipping_scales_each_storage_element_once(name, tensors):
    originals = [storage_values(t).clone() for t in tensors]
    covered = [set().union(*(offsets(u) for u in tensors if u.untyped_storage().data_ptr()
                              == t.untyped_storage().data_ptr())) for t in tensors]
    scale_elements_(distinct_elements(tensors), Coefficient.of(0.5))
    for t, before, mine in zip(tensors, originals, covered):
        after = storage_values(t)
        for o in range(before.numel()):
            want = before[o] * 0.5 if o in mine else before[o]
            assert float(after[o]) == float(want), (name, o)


def test_an_expansion_is_measured_by_the_elements_it_stores():
    # 10^12 logical elements, one stored: the work is one element (issue 7.11).
    big = torch.tensor(2.5).expand(10**6, 10**6)
    elements = distinct_elements([big])
    pieces, _ = elements.measured()
    assert sum(p.numel() for p in pieces) == 1
    per_tensor, owned = element_power_sums(elements, 2.0)
    assert float(owned.total().norm[0]) == 2.5


def test_identical_views_are_tied_and_partial_ones_share():
    base = torch.arange(20.0)
    m = base[:12].view(3, 4)
    elements = distinct_elements([m, m.t(), base[6:16]])
    assert elements.tie_of == [0, 0, 2]
    assert elements.shares[0] == (1, 2) and elements.shares[2] == (0, 1)


@pytest.mark.filterwarnings("ignore:ComplexHalf")
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.complex32])
@pytest.mark.parametrize("p", [2.0, 1.0, 0.5, math.inf])
def test_complex_counts_with_modulus(dtype, p):
    g = torch.Generator().manual_seed(5)
    z = torch.complex(torch.randn(300, generator=g), torch.randn(300, generator=g)).to(dtype)
    want = ref_norm_of(z.to(torch.complex128).abs().tolist(), p)
    _, owned = element_power_sums(distinct_elements([z]), p)
    assert rel_err(float(owned.total().norm[0]), want) <= 1e-6
    assert rel_err(float(tensor_power_sums([z], p).total().norm[0]), want) <= 1e-6


def test_complex64_modulus_beyond_float32_is_finite():
    # |3e38 + 3e38i| = 4.2e38 > float32's max: measured in a wider type, never inf.
    z = torch.tensor([3e38 + 3e38j], dtype=torch.complex64)
    _, owned = element_power_sums(distinct_elements([z]), 2.0)
    assert rel_err(float(owned.total().norm[0]), abs(complex(z[0]))) <= 1e-6


@pytest.mark.filterwarnings("ignore:Sparse")
def test_sparse_values_are_measured_and_scaled():
    dense = torch.zeros(6, 3)
    dense[1] = 2.0
    dense[4] = -1.0
    # Uncoalesced: row 1 is stored as two entries of 1.0 that sum to 2.0.
    coo = torch.sparse_coo_tensor([[1, 1, 1, 1, 1, 1, 4, 4, 4], [0, 1, 2, 0, 1, 2, 0, 1, 2]],
                                  [1.0] * 6 + [-1.0] * 3, (6, 3))
    csr = torch.eye(4).mul(3.0).to_sparse_csr()
    want = ref_norm_of(dense.flatten().tolist() + [3.0] * 4, 2.0)
    elements = distinct_elements([coo, csr])
    per_tensor, owned = element_power_sums(elements, 2.0)
    assert rel_err(float(owned.total().norm[0]), want) <= 1e-12
    scale_elements_(elements, Coefficient.of(0.25))
    torch.testing.assert_close(coo.to_dense(), dense * 0.25, rtol=0, atol=0)
    torch.testing.assert_close(csr.to_dense(), torch.eye(4) * 0.75, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_scales_in_float32_and_rounds_back(dtype):
    x = torch.linspace(-8, 8, 33).to(dtype)
    wide = x.float()
    scale_elements_(distinct_elements([x]), Coefficient.of(0.3))
    assert x.dtype == dtype
    assert torch.equal(x.float(), (wide * 0.3).to(dtype).float())


def test_requires_grad_tensors_are_read_without_a_graph():
    w = torch.randn(50, requires_grad=True)
    _, owned = element_power_sums(distinct_elements([w]), 2.0)
    assert rel_err(float(owned.total().norm[0]), float(w.detach().double().norm())) <= 1e-6


def test_total_beyond_float64_keeps_an_exact_coefficient():
    x = torch.full((4,), 1e308, dtype=torch.float64)
    total = tensor_power_sums([x], 2.0).total()
    assert bool(total.overflow[0]) and math.isinf(float(total.norm[0]))
    assert rel_err(float(total.log2_norm[0]), 1 + math.log2(1e308)) <= 1e-12
    coef = exact_clip_coefficient(total, 1.0)
    assert rel_err(coef.log2, -1 - math.log2(1e308)) <= 1e-12
    scale_elements_(distinct_elements([x]), coef)
    torch.testing.assert_close(x, torch.full((4,), 0.5, dtype=torch.float64), rtol=1e-12, atol=0)


def test_tensors_apart_are_their_own_pieces_and_the_rest_go_the_general_way():
    # The drop-ins' common case (each gradient its own allocation) carries the
    # tensors themselves; anything that may share, is complex, sparse, or has
    # no address takes the general pieces, which measure the same total.
    a, b = torch.randn(3, 4), torch.randn(7)
    w = torch.randn(5, requires_grad=True)
    apart = distinct_elements([a, b, w])
    assert apart.whole is not None and [t.data_ptr() for t in apart.whole] == [
        a.data_ptr(), b.data_ptr(), w.data_ptr()]
    assert not any(t.requires_grad for t in apart.whole)
    assert [p.target.data_ptr() for p in apart.owned] == [t.data_ptr() for t in apart.whole]
    base = torch.randn(10)
    cases = {
        "overlapping": [base[:6], base[4:]],
        "tied": [a, a],
        "transposed": [a, a.t()],
        "complex": [torch.randn(4, dtype=torch.complex64), b],
        "sparse": [torch.randn(3, 3).to_sparse(), b],
        "sparse csr": [torch.randn(3, 3).to_sparse_csr(), b],
        "sparse bsr": [torch.randn(4, 4).to_sparse_bsr((2, 2)), b],
        "meta": [torch.empty(4, device="meta")],
        "empty": [torch.empty(0), b],
    }
    # mkldnn tensors are not measured at all; they never pass for tensors apart.
    assert _apart([torch.randn(3, 3).to_mkldnn(), b]) is None
    for name, tensors in cases.items():
        elements = distinct_elements(tensors)
        assert elements.whole is None, name
        assert len(elements.owned) == len(tensors), name


def test_apart_from_given_byte_sizes_agrees_with_the_tensors_own():
    # The monitor hands over the byte sizes it has (numel * element size):
    # the answer must be the one the tensors' own nbytes give.
    base = torch.randn(10)
    a, b = torch.randn(3, 4), torch.randn(7, dtype=torch.float64)
    cases = {
        "apart": ([a, b, torch.randn(1)], True),
        "one": ([a], True),
        "none": ([], True),
        "disjoint views": ([base[:4], base[4:]], True),
        "touching by one element": ([base[:5], base[4:]], False),
        "tied": ([a, a], False),
        "transposed": ([a.t(), b], False),
        "empty": ([torch.empty(0), b], False),
        "meta": ([torch.empty(4, device="meta")], False),
        "sparse csr": ([torch.eye(3).to_sparse_csr(), b], False),
        "mkldnn": ([torch.randn(3, 3).to_mkldnn(), b], False),
    }
    for name, (tensors, want) in cases.items():
        nbytes = torch.tensor([t.numel() * t.element_size() for t in tensors], dtype=torch.int64)
        assert apart(tensors) is want, name
        assert apart(tensors, nbytes) is want, name


def test_apart_asked_again_answers_as_apart_whatever_changed_between_calls():
    # The monitor asks on every step and keeps a True answer for the same
    # addresses and sizes; any change of range, contiguity or element size
    # between two calls must give apart's own answer again.
    base = torch.randn(12)
    wide = torch.randn(12, dtype=torch.float64)
    a, b = torch.randn(3, 4), torch.randn(5)
    steps = [
        [a, b], [a, b],                       # the same tensors twice: kept
        [base[:4], base[4:]], [base[:4], base[4:]],
        [base[:5], base[4:]],                 # a range grown into the next: overlap
        [base[:4], base[4:]],
        [base[:4], base[3:]],                 # a start moved into the first range
        [a, b], [a.t(), b],                   # the same address, no longer contiguous
        [a, b], [a, a],                       # tied
        [a, b], [a, torch.empty(0)],          # empty
        [base[:6], base[6:]],
        [wide[:6].view(torch.float32)[:6], wide[6:].view(torch.float32)[:6]],
        [base[:6], base[6:].view(2, 3)],      # the same ranges in another shape
        [torch.empty(4, device="meta")],
        [b], [b],
    ]
    again = ApartAgain()
    for i, tensors in enumerate(steps):
        numels = array("q", [t.numel() for t in tensors])
        itemsize = tensors[0].element_size()
        assert again(tensors, numels, itemsize) is apart(tensors), i


def test_apart_asked_again_compares_byte_ranges_of_the_element_size_given():
    # The same addresses and element counts in a wider dtype are longer ranges.
    storage = torch.zeros(16, dtype=torch.float64)
    as_float = storage.view(torch.float32)
    narrow = [as_float[:4], as_float[4:8]]  # 16 bytes each, touching
    again = ApartAgain()
    assert again(narrow, array("q", [4, 4]), 4) is True
    # Read as 8-byte elements, the first range now reaches into the second.
    assert again(narrow, array("q", [4, 4]), 8) is False
    assert again(narrow, array("q", [4, 4]), 4) is True
