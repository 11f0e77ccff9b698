"""The words every format uses: numbers, counts and the verdict lines.

One place for how a number is written (six significant digits; ``nan``,
``inf``, ``-inf``; ``-`` for none), how a ratio and a z-score read, and the
one-line verdicts that match the exit code, so the table, Markdown, GitHub
and JUnit reports say the same thing in the same words. Plain strings only:
nothing here imports rich (only the table draws with it) or torch.

Names that came from a file pass through ``visible`` here; each format
escapes the line further as its own data (Markdown, XML, workflow commands).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..report.model import EXCEEDED, INSUFFICIENT_HISTORY, NONFINITE, OVERFLOW
from ..report.tag import tag_words
from .text import visible

if TYPE_CHECKING:
    from ..report import ClipReport, InspectReport, NonFinite
    from ..report.compare import CompareReport, CompareRow
    from ..report.trend import TrendPoint, TrendReport


# -- numbers -------------------------------------------------------------------

def nonfinite_name(x: float) -> str:
    """How NaN and the infinities are written everywhere, JSON's strings included."""
    if math.isnan(x):
        return "nan"
    return "inf" if x > 0 else "-inf"


def fmt(x: float | None) -> str:
    """A number for people: six significant digits; ``-`` for none; nan, inf, -inf."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return nonfinite_name(x)
    return f"{x:.6g}"


def fmt_p(p: float) -> str:
    return "inf" if math.isinf(p) else f"{p:g}"


def fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    return fmt(ratio) + "x" if math.isfinite(ratio) else fmt(ratio)


def z_text(z: float | None) -> str:
    """A z-score for people: two decimals, or three digits once it is huge (a flat
    history makes any rise millions of standard deviations)."""
    if z is None:
        return "-"
    return f"{z:.2f}" if abs(z) < 1e4 else f"{z:.3g}"


def plural(count: int, singular: str, many: str | None = None) -> str:
    """``1 tensor``, ``2 tensors``, ``1,000 entries``."""
    word = singular if count == 1 else (many or singular + "s")
    return f"{count:,} {word}"


def nonfinite_text(n: NonFinite) -> str:
    """``1 nan, 2 +inf``: the non-zero counts."""
    parts = [f"{c} {label}" for c, label in ((n.nan, "nan"), (n.posinf, "+inf"),
                                             (n.neginf, "-inf")) if c]
    return ", ".join(parts)

# How a total beyond float64's range is shown (its float64 rounding is inf).
BEYOND_FLOAT64 = "> 1.8e308"


def fmt_total(report: InspectReport) -> str:
    return BEYOND_FLOAT64 if report.overflow else fmt(report.total_norm)


# -- what was judged --------------------------------------------------------------

@dataclass(frozen=True)
class Judged:
    """The quantity a verdict judged, in the words every format uses
    (docs/reference/contract.md: every verdict names it, never "gradients" for
    something that is not).

    ``plural``: "non-finite {plural}" (``gradients``, ``weights``, ``Adam exp_avg``);
    ``attribute``: "{attribute} total norm" (``gradient``, ``weight``, ``Adam exp_avg``);
    ``max_header``: the column of each row's largest magnitude (``max |g|`` for
    gradients alone).
    """

    what: str
    plural: str
    attribute: str
    max_header: str
    # A point's number: "{attribute} {norm}" ("gradient norm"), and the row's, as the
    # verdict and the table's column say it ("total norm"); a tag --tag named is a
    # value of that tag, not a norm (``TagRead``).
    norm: str = "norm"
    total: str = "total norm"


_NAMED = {"grads": ("gradients", "gradient", "max |g|"),
          "weights": ("weights", "weight", "max |w|")}


def judged(what: str, optimizer: str | None = None) -> Judged:
    """``what`` (``--what``, resolved) named for people; an optimizer quantity carries the
    name of the optimizer whose rule gave it, where known (``Adam exp_avg``)."""
    if what in _NAMED:
        return Judged(what, *_NAMED[what])
    name = f"{visible(optimizer)} {what}" if optimizer else what
    return Judged(what, name, name, "max abs")


def judged_in(report, show=visible) -> Judged:
    """What ``report`` (inspect, trend or compare) judged: a trend of a tag that ``--tag``
    named judged that tag's values, whatever its name ("'train/loss' (given with --tag)
    spike"). ``show``: how a name from a file is made safe (``str`` for findings, whose
    names each format escapes)."""
    tag = getattr(report, "tag", None)
    if tag is not None:
        name = tag_words(tag.name, show)
        return Judged(report.what, f"{name} values", name, "max abs", "value", "value")
    return judged(report.what, getattr(report, "optimizer", None))


def threshold_applied(report: InspectReport) -> str:
    """Where ``--what auto`` chose something other than gradients and ``--max-norm`` is
    given: what the threshold was applied to, and why (docs/reference/contract.md); else nothing."""
    if report.max_norm is None or not report.chosen_by_auto or report.what == "grads":
        return ""
    applied = judged_in(report).plural
    return f"; --max-norm applied to the {applied} (--what auto: no gradients saved)"


# -- inspect and clip -----------------------------------------------------------

def measured_line(report: InspectReport) -> str | None:
    """What was measured and the evidence (``measured: model weights (a state_dict: ...)``),
    as the table's header says it; None for a report that does not say (built by hand)."""
    explain, evidence = report.measured.get("explain"), report.measured.get("evidence")
    if not explain:
        return None
    # Gradients reconstructed with --previous: the cross-check goes with the evidence.
    check = report.measured.get("cross_check")
    checked = f"; {check['summary']}" if isinstance(check, dict) and \
        check.get("summary") else ""
    chosen = report.measured.get("chosen")
    # Its pieces are the description's, escaped where made: each format shows them as made.
    return (f"measured: {explain}" + (f" ({evidence})" if evidence else "")
            + (f"; {chosen}" if chosen else "") + checked)


