"""The spike rule on real short runs, clean and with 10x spikes injected (one seed of
``benchmarks/spike_rates.py`` per kind: the runs BENCHMARKS.md measures)."""

from __future__ import annotations

import pytest

from benchmarks import spike_rates

SEED = 7  # one of the seeds the floor was chosen on (0-29); the benchmark reports others


@pytest.fixture(scope="session", params=list(spike_rates.KINDS))
def runs(request):
    """A clean run and an injected run of one kind (made once a session)."""
    kind = request.param
    if kind == "lightning":
        pytest.importorskip("lightning.pytorch")
    if kind == "trainer":
        pytest.importorskip("transformers")
    clean = spike_rates.make_run(kind, SEED, injected=False)
    spiked = spike_rates.make_run(kind, SEED, injected=True)
    return clean, spiked


def test_a_clean_run_flags_no_step(runs):
    clean, _ = runs
    assert len(clean.records) == spike_rates.STEPS
    assert [r["step"] for r in clean.records if r["spike"]] == []
    assert spike_rates.judged_steps(clean.records) == spike_rates.STEPS - 5
    assert spike_rates.largest_z(clean.records) < 2.5
    # The rule before the std floor flagged some of these steps: the run is one
    # that tells the two apart, not a calm one any rule passes.
    assert spike_rates.earlier_rule_flags(clean.records)


def test_every_injected_spike_is_found_at_its_step_and_nothing_else(runs):
    _, spiked = runs
    assert spiked.injected == spike_rates.INJECT[spiked.kind]
    found = spike_rates.found(spiked)
    assert [hit for _, _, hit in found] == [True] * len(spiked.injected)
    assert [r["step"] for r in spiked.records if r["spike"]] == sorted(spiked.injected)
    by_step = {r["step"]: r for r in spiked.records}
    for step, target in spiked.injected.items():
        if target != "*":  # one layer's spike names that layer
            assert target in by_step[step]["spike_groups"]


def test_trend_flags_what_the_monitor_flagged(runs):
    for run in runs:
        assert spike_rates.trend_flags(run.records) == spike_rates.flagged_steps(run.records)
