"""The table stays readable when a checkpoint has thousands of groups."""

from __future__ import annotations

import io

import torch

from gradclip_cli.core import tensor_power_sums
from gradclip_cli.format import shown, table
from gradclip_cli.measuring import Measurement
from gradclip_cli.report import build_inspect_report, parse_group_by
from tests.cli.support import unwrapped


def report_for(tensors: dict[str, torch.Tensor]):
    names, values = list(tensors), list(tensors.values())
    sums, counts = tensor_power_sums(values, 2.0), tuple(t.numel() for t in values)
    measured = Measurement(tuple(names), sums, sums, counts, counts, tuple(() for _ in names))
    return build_inspect_report(
        measured, tensors=values, ties={},
        group_rule=parse_group_by("layer"), source="x.pt", format="torch-zip", key="grads",
        device="cpu", max_norm=None, allow_nonfinite=False, group_by="layer", skipped=[],
    )


def test_many_groups_show_the_largest_and_the_nonfinite_in_order():
    tensors = {f"h.{i}.w": torch.full((4,), 1.0) for i in range(200)}
    tensors["h.150.w"] = torch.full((4,), 1e4)
    tensors["h.7.w"] = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    out = io.StringIO()
    table.render_inspect(report_for(tensors), out, top=0)
    text = out.getvalue()
    assert "h.150 " in text and "h.7 " in text
    assert text.index("h.7 ") < text.index("h.150 ")  # checkpoint order kept
    rows = sum(1 for line in text.splitlines() if line.startswith("│ h."))
    assert rows == shown.MAX_GROUPS
    assert f"{200 - shown.MAX_GROUPS:,} smaller groups not shown" in unwrapped(text)


def test_few_groups_are_all_shown():
    tensors = {f"h.{i}.w": torch.ones(3) for i in range(5)}
    out = io.StringIO()
    table.render_inspect(report_for(tensors), out, top=0)
    assert "not shown" not in out.getvalue()
    assert sum(1 for line in out.getvalue().splitlines() if line.startswith("│ h.")) == 5