def unchecked_total(report: InspectReport) -> str:
    """A NaN total that ``--max-norm`` could not be compared with under ``--allow-nonfinite``
    (a finding all the same): the verdict's words, and the CI formats' finding."""
    total = f"{judged_in(report).attribute} total norm"
    return (f"{total} {fmt(report.total_norm)} (p={fmt_p(report.norm_type)}): --max-norm "
            f"{fmt(report.max_norm)} could not be checked; non-finite values allowed by "
            f"--allow-nonfinite{threshold_applied(report)}")


def overflowed_total(report: InspectReport) -> str:
    """A total beyond float64's range (a finding of its own): the verdict's words, and the
    CI formats' finding."""
    about = report.total_norm_log10
    about = f"about 10^{about:.6g}, " if about is not None and math.isfinite(about) else ""
    return (f"{judged_in(report).attribute} total norm {BEYOND_FLOAT64} "
            f"({about}p={fmt_p(report.norm_type)}) is beyond float64's range"
            f"{threshold_applied(report)}")


def verdict_line(report: InspectReport) -> str:
    """The one line that matches the exit code: FAIL (exit 1) unless the status is ok.
    It names what was measured: ``FAIL: non-finite weights: ...``, ``OK: Adam exp_avg
    total norm ...``."""
    p = fmt_p(report.norm_type)
    what = judged_in(report)
    total = f"{what.attribute} total norm"
    applied = threshold_applied(report)
    if report.status == NONFINITE and report.allow_nonfinite:
        return f"FAIL: {unchecked_total(report)} (exit 1)"
    if report.status == OVERFLOW:
        return f"FAIL: {overflowed_total(report)} (exit 1)"
    if report.status == NONFINITE:
        n = report.nonfinite
        tensors = sum(1 for t in report.tensors if t.nonfinite.total)
        return (
            f"FAIL: non-finite {what.plural}: {n.nan} NaN, {n.posinf} +inf, {n.neginf} -inf "
            f"in {plural(tensors, 'tensor')}; total norm {fmt(report.total_norm)}{applied} "
            "(exit 1)"
        )
    if report.status == EXCEEDED:
        return (
            f"FAIL: {total} {fmt(report.total_norm)} (p={p}) exceeds --max-norm "
            f"{fmt(report.max_norm)}{applied} (exit 1)"
        )
    note = ""
    if report.nonfinite.total:
        note = (f"; {plural(report.nonfinite.total, 'non-finite value')} allowed by "
                "--allow-nonfinite")
    limit = f" <= --max-norm {fmt(report.max_norm)}" if report.max_norm is not None else ""
    return f"OK: {total} {fmt(report.total_norm)} (p={p}){limit}{note}{applied} (exit 0)"


def clip_summary(report: ClipReport) -> str:
    """What clip did, in one line: the totals before and after, and how."""
    if report.clip_value is not None:
        what = f"clamped every element to [-{fmt(report.clip_value)}, {fmt(report.clip_value)}]"
    elif report.clip_coef is not None and math.isnan(report.clip_coef):
        what = "scaled by nan: every gradient element is now NaN, as torch's clip_grad_norm_ does"
    elif report.clipped:
        what = f"scaled by {_fmt_coef(report)}"
    else:
        what = "unchanged: the total norm is within --max-norm"
    before = BEYOND_FLOAT64 if report.overflow else fmt(report.total_norm_before)
    return (f"gradient total norm (p={fmt_p(report.norm_type)}): {before} -> "
            f"{fmt(report.total_norm_after)}; {plural(report.num_tensors, 'tensor')} {what}")


