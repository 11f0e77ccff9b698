"""The formats' escaping of text that came from a file: ``visible``, from ``escaping.py``.

It lives outside ``format/`` because the sources need it too (their error
messages name keys and paths), and a source never imports a format.
"""

from __future__ import annotations

from ..escaping import kept_visible, visible

__all__ = ["kept_visible", "visible"]
