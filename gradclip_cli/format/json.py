"""``--format json``: the contract's schema, for scripts.

JSON has no NaN or infinity, so non-finite numbers are written as the strings
"nan", "inf" and "-inf" (docs/reference/contract.md). Keys beyond the contract's are extras
a script may use but must not depend on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TextIO

from .words import nonfinite_name

if TYPE_CHECKING:  # the report package imports torch; help and usage errors must not
    from ..report import ClipReport, FailureReport, InspectReport, NonFinite
    from ..report.compare import CompareReport, CompareRow
    from ..report.norm_audit import NormAudit
    from ..report.trend import TrendReport

INSPECT_SCHEMA = "gradclip.inspect/1"
CLIP_SCHEMA = "gradclip.clip/1"
TREND_SCHEMA = "gradclip.trend/1"
COMPARE_SCHEMA = "gradclip.compare/1"
ERROR_SCHEMA = "gradclip.error/1"


def number(x: float | None) -> float | str | None:
    """A JSON number, or the contract's string for NaN and the infinities."""
    if x is None or math.isfinite(x):
        return x
    return nonfinite_name(x)


def nonfinite_object(n: NonFinite) -> dict[str, int]:
    """Non-finite counts as every gradclip JSON document writes them (the monitor's log too)."""
    return {"nan": n.nan, "posinf": n.posinf, "neginf": n.neginf}


def inspect_document(report: InspectReport, *, top: int = 0) -> dict[str, Any]:
    return {
        "schema": INSPECT_SCHEMA,
        "source": report.source,
        "what": report.what,
        "format": report.format,
        "step": report.step,
        "description": list(report.description),
        "measured": dict(report.measured),
        "roles": dict(report.roles),
        "key": report.key,
        "device": report.device,
        "norm_type": number(report.norm_type),
        "total_norm": number(report.total_norm),
        "max_abs": number(report.max_abs),
        "max_norm": number(report.max_norm),
        "num_tensors": report.num_tensors,
        "num_elements": report.num_elements,
        "nonfinite": nonfinite_object(report.nonfinite),
        "status": report.status,
        "overflow": report.overflow,
        "total_norm_log10": number(report.total_norm_log10),
        "group_by": report.group_by,
        "skipped": report.skipped,
        "groups": [
            {
                "name": g.name,
                "norm": number(g.norm),
                "share": number(g.share),
                "max_abs": number(g.max_abs),
                "num_tensors": g.num_tensors,
                "num_elements": g.num_elements,
                "nonfinite": nonfinite_object(g.nonfinite),
                **({"ratio": number(g.ratio)} if g.ratio is not None else {}),
            }
            for g in report.groups
        ],
        "tensors": [
            {
                "name": t.name,
                "group": t.group,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "norm": number(t.norm),
                "max_abs": number(t.max_abs),
                "nonfinite": nonfinite_object(t.nonfinite),
                "tied": list(t.tied),
                **({"ratio": number(t.ratio)} if t.ratio is not None else {}),
                "shares": list(t.shares),
            }
            for t in report.tensors
        ],
    }


def clip_document(report: ClipReport) -> dict[str, Any]:
    doc = asdict(report)
    del doc["refused"]  # a refused clip has no document: its line on stderr says why
    if not report.notes:
        del doc["notes"]  # an extra, where there is one
    doc["nonfinite"] = nonfinite_object(report.nonfinite)
    for k in ("norm_type", "max_norm", "clip_value", "total_norm_before", "clip_coef",
              "total_norm_after", "clip_coef_log2", "clip_coef_torch"):
        doc[k] = number(doc[k])
    return {"schema": CLIP_SCHEMA, **doc}


def trend_document(report: TrendReport) -> dict[str, Any]:
    return {
        "schema": TREND_SCHEMA,
        "what": report.what,
        "norm_type": number(report.norm_type),
        "group_by": report.group_by,
        "z_threshold": report.z_threshold,
        "alpha": report.alpha,
        "warmup": report.warmup,
        "fail_on": report.fail_on,
        "points": [
            {
                "source": p.source,
                "step": p.step,
                "what": p.what,
                "total_norm": number(p.total_norm),
                "groups": {name: number(norm) for name, norm in p.groups.items()},
                "nonfinite": None if p.nonfinite is None else nonfinite_object(p.nonfinite),
                "z": number(p.z),
                "spike": p.spike,
                "spike_groups": list(p.spike_groups),
                "nonfinite_groups": list(p.nonfinite_groups),
                "nonfinite_origin": None if p.nonfinite_origin is None else dict(
                    zip(("forward", "backward"), p.nonfinite_origin)),
            }
            for p in report.points
        ],
        "status": report.status,
        # The tracker tag --tag named, where the points are its values (an extra): "what"
        # says grads, as a log's points do; this says which scalar they are.
        "tag": None if report.tag is None else {
            "name": report.tag.name, "given_with": "--tag",
            "named_as_gradient_norm": report.tag.named_as_norm},
        # Where the points came from when a run folder held several series (extras).
        "series": [
            {"source": s.source, "kind": s.kind, "points": s.points, "per_group": s.per_group,
             "judged": s.judged, "why_not": s.why_not}
            for s in report.series
        ],
        "clipping": [
            {"source": c.source, "max_grad_norm": number(c.max_grad_norm),
             "clipped": c.clipped, "note": c.note,
             "monitor": None if c.monitor is None else {
                 "source": c.monitor.source, "logged_steps": c.monitor.logged,
                 "clipped_steps": c.monitor.clipped,
                 "clipped_to": [number(v) for v in c.monitor.limits]}}
            for c in report.clipping
        ],
        "notes": list(report.notes),
        # The norm audit: a framework's logged totals against gradclip's (extras).
        "audit": [_audit(a) for a in report.audits],
    }