def coef_lowered_line(report: ClipReport) -> str | None:
    """Where clip lowered torch's coefficient (``--max-norm`` on a narrow dtype), the
    line that says so, in every format; else None."""
    if not report.coef_lowered:
        return None
    torch_coef, coef = fmt(report.clip_coef_torch), fmt(report.clip_coef)
    if torch_coef == coef:  # six digits hide a change of a few units in the last place
        torch_coef, coef = f"{report.clip_coef_torch:.17g}", f"{report.clip_coef:.17g}"
    return (f"coefficient lowered from {torch_coef} (torch's) to {coef}: rounded to the "
            "stored dtype, the clipped total would exceed --max-norm")


def _fmt_coef(report: ClipReport) -> str:
    # A coefficient below float64's range still scaled exactly (as factors).
    if report.clip_coef == 0.0 and report.clip_coef_log2 is not None \
            and math.isfinite(report.clip_coef_log2):
        return f"2^{report.clip_coef_log2:.6g}"
    return fmt(report.clip_coef)


# -- trend ----------------------------------------------------------------------

def trend_quantity(report: TrendReport) -> str:
    """What a trend's points are, as its header says it: ``grads, p=2``; a tag that
    ``--tag`` named, as the tag (``'train/loss' (given with --tag)``), made visible."""
    if report.tag is not None:
        return judged_in(report).attribute
    return f"{visible(report.what)}, p={fmt_p(report.norm_type)}"


def point_state(p: TrendPoint) -> str:
    """A trend row's one word: non-finite, SPIKE, (history) before it is judged, or ok."""
    if p.is_nonfinite:
        return "overflow" if p.overflowed else "non-finite"
    if p.spike:
        return "SPIKE"
    if p.z is None and not any(v is not None for v in p.group_z.values()):
        return "(history)"
    return "ok"


def point_groups(p: TrendPoint) -> str:
    return ", ".join(visible(g) for g in p.spike_groups + p.nonfinite_groups)


def trend_verdict(report: TrendReport) -> str:
    """The last line of the table and Markdown reports, matching the exit code."""
    failing = report.failing
    what = judged_in(report)
    if report.disagreeing and not failing:
        return audit_verdict(report)
    if failing:
        last = failing[-1]
        kind = (nonfinite_words([last], what) if report.status == NONFINITE
                else f"{what.attribute} spike")
        where = f"step {last.step}" if last.step is not None else visible(last.source)
        groups = ", ".join(visible(g) for g in (last.nonfinite_groups + last.spike_groups))
        detail = (f"{where}: {what.total} {fmt(last.total_norm)}, z {z_text(last.z)}"
                  + (f"; groups {groups}" if groups else "") + origin_text(last))
        if report.fail_on == "newest":
            return f"FAIL: {kind} at the newest point ({detail}){_earlier(report)} (exit 1)"
        return f"FAIL: {_failing_kinds(failing, what)}; the last at {detail} (exit 1)"
    if report.status == INSUFFICIENT_HISTORY:
        return (f"OK: too little history to judge the {what.plural} (a point needs 5 earlier "
                f"points, counted from its series' first nonzero norm){_earlier(report)} (exit 0)")
    scope = "the newest point" if report.fail_on == "newest" else f"{len(report.points)} points"
    return (f"OK: no spike or non-finite {what.attribute} {what.norm} at {scope}"
            f"{_earlier(report)} "
            "(exit 0)")


def _failing_kinds(failing: list[TrendPoint], what) -> str:
    """``--fail-on any``'s failing points, non-finite and spikes counted apart: a spike
    is not a non-finite point, nor the reverse."""
    nonfinite = [p for p in failing if p.is_nonfinite]
    spikes = [p for p in failing if not p.is_nonfinite]
    if not spikes:
        return f"{nonfinite_words(nonfinite, what)} at {len(nonfinite)} point(s)"
    if not nonfinite:
        return f"{what.attribute} spike at {len(spikes)} point(s)"
    return (f"{what.attribute} spike or {nonfinite_words(nonfinite, what)} at {len(failing)} "
            f"point(s): {len(nonfinite)} {_flagged_word(nonfinite)} ({_steps(nonfinite)}), "
            f"{len(spikes)} spike(s) ({_steps(spikes)})")


