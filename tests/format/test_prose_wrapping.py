"""The table's prose wraps between words wherever a path's length puts the breaks, and
``logical_lines`` (what the tests assert on) reads every sentence whole.

The hard-link note of ``clip --in-place`` once split "old bytes" across two
lines for a 28-character temporary folder; here every path length from 1
to 130 characters (every place a break can fall at 120 columns) is tried, at two widths.
"""

from __future__ import annotations

import io

import pytest

from gradclip_cli.format import table
from gradclip_cli.report import ClipReport, NonFinite
from tests.cli.support import logical_lines

NOTE = (
    "had 2 other hard links, which still hold the old bytes (the atomic replace gives "
    "this name a new file)"
)


def _report(path: str) -> ClipReport:
    return ClipReport(
        source=path,
        output=path,
        format="torch-zip",
        key="grads",
        norm_type=2.0,
        max_norm=0.5,
        clip_value=None,
        total_norm_before=1.5,
        clip_coef=1 / 3,
        total_norm_after=0.5,
        clipped=True,
        num_tensors=2,
        nonfinite=NonFinite(0, 0, 0),
        other_links_unchanged=2,
    )


@pytest.mark.parametrize("width", [80, 120])
def test_the_hard_link_note_reads_whole_at_every_path_length(monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    split_somewhere = False
    for length in range(1, 131):
        path = "/" + "p" * (length - 1)
        out = io.StringIO()
        table.render_clip(_report(path), out)
        text = out.getvalue()
        assert f"note: {path} {NOTE}" in logical_lines(text), text
        split_somewhere |= "old bytes" not in text
    # The raw text does break between the two words for some lengths: what the old
    # assertion tripped over.
    assert split_somewhere


def test_a_verdict_filled_from_the_end_fits_and_reads_whole():
    from gradclip_cli.format.fitting import wrap_from_end

    text = ("FAIL: AdamW exp_avg total norm 33.9735 (p=2) exceeds --max-norm 0.001; --max-norm "
            "applied to the AdamW exp_avg (--what auto: no gradients saved) (exit 1)")
    longest_word = max(map(len, text.split()))
    for width in range(longest_word + 2, len(text) + 3):
        lines = wrap_from_end(text, width)
        assert all(len(line) <= width for line in lines), (width, lines)
        assert logical_lines("\n".join(lines)) == [text]
        assert lines[0].startswith("FAIL:") and lines[-1].endswith("(exit 1)")
        # Filled from the end: no line but the first could take a word from the line above.
        for above, line in zip(lines, lines[1:]):
            assert len(line) + 1 + len(above.split()[-1]) > width, (width, lines)
    assert wrap_from_end(text, len(text)) == [text]
