"""The one measuring step (``measuring.measure``): a selection in, a ``Measurement`` out,
checked against float64 norms computed here (within the contract's 1e-6 relative)."""

from __future__ import annotations

import math

import pytest
import torch

from gradclip_cli.core import distinct_elements
from gradclip_cli.measuring import Measurement, measure
from gradclip_cli.source.interface import Derivation, StoredTensor
from gradclip_cli.source.what import Selection


def norm64(*tensors: torch.Tensor) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def selection_of(tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor] | None = None
                 ) -> Selection:
    stored = [StoredTensor.whole(n, t) for n, t in tensors.items()]
    return Selection(
        what="grads", names=list(tensors), tensors=stored, ties={}, skipped=[], key="",
        explain="gradients", derivations=[Derivation.stored(t) for t in stored],
        weights=None if weights is None else [StoredTensor.whole(n, w)
                                              for n, w in weights.items()])


@pytest.fixture
def overlapping():
    """Two gradients that share two elements of one storage."""
    base = torch.randn(10, generator=torch.Generator().manual_seed(0))
    return base, {"a": base[:6], "b": base[4:]}


def test_shared_elements_count_once_in_the_total_and_fully_in_each_row(overlapping):
    base, tensors = overlapping
    m = measure(selection_of(tensors), 2.0, elements=distinct_elements(list(tensors.values())))
    assert isinstance(m, Measurement) and m.names == ("a", "b")
    for norm, t in zip(m.sums.norm.tolist(), tensors.values()):
        assert norm == pytest.approx(norm64(t), rel=1e-6)
    assert float(m.total().norm[0]) == pytest.approx(norm64(base), rel=1e-6)
    assert m.counts == (6, 6) and sum(m.owned_counts) == 10
    assert m.shares == (("b",), ("a",))
    assert m.weights is None


def test_without_elements_each_name_owns_its_own(overlapping):
    _, tensors = overlapping
    m = measure(selection_of(tensors), 2.0)
    assert m.owned is m.sums and m.shares == ((), ()) and m.counts == m.owned_counts == (6, 6)
    assert float(m.total().norm[0]) == pytest.approx(norm64(*tensors.values()), rel=1e-6)


def test_the_same_elements_give_the_same_bits_by_either_road():
    # Gradients apart: measured as distinct pieces or as their own derivations, the
    # core sees the same tensors in the same order.
    tensors = {f"l.{i}.w": torch.randn(5, 3, dtype=torch.bfloat16) for i in range(4)}
    by_elements = measure(selection_of(tensors), 3.0,
                          elements=distinct_elements(list(tensors.values())))
    by_reads = measure(selection_of(tensors), 3.0)
    for field in ("scale", "power_sum", "max_abs", "nan", "posinf", "neginf"):
        assert torch.equal(getattr(by_elements.sums, field), getattr(by_reads.sums, field))


def test_weights_are_measured_where_asked_and_all_held():
    grads = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0])}
    weights = {"a": torch.tensor([6.0, 8.0]), "b": torch.tensor([-2.0])}
    m = measure(selection_of(grads, weights), 2.0, weights=True)
    assert m.weights.norm.tolist() == pytest.approx([10.0, 2.0], rel=1e-6)
    assert measure(selection_of(grads, weights), 2.0).weights is None


def test_progress_counts_every_byte_read(overlapping):
    base, tensors = overlapping

    class Progress:
        def __init__(self):
            self.total, self.done = None, 0

        def begin(self, label, total=None):
            self.total = total

        def advance(self, n):
            self.done += n

    progress = Progress()
    elements = distinct_elements(list(tensors.values()))
    measure(selection_of(tensors), 2.0, elements=elements, progress=progress)
    # Each element owned once (the storage's ten floats), and b's row gathered whole
    # (its six, two of them a's).
    assert elements.measured()[1] == [0, 2]
    assert progress.total == progress.done == (10 + 6) * base.dtype.itemsize