def nonfinite_words(points: list[TrendPoint], what) -> str:
    """What flagged non-finite ``points`` hold: ``non-finite gradients``; where a point's
    counts say its values are finite (``TrendPoint.overflowed``), a norm beyond float64's
    range, as ``inspect`` says of such a total; where it holds no counts (a logged total:
    a Trainer's ``grad_norm``, a tracker's tag) and no norm of it is NaN, a non-finite
    norm, as ``compare`` says: an infinite logged norm may be finite gradients whose
    squares overflowed the logger's float32 arithmetic (torch's norm of 1e20s)."""
    kinds = {_nonfinite_kind(p) for p in points}
    words = {VALUES: f"non-finite {what.plural}",
             NORM: f"non-finite {what.attribute} {what.norm}",
             BEYOND_RANGE: f"{what.attribute} {what.norm} beyond float64's range"}
    return " or ".join(words[k] for k in (VALUES, NORM, BEYOND_RANGE) if k in kinds)


VALUES, NORM, BEYOND_RANGE = "values", "norm", "beyond-range"


def _nonfinite_kind(p: TrendPoint) -> str:
    """What a non-finite point is known to hold: non-finite values (counted, or a NaN
    norm: no overflow makes one), a norm beyond float64's range (counted finite), or
    only a non-finite norm (no counts, no NaN)."""
    if p.overflowed:
        return BEYOND_RANGE
    if p.nonfinite is None and not any(
            math.isnan(v) for v in (p.total_norm, *p.groups.values())):
        return NORM
    return VALUES


def _flagged_word(points: list[TrendPoint]) -> str:
    """How non-finite ``points`` are counted: ``non-finite``, ``overflow`` where every one
    overflowed, ``non-finite or overflow`` where both."""
    overflowed = {p.overflowed for p in points}
    return {frozenset({True}): "overflow", frozenset({False}): "non-finite"}.get(
        frozenset(overflowed), "non-finite or overflow")


def origin_text(p: TrendPoint) -> str:
    """``"; began in forward at M, backward at P"``: where the monitor located a non-finite
    value (``locate_nonfinite``), or nothing when it did not."""
    words = p.origin_words(visible)
    return f"; began: {words}" if words else ""


def _steps(points: list[TrendPoint]) -> str:
    where = [str(p.step) if p.step is not None else visible(p.source) for p in points[:5]]
    more = f" and {len(points) - 5} more" if len(points) > 5 else ""
    return ("step " if len(points) == 1 else "steps ") + ", ".join(where) + more


def _earlier(report: TrendReport) -> str:
    """Under ``--fail-on newest``: the earlier spikes and non-finite points, which do not
    fail the run but must not go unsaid (a NaN step a run recovered from, say)."""
    if report.fail_on != "newest":
        return ""
    earlier = report.points[:-1]
    nonfinite = [p for p in earlier if p.is_nonfinite]
    spikes = [p for p in earlier if p.spike and not p.is_nonfinite]
    parts = [f"{len(nonfinite)} {_flagged_word(nonfinite)} ({_steps(nonfinite)})"
             if nonfinite else "",
             f"{len(spikes)} spike(s) ({_steps(spikes)})" if spikes else ""]
    said = [part for part in parts if part]
    return f"; earlier: {', '.join(said)}" if said else ""


def audit_lines(report: TrendReport) -> list[str]:
    """One line per norm audit (report/norm_audit.py): which totals were held against
    which, over how many steps, within what tolerance, and where they disagree."""
    lines = []
    for a in report.audits:
        # A kind names the tracker's tag, as the file spells it: escaped as any name.
        pair = (f"{visible(a.framework.kind)} ({visible(a.framework.source)}) against "
                f"{visible(a.gradclip.kind)} ({visible(a.gradclip.source)})")
        within = f"{a.tolerance:.2g} relative ({a.precision} totals)"
        if a.after_clip:
            shown = ", ".join(map(str, a.after_clip[:5]))
            more = f" and {len(a.after_clip) - 5} more" if len(a.after_clip) > 5 else ""
            within += (f" (step{'s' if len(a.after_clip) > 1 else ''} {shown}{more} logged "
                       "after gradclip's clip: the norm of the clipped gradients)")
        n = len(a.compared)
        if a.agrees:
            lines.append(f"norm audit: {pair}: agree at all {n} step(s), within {within}")
            continue
        shown = ", ".join(f"step {d.step}: {fmt(d.framework)} vs {fmt(d.gradclip)}"
                          for d in a.disagreements[:3])
        more = f" and {len(a.disagreements) - 3} more" if len(a.disagreements) > 3 else ""
        lines.append(f"norm audit: {pair}: DISAGREE at {len(a.disagreements)} of {n} "
                     f"step(s), beyond {within}: {shown}{more}")
    return lines


