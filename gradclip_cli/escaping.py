"""Text that came from a file (tensor names, keys, paths, metadata), made safe to show.

A checkpoint is untrusted input: a name may hold a newline that forges a
verdict line, an escape sequence that rewrites the terminal, or markup that a
renderer would obey. ``visible`` keeps every printable character and shows
the rest as Python-style escapes, so a name is always one inert line. Each
format then applies its own quoting (XML, Markdown, GitHub workflow commands)
on top of this; none parses markup from data.
"""

from __future__ import annotations

import unicodedata

# Characters that are printable but reorder or hide text around them
# (Trojan Source, CVE-2021-42574): bidirectional controls and zero-width marks.
_INVISIBLE = {
    *map(chr, range(0x202A, 0x202F)), *map(chr, range(0x2066, 0x206A)),
    "\u200b", "\u200c", "\u200d", "\u200e", "\u200f", "\u2028", "\u2029", "\ufeff", "\u061c",
}  # fmt: skip


def kept_visible(text: object) -> str:
    """Text built of ``visible`` pieces (a verdict, an error message), shown as it is.

    A character that is still not shown (a piece someone forgot to pass through
    ``visible``) is escaped as ``visible`` escapes it, so the line stays inert;
    a backslash is not doubled again: it begins ``visible``'s own escapes, and
    doubling it would show a name otherwise than every table row shows it.
    """
    text = str(text)
    if text.isprintable() and text.isascii():
        return text
    return "".join(ch if ch == "\\" or _shown(ch) else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch == "\\":
        return "\\\\"
    if code < 0x100:
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch, f"\\x{code:02x}")
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _shown(ch: str) -> bool:
    return ch != "\\" and ch not in _INVISIBLE and (
        ch.isprintable() and unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn")
    )


def visible(text: object) -> str:
    """``text`` as one line of printable characters; anything else is escaped.

    A backslash is doubled, so two different names never show the same.

        >>> visible("h.0\\nOK: total norm 0.1")
        'h.0\\\\nOK: total norm 0.1'
    """
    text = str(text)
    if text.isprintable() and "\\" not in text and text.isascii():
        return text  # the common case, fast
    return "".join(ch if _shown(ch) else _escape(ch) for ch in text)
