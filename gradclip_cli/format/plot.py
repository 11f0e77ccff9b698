"""``trend --plot FILE.png|.svg``: the norms over time as a picture (matplotlib, optional).

A line for the total and for each of the ``TOP_GROUPS`` groups with the
largest norms, on a log scale (a spike is orders of magnitude, and healthy
norms drift by factors); spikes are marked with a red ring, non-finite
points with a red cross at the top edge. matplotlib is imported here and
only here, when a plot is asked for (``pip install 'gradclip[plot]'``).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..report.tag import tag_words
from ..sink import atomic_write
from .text import visible

if TYPE_CHECKING:
    from ..report.trend import TrendReport

TOP_GROUPS = 8


def _label(name: str) -> str:
    # matplotlib reads text between two "$" as mathtext; a name is plain text.
    return visible(name).replace("$", r"\$")


def plot_title(report: TrendReport) -> str:
    """What the picture shows, then the verdict with its scope: a ring on an earlier
    spike under a title that only said "status ok" read as a contradiction."""
    spikes = sum(p.spike and not p.is_nonfinite for p in report.points)
    nonfinite = sum(p.is_nonfinite for p in report.points)
    marks = [f"{spikes} spike(s)" if spikes else "", f"{nonfinite} non-finite" if nonfinite else ""]
    found = ", ".join(m for m in marks if m) or "no spike"
    scope = "newest point" if report.fail_on == "newest" else "any point"
    return (f"gradclip trend: {len(report.points)} points, {found}; "
            f"verdict ({scope}): {report.status}")


def write_trend_plot(report: TrendReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed, none opened
    from matplotlib.figure import Figure

    xs = [p.step if p.step is not None else i for i, p in enumerate(report.points)]
    fig = Figure(figsize=(10, 5), dpi=100)
    ax = fig.add_subplot()
    ranked = sorted(report.groups, key=lambda g: -max(
        (math.inf if not math.isfinite(p.groups[g]) else p.groups[g]
         for p in report.points if g in p.groups), default=0.0))[:TOP_GROUPS]
    series = [("total", [p.total_norm for p in report.points], 2.0)]
    series += [(g, [p.groups.get(g) for p in report.points], 1.0) for g in ranked]
    finite = [v for _, values, _ in series for v in values
              if v is not None and math.isfinite(v) and v > 0]
    top = max(finite, default=1.0)
    for name, values, width in series:
        pts = [(x, v) for x, v in zip(xs, values) if v is not None and math.isfinite(v) and v > 0]
        if pts:
            ax.plot(*zip(*pts), label=_label(name), linewidth=width)
    plotted = {"total", *ranked}
    spikes = []  # on the line that moved: the total's, or a plotted group's
    for x, p in zip(xs, report.points):
        moved = [g for g in p.spike_groups if g in plotted] if p.spike else []
        values = [p.groups[g] for g in moved]
        if p.spike and (p.z is not None and p.z > report.z_threshold or not moved):
            values.append(p.total_norm)
        spikes += [(x, v) for v in values if math.isfinite(v) and v > 0]
    if spikes:
        ax.scatter(*zip(*spikes), s=80, facecolors="none", edgecolors="red", zorder=3,
                   label="spike")
    bad = [x for x, p in zip(xs, report.points) if p.is_nonfinite]
    if bad:
        ax.scatter(bad, [top] * len(bad), marker="x", color="red", zorder=3,
                   label="non-finite")
    if finite:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    # A tag --tag named is that tag's values, not a norm (``TagRead``).
    ax.set_ylabel(f"{report.what} norm (p={report.norm_type:g})" if report.tag is None
                  else _label(tag_words(report.tag.name, str)))
    ax.set_title(plot_title(report))
    _save(fig, ax, path)


def write_autopsy_plot(report, path: Path) -> None:
    """``autopsy --plot``: the total and the top-ranked groups' series around the explained
    step (log scale), each group's onset marked with a ring, the explained step a line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    xs = list(report.around_steps)
    fig = Figure(figsize=(10, 5), dpi=100)
    ax = fig.add_subplot()
    series = [("total", list(report.total_around), 2.0, None)]
    series += [(g.name, list(g.around), 1.0, g.onset) for g in report.groups[:TOP_GROUPS]]
    finite = False
    for name, values, width, onset in series:
        pts = [(x, v) for x, v in zip(xs, values) if v is not None and math.isfinite(v) and v > 0]
        if not pts:
            continue
        finite = True
        (line,) = ax.plot(*zip(*pts), label=_label(name), linewidth=width)
        if onset is not None:
            at = [(x, v) for x, v in pts if x == onset.step]
            if at:
                ax.scatter(*zip(*at), s=90, facecolors="none", edgecolors=line.get_color(),
                           linewidths=2, zorder=3)
    if report.step is not None:
        ax.axvline(report.step, color="red", linestyle="--", linewidth=1,
                   label=f"step {report.step}")
    if finite:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm (the finest series)" if report.tag is None
                  else _label(tag_words(report.tag.name, str)))
    ax.set_title(_label(f"gradclip autopsy: {report.status}; rings mark each group's onset"))
    _save(fig, ax, path)


def _save(fig, ax, path: Path) -> None:
    """Grid and legend, then the figure drawn in memory and written to ``path`` at once
    (its suffix names the format): a failed drawing leaves no file."""
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix.lower().lstrip("."))
    data = buffer.getvalue()
    atomic_write(path, lambda file: file.write(data))