def audit_verdict(report: TrendReport) -> str:
    """The verdict when the only finding is a norm audit that disagrees."""
    bad = report.disagreeing
    found = [d for a in bad for d in a.disagreements]
    first = bad[0].disagreements[0]
    # An infinite logged total of gradients whose exact norm is finite is the framework's
    # arithmetic overflowing (torch's float32 norm of gradients near 1e20), not a norm of
    # other gradients.
    overflowed = [d for d in found if math.isinf(d.framework) and math.isfinite(d.gradclip)]
    # Two logs of one run (a CSV and a TensorBoard logger) may disagree at the same step:
    # the verdict counts steps.
    steps = {d.step for d in found}
    if len(overflowed) == len(found):
        cause = ("the framework's norm overflowed (inf where the gradients' norm is finite: "
                 "its float32 or float16 sum of squares passed the dtype's range)")
    elif overflowed:
        cause = (f"the framework computed its norm over other gradients, or overflowed "
                 f"({len({d.step for d in overflowed})} step(s) inf where the gradients' "
                 "norm is finite)")
    else:
        cause = "the framework computed its norm over other gradients"
    return (f"FAIL: the logged total norm disagrees with gradclip's at {len(steps)} step(s) "
            f"(step {first.step}: {fmt(first.framework)} logged by "
            f"{visible(bad[0].framework.kind)}, {fmt(first.gradclip)} by gradclip); "
            f"{cause} (exit 1)")


# -- compare --------------------------------------------------------------------

def ratio_cell(row: CompareRow) -> str:
    """The B / A cell: the ratio, or which side alone holds the group."""
    if row.only is not None:
        return f"only in {row.only.upper()}"
    return fmt_ratio(row.ratio)


def _names(rows: list[CompareRow], label=lambda g: visible(g.name)) -> str:
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    return ", ".join(label(g) for g in rows[:5]) + more


def nonfinite_rows(report: CompareReport) -> list[CompareRow]:
    """The groups whose norm is NaN or infinite in A or B, in the report's order (first:
    docs/reference/contract.md counts them the largest change)."""
    return [g for g in report.groups if g.nonfinite]


def compare_verdict(report: CompareReport) -> str:
    what = judged_in(report)
    if report.status == NONFINITE:
        rows = nonfinite_rows(report)
        named = _names(rows, lambda g: f"{visible(g.name)} ({fmt(g.a)} in A, {fmt(g.b)} in B)")
        total = report.total
        where = (f"{len(rows)} group(s): {named}" if rows else
                 f"the total ({fmt(total.a)} in A, {fmt(total.b)} in B)")
        return f"FAIL: non-finite {what.attribute} norm in {where} (exit 1)"
    if report.status == EXCEEDED:
        limit = f"{report.fail_above:g}x"
        parts = []
        if report.total_beyond:
            parts.append(f"the total changed {fmt_ratio(report.total.ratio)}, beyond {limit}")
        if report.beyond:
            parts.append(f"{len(report.beyond)} group(s) changed by more than {limit}: "
                         f"{_names(report.beyond)}")
        if report.one_sided:
            parts.append(f"{len(report.one_sided)} group(s) on one side only: "
                         + _names(report.one_sided,
                                  lambda g: f"{visible(g.name)} ({g.only.upper()} only)"))
        return f"FAIL: {what.attribute} norms: {'; '.join(parts)} (exit 1)"
    limit = f" within {report.fail_above:g}x" if report.fail_above is not None else ""
    alone = (f"; {len(report.one_sided)} group(s) on one side only"
             if report.one_sided else "")
    return (f"OK: {what.attribute} total ratio {fmt_ratio(report.total.ratio)}{limit}{alone} "
            "(exit 0)")


def group_rule(thresholds: list[tuple[int, float]]) -> str:
    """Words for the groups' threshold (a report's ``group_thresholds()``), to go before
    the averages' parameters: ``"a group: z > 3.03, 5 groups at once; "``, or ``""``
    where no point holds more than one group."""
    if not thresholds:
        return ""
    (fewest, low), (most, high) = thresholds[0], thresholds[-1]
    if fewest == most:
        return f"a group: z > {low:.3g}, {fewest} groups at once; "
    return f"a group: z > {low:.3g} to {high:.3g}, {fewest} to {most} groups at once; "
