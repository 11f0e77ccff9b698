"""Names from a file become one inert, printable line."""

from __future__ import annotations

import pytest

from gradclip_cli.format.text import visible

CASES = {
    "plain.name.0.weight": "plain.name.0.weight",
    "h.0\nOK: total norm 0.1 (exit 0)": "h.0\\nOK: total norm 0.1 (exit 0)",
    "\x1b[2Jclear": "\\x1b[2Jclear",
    "osc\x1b]8;;file:///etc/passwd\x07link": "osc\\x1b]8;;file:///etc/passwd\\x07link",
    "c1\x9bcsi": "c1\\x9bcsi",
    "tab\there": "tab\\there",
    "back\\slash": "back\\\\slash",
    "bidi\u202eevil": "bidi\\u202eevil",
    "zero\u200bwidth": "zero\\u200bwidth",
    "[bold]markup[/bold]": "[bold]markup[/bold]",  # inert text; formats never parse it
    "ünïcode.名前": "ünïcode.名前",
    "del\x7f": "del\\x7f",
}


@pytest.mark.parametrize("raw", list(CASES))
def test_visible(raw):
    shown = visible(raw)
    assert shown == CASES[raw]
    assert shown.isprintable()
    assert "\x1b" not in shown and "\n" not in shown


def test_distinct_names_stay_distinct():
    assert visible("a\\nb") != visible("a\nb")
