"""Inputs left out of a run: ``--exclude GLOB`` and gradclip's own clipped copies.

``--exclude`` (docs/reference/contract.md, "Over time") is matched, as ``fnmatch`` matches,
against a path as the user gave it (or as a folder's listing names it:
``run/step_19.pt``) and against its base name, so ``--exclude
'*.clipped.pt'`` and ``--exclude run/step_19.clipped.pt`` both leave out
``run/step_19.clipped.pt``. ``fnmatch``'s ``*`` crosses ``/``.

A folder's listing also leaves out what ``gradclip clip`` writes by default
beside its input (``<stem>.clipped<suffix>``, ``options.default_output``)
when that input is there too: the copy is the same step with other norms,
which would make a run of two series (issue 41). Each is named in a note;
given by name, a clipped copy is read like any other file.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gradclip_cli.escaping import visible


def default_output_name(name: str) -> str:
    """The base name ``gradclip clip`` gives the copy of a file named ``name``."""
    stem, suffix = os.path.splitext(name)
    return f"{stem}.clipped{suffix}"


@dataclass
class Exclusion:
    """The ``--exclude`` globs of one command, and what they (and the clipped-copy
    rule) left out, for the report's notes."""

    globs: tuple[str, ...] = ()
    left_out: list[str] = field(default_factory=list)

    def excludes(self, path: Path | str) -> bool:
        """Whether ``--exclude`` leaves ``path`` out; noted when it does."""
        text = str(path)
        name = os.path.basename(text.rstrip("/" + os.sep)) or text
        for glob in self.globs:
            if fnmatch.fnmatch(text, glob) or fnmatch.fnmatch(name, glob):
                self.left_out.append(f"left out: {visible(text)} (--exclude {visible(glob)})")
                return True
        return False

    def keep(self, children: Sequence[Path]) -> list[Path]:
        """A folder's listing less what ``--exclude`` names and gradclip's clipped
        copies of the files beside them."""
        copies = clipped_copies(c.name for c in children)
        kept = []
        for child in children:
            if self.excludes(child):
                continue
            source = copies.get(child.name)
            if source is not None and child.is_file():
                self.left_out.append(
                    f"left out: {visible(str(child))}: gradclip clip's copy of "
                    f"{visible(str(child.with_name(source)))} (given by name it is read; "
                    "--exclude leaves out others)")
                continue
            kept.append(child)
        return kept

    def notes(self) -> list[str]:
        return list(dict.fromkeys(self.left_out))


def clipped_copies(names: Iterable[str]) -> dict[str, str]:
    """Of the base names ``names``, those that are gradclip clip's default copy of
    another of them: copy -> source."""
    names = list(names)
    present = set(names)
    return {copy: name for name in names
            if (copy := default_output_name(name)) in present and copy != name}
