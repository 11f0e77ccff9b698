"""Fitting a report to the width: shortening names, wrapping prose, choosing columns.

Every line of a table report fits the width (``COLUMNS`` when set, else the
terminal's, else 120) from 60 columns up. Optional columns go first (in
increasing ``drop`` order), then names are shortened in the middle with an
ellipsis (their ends are what tells layers apart); a number is never cut.
Prose lines wrap between words.

This module decides widths and the text of each cell; ``table.py`` draws
them with rich. Widths are measured in terminal cells with rich's own
measure (``rich.cells.cell_len``), so what is fitted here is what rich draws.
A cell is a ``str`` or a styled text (anything with ``plain`` and
``cell_len``: rich's ``Text``); only ``str`` cells are shortened.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from typing import Protocol, TextIO

from rich.cells import cell_len

# Pipes and CI logs get this width when COLUMNS is unset (rich would use 80).
PIPE_WIDTH = 120
ELLIPSIS = "…"
# A name column narrower than this shows too little to tell names apart.
MIN_NAME_WIDTH = 12


class Styled(Protocol):
    plain: str

    @property
    def cell_len(self) -> int: ...


Cell = str | Styled


def shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, its middle replaced by an ellipsis if needed."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    keep = width - 1
    head, tail = "", ""
    # Grow both ends alternately (the tail gets the odd cell: the end of a name
    # says which parameter it is) until the next character would not fit.
    left, right = 0, len(text)
    while left < right:
        take_tail = cell_len(tail) <= cell_len(head)
        ch = text[right - 1] if take_tail else text[left]
        if cell_len(head) + cell_len(tail) + cell_len(ch) > keep:
            break
        if take_tail:
            tail, right = ch + tail, right - 1
        else:
            head, left = head + ch, left + 1
    return head + ELLIPSIS + tail


def wrap(text: str, width: int, indent: str = "  ") -> list[str]:
    """Prose split between words into lines of at most ``width`` cells (a word never breaks)."""
    lines = textwrap.wrap(text, width=width, subsequent_indent=indent,
                          break_long_words=False, break_on_hyphens=False)
    return lines or [""]


def wrap_from_end(text: str, width: int, indent: str = "  ") -> list[str]:
    """As ``wrap``, but the lines fill from the end: the last line holds as much of the
    text's end as fits. For a verdict, whose last line scripts read (``tail -1``): its
    tail names what was judged ("... applied to the weights (--what auto: no gradients
    saved) (exit 1)"), where a wrap from the start left "  gradients saved) (exit 1)"."""
    words = text.split(" ")
    lines: list[str] = []
    while words:
        take = 1
        if cell_len(" ".join(words)) <= width:  # the first line: no indent
            take = len(words)
        while take < len(words) and \
                cell_len(indent + " ".join(words[-take - 1:])) <= width:
            take += 1
        lines.append(" ".join(words[-take:]))
        del words[-take:]
    lines.reverse()
    return [lines[0], *(indent + line for line in lines[1:])]


