"""Group rules and the verdict, as a user of --group-by and the exit code sees them."""

from __future__ import annotations

import math

import pytest

from gradclip_cli.errors import UsageError
from gradclip_cli.report import (
    EXCEEDED,
    NONFINITE,
    OK,
    OVERFLOW,
    NonFinite,
    parse_group_by,
    verdict,
)


@pytest.mark.parametrize(
    ("spec", "name", "group"),
    [
        ("layer", "transformer.h.3.attn.c_attn.weight", "transformer.h.3"),
        ("layer", "transformer.wte.weight", "transformer.wte"),
        ("layer", "model.layers.12.mlp.up_proj.weight", "model.layers.12"),
        ("layer", "bias", "bias"),
        ("module", "transformer.h.3.attn.c_attn.weight", "transformer.h.3.attn.c_attn"),
        ("tensor", "transformer.h.3.attn.c_attn.weight", "transformer.h.3.attn.c_attn.weight"),
        ("depth:2", "transformer.h.3.attn.c_attn.weight", "transformer.h"),
        ("depth:9", "a.b", "a.b"),
        (r"regex:(h\.\d+)", "transformer.h.3.attn.c_attn.weight", "h.3"),
        (r"regex:attn|mlp", "transformer.h.3.mlp.c_fc.bias", "mlp"),
        (r"regex:(h\.\d+)", "transformer.wte.weight", "(unmatched)"),
    ],
)
def test_group_rules(spec, name, group):
    assert parse_group_by(spec)(name) == group


@pytest.mark.parametrize("spec", ["layers", "depth:0", "depth:x", "depth:", "regex:(", ""])
def test_bad_group_by_is_a_usage_error(spec):
    with pytest.raises(UsageError):
        parse_group_by(spec)


def test_verdict_order_and_thresholds():
    clean, bad = NonFinite(), NonFinite(nan=1)
    assert verdict(clean, 1.0, None, False) == OK
    assert verdict(clean, 1.0, 1.0, False) == OK  # equal is not above
    assert verdict(clean, 1.5, 1.0, False) == EXCEEDED
    assert verdict(bad, math.nan, 1.0, False) == NONFINITE
    # A NaN total cannot be compared with a threshold, allowed or not (issue 7.3).
    assert verdict(bad, math.nan, 1.0, True) == NONFINITE
    assert verdict(bad, math.nan, None, True) == OK
    assert verdict(NonFinite(posinf=1), math.inf, 1.0, True) == EXCEEDED
    # A finite total beyond float64 is a finding with or without a threshold (issue 7.1).
    assert verdict(clean, math.inf, None, False, overflow=True) == OVERFLOW
    assert verdict(clean, math.inf, 1.0, True, overflow=True) == OVERFLOW