def _audit(audit: NormAudit) -> dict[str, Any]:
    return {
        "framework": {"source": audit.framework.source, "kind": audit.framework.kind},
        "gradclip": {"source": audit.gradclip.source, "kind": audit.gradclip.kind},
        "precision": audit.precision,
        "tolerance": audit.tolerance,
        "steps_compared": len(audit.compared),
        "agrees": audit.agrees,
        "disagreements": [
            {"step": d.step, "framework": number(d.framework), "gradclip": number(d.gradclip),
             "relative_difference": number(d.relative)}
            for d in audit.disagreements
        ],
        # Steps whose framework total is the norm of the gradients gradclip had clipped.
        "after_gradclip_clip": list(audit.after_clip),
    }


def _compare_row(row: CompareRow) -> dict[str, Any]:
    return {"a": number(row.a), "b": number(row.b), "ratio": number(row.ratio)}


def compare_document(report: CompareReport) -> dict[str, Any]:
    return {
        "schema": COMPARE_SCHEMA,
        "a": report.a,
        "b": report.b,
        "what": report.what,
        "norm_type": number(report.norm_type),
        "group_by": report.group_by,
        "fail_above": report.fail_above,
        "total": _compare_row(report.total),
        "groups": [{"name": g.name, **_compare_row(g)} for g in report.groups],
        "status": report.status,
        **({"notes": list(report.notes)} if report.notes else {}),  # an extra
    }


def _write(doc: dict[str, Any], out: TextIO) -> None:
    # Indented for a person at a terminal; compact for pipes, where json's C
    # encoder (used only without indent) writes 20,000 tensors 10x faster.
    indent = 2 if out.isatty() else None
    out.write(json.dumps(doc, indent=indent, allow_nan=False))
    out.write("\n")


def render_inspect(report: InspectReport, out: TextIO, *, top: int = 0) -> None:
    _write(inspect_document(report), out)


def render_clip(report: ClipReport, out: TextIO) -> None:
    _write(clip_document(report), out)


def render_trend(report: TrendReport, out: TextIO) -> None:
    _write(trend_document(report), out)


def render_compare(report: CompareReport, out: TextIO) -> None:
    _write(compare_document(report), out)


def error_document(failure: FailureReport) -> dict[str, Any]:
    document = {"schema": ERROR_SCHEMA, "exit_code": failure.exit_code,
                "error": failure.message, "source": failure.source}
    if failure.notes:  # what --verify could not check (an extra key, as other reports')
        document["notes"] = list(failure.notes)
    return document


def render_error(failure: FailureReport, out: TextIO) -> None:
    # One line whatever the stream: a script reads the first line of stdout.
    out.write(json.dumps(error_document(failure)) + "\n")


AUTOPSY_SCHEMA = "gradclip.autopsy/1"


def autopsy_document(report) -> dict[str, Any]:
    """``gradclip.autopsy/1`` (docs/reference/contract.md, ``autopsy``); keys past the
    contract's are extras."""

    def onset(o):
        return None if o is None else {"step": o.step, "what": o.what, "source": o.source,
                                       "nonfinite": o.nonfinite, "history": number(o.history)}

    def change(c):
        return {"before": number(c.before), "after": number(c.after), "ratio": number(c.ratio),
                "before_step": c.before_step, "after_step": c.after_step,
                "before_source": c.before_source, "after_source": c.after_source}

    return {
        "schema": AUTOPSY_SCHEMA,
        "step": report.step,
        "status": report.status,
        "groups": [
            {
                "name": g.name,
                "rank": g.rank,
                "onset": None if g.onset is None else g.onset.step,
                "lead": g.lead,
                "changes": {q: change(c) for q, c in g.changes.items()},
                "outliers": None if g.outliers is None else number(g.outliers.fraction),
                "onset_detail": onset(g.onset),
                "outlier_counts": None if g.outliers is None else {
                    "count": g.outliers.count, "elements": g.outliers.elements,
                    "grads_source": g.outliers.grads_source,
                    "moment_source": g.outliers.moment_source},
                "around": [number(v) for v in g.around],
            }
            for g in report.groups
        ],
        "inputs": [{"source": i.source, "what": i.what, "steps": list(i.steps)}
                   for i in report.inputs],
        "verdict": report.verdict,
        "window": report.window,
        "outlier_k": report.outlier_k,
        "finest": report.finest,
        "spikes": list(report.spikes),
        "total_onset": onset(report.total_onset),
        "around_steps": list(report.around_steps),
        "total_around": [number(v) for v in report.total_around],
        "z_threshold": report.z_threshold,
        "alpha": report.alpha,
        "warmup": report.warmup,
        "notes": list(report.notes),
        # The tracker tag --tag named, where the finest series is its values (an extra).
        "tag": None if report.tag is None else {
            "name": report.tag.name, "given_with": "--tag",
            "named_as_gradient_norm": report.tag.named_as_norm},
    }


def render_autopsy(report, out: TextIO) -> None:
    _write(autopsy_document(report), out)