def report_width(out: TextIO) -> int:
    """``COLUMNS`` when set (in pipes too); else the terminal's width; else ``PIPE_WIDTH``.

    A terminal that reports no width (``stty size`` says ``0 0``: ``script``,
    ``expect`` and CI runners' pseudo-terminals) counts as none, as for a pipe.
    """
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        try:
            columns = os.get_terminal_size(out.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        if columns > 0:
            return columns
    return PIPE_WIDTH


@dataclass
class Column:
    header: str
    cells: list[Cell]
    justify: str = "right"
    drop: int = 0  # 0: always shown; else dropped in increasing order when space is short
    name: bool = False  # cells may be shortened in the middle (the widest name first)
    wrap_at: str | None = None  # cells may break into lines after this separator (with
    # ``name``: a list of names, each on its own line before any is shortened)


def plain(cell: Cell) -> str:
    return cell if isinstance(cell, str) else cell.plain


def cell_width(cell: Cell) -> int:
    return cell_len(cell) if isinstance(cell, str) else cell.cell_len


def _parts(cell: Cell, sep: str) -> list[str]:
    text = plain(cell)
    pieces = text.split(sep)
    return [piece + sep for piece in pieces[:-1]] + pieces[-1:]


def _narrowest(col: Column) -> int:
    """The least width a column takes without breaking inside a number or word."""
    if col.wrap_at is None:
        return max([cell_len(col.header), *(cell_width(c) for c in col.cells)])
    parts = [cell_len(part.rstrip()) for c in col.cells for part in _parts(c, col.wrap_at)]
    return max([cell_len(col.header), *parts])


def _overhead(cols: list[Column]) -> int:
    # Box-drawing overhead: a border left of every column and one at the end,
    # and one space of padding on each side of every cell.
    return 3 * len(cols) + 1


def _natural(col: Column) -> int:
    return max([cell_len(col.header), *(cell_width(c) for c in col.cells)])


def _least(col: Column) -> int:
    """The least width a name column is shortened to (a shorter name tells too little)."""
    return min(_natural(col), MIN_NAME_WIDTH)


def shown_columns(columns: list[Column], width: int, shorten_first: bool = False
                  ) -> list[Column]:
    """The columns that fit ``width``: optional ones go, in increasing ``drop`` order,
    while the table is too wide with names at their full width (``shorten_first``:
    at their least width, so names are shortened before a column goes)."""
    shown = list(columns)

    def needed(cols: list[Column]) -> int:
        return sum(_least(c) if c.name and shorten_first else _natural(c)
                   for c in cols) + _overhead(cols)

    for rank in sorted({c.drop for c in columns if c.drop}):
        if needed(shown) <= width:
            break
        shown = [c for c in shown if c.drop != rank]
    return shown


def wrapped(cell: Cell, sep: str, width: int) -> str:
    """``cell`` broken into lines after ``sep`` so that each fits ``width`` where it can."""
    lines: list[str] = []
    for part in _parts(cell, sep):
        if lines and cell_len(lines[-1] + part.rstrip()) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return "\n".join(line.rstrip() for line in lines)


@dataclass(frozen=True)
class Fitted:
    """The columns shown and each one's width (by ``id``)."""

    shown: list[Column]
    widths: dict[int, int]

    def width(self, col: Column) -> int:
        return self.widths[id(col)]

    def cell(self, col: Column, cell: Cell) -> Cell:
        """``cell`` as drawn in ``col``: a name shortened, a wrapping cell broken into lines
        (as a ``str``: the drawer keeps a styled cell's style), anything else as it is."""
        w = self.width(col)
        if col.wrap_at is not None and cell_width(cell) > w:
            lines = wrapped(cell, col.wrap_at, w).split("\n")
            if col.name:  # a list of names: one per line where it fits, each shortened
                lines = [shorten(line, w) for line in lines]
            return "\n".join(lines)
        if col.name and isinstance(cell, str):
            return shorten(cell, w)
        return cell


def fit(columns: list[Column], width: int, shorten_first: bool = False) -> Fitted:
    """The columns and widths of a table at most ``width`` cells wide (from 60 up).

    Optional columns go first (``shown_columns``); what still does not fit
    comes out of the name columns (``name=True``), the widest first, each
    shortened in the middle.
    """
    shown = shown_columns(columns, width, shorten_first)
    names = [c for c in shown if c.name]
    widths = {id(c): _natural(c) for c in shown}
    room = width - _overhead(shown) - sum(widths[id(c)] for c in shown if not c.name)
    least_names = sum(_least(c) for c in names)
    for col in shown:  # still short: break cells that may break (after a separator)
        if room >= least_names:
            break
        if col.wrap_at is not None and not col.name:  # (a name column gives below)
            give = min(widths[id(col)] - _narrowest(col), least_names - room)
            widths[id(col)] -= give
            room += give
    # Take what does not fit from the widest name column, one cell at a time.
    while sum(widths[id(c)] for c in names) > room:
        widest = max(names, key=lambda c: widths[id(c)] - _least(c))
        if widths[id(widest)] <= _least(widest):
            break
        widths[id(widest)] -= 1
    return Fitted(shown, widths)
