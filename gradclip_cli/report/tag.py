"""The tag ``--tag`` named, where a trend's or an autopsy's points are its values: the
quantity every format names. Apart from ``report.trend`` so that the formats, which
name it, import no torch (``tests/cli/test_cli_startup.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..escaping import visible


@dataclass(frozen=True)
class TagRead:
    """A tracker's tag that ``--tag`` named, where the points judged are its values: the
    quantity every format names, as the tag reads, never "gradient norm" for what may be
    a loss. ``name`` is raw (a file's data: each format escapes it);
    ``named_as_norm``: whether the name is a gradient norm's by the rule that finds them
    by name (``source/logs/trackers.named_as_norm``)."""

    name: str
    named_as_norm: bool
    sources: tuple[str, ...] = ()  # the files its values were read from

    def note(self) -> str | None:
        """Where the name is no gradient norm's: that it was read as one only because
        ``--tag`` named it (escaped where made, as every note); else None."""
        if self.named_as_norm:
            return None
        return (f"{tag_words(self.name)}: not a gradient norm's name (trend finds those by "
                "name: grad_norm, grad_<p>_norm_total, gradclip/total_norm, under any "
                "logger's prefix); read as the gradient norm only because --tag named it: "
                "its spikes and non-finite points are this tag's values, not the gradients'")


def tag_words(name: str, show: Callable[[str], str] = visible) -> str:
    """``'train/loss' (given with --tag)``: a tag ``--tag`` named, as a report names the
    quantity it judged; ``show`` makes the name safe (raw, ``str``, for findings)."""
    quoted = "'" + name + "'"
    return f"{show(quoted)} (given with --tag)"
