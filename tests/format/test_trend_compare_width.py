"""trend and compare tables at 60 and 80 columns: every line fits, and long source paths
and group names are shortened in the middle with "…" (docs/getting-started.md), never
broken mid-word."""

from __future__ import annotations

import pytest
import torch
from rich.cells import cell_len

from tests.cli.conftest import gradclip  # noqa: F401 (fixture)

LONG_GROUP = "transformer.h.1.mlp.c_proj_with_a_long_name.weight"


@pytest.fixture
def long_run(tmp_path):
    folder = tmp_path / ("a_run_folder_whose_name_is_long_enough_to_wrap_" * 2)
    folder.mkdir()
    for step in range(8):
        grads = {"transformer.h.0.attn.c_attn.weight": torch.ones(4) * (1 + 0.01 * step),
                 LONG_GROUP: torch.ones(4) * (100.0 if step == 7 else 1.0)}
        torch.save({"grads": grads, "step": step},
                   folder / f"checkpoint_number_{step}_of_the_run_with_a_long_name.pt")
    return folder


def rows(text: str) -> list[list[str]]:
    """The cells of every table body row (lines between │ borders)."""
    return [[c.strip() for c in line.strip("│").split("│")]
            for line in text.splitlines() if line.startswith("│")]


def check_shortened(cell: str, full: str) -> None:
    """``cell`` is ``full``, or its head and tail around one "…"."""
    if cell == full:
        return
    head, sep, tail = cell.partition("…")
    assert sep and full.startswith(head) and full.endswith(tail), (cell, full)


@pytest.mark.parametrize("width", [60, 80])
def test_trend_fits_and_shortens_sources_in_the_middle(gradclip, long_run, monkeypatch,  # noqa: F811
                                                       width):
    monkeypatch.setenv("COLUMNS", str(width))
    r = gradclip("trend", long_run, "--group-by", "tensor", "--no-progress")
    assert r.code == 1, r.err
    lines = r.out.splitlines()
    # Every line fits but the verdict, one line whatever its length (grep finds it).
    assert all(cell_len(line) <= width for line in lines[:-1]), r.out
    points = [row for row in rows(r.out) if row[0].isdigit()]
    assert [int(row[0]) for row in points] == list(range(8))  # one line per point
    for row in points:
        step = int(row[0])
        check_shortened(row[1], str(long_run / f"checkpoint_number_{step}_of_the_run_with_a_"
                                                "long_name.pt"))
    spiking = points[-1]
    if len(spiking) == 6:  # the groups column, where it fits
        check_shortened(spiking[5], LONG_GROUP)
    else:  # else the groups on a line below the table
        assert f"step 7: {LONG_GROUP}" in r.out
    assert LONG_GROUP in lines[-1]


@pytest.mark.parametrize("width", [60, 80])
def test_compare_fits_and_shortens_names_in_the_middle(gradclip, long_run, monkeypatch,  # noqa: F811
                                                       width):
    monkeypatch.setenv("COLUMNS", str(width))
    a, b = sorted(long_run.iterdir())[0], sorted(long_run.iterdir())[-1]
    r = gradclip("compare", a, b, "--group-by", "tensor")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert all(cell_len(line) <= width for line in lines[:-1]), r.out
    check_shortened(lines[0].removeprefix("A: "), str(a))
    check_shortened(lines[1].removeprefix("B: "), str(b))
    table = rows(r.out)
    assert len(table) == 3  # two groups and the total, one line each
    check_shortened(table[0][0], LONG_GROUP)
    assert table[0][3] == "100x" and table[-1][0] == "total"
