"""``gradclip inspect``: load, measure, report. Never writes the input."""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from pathlib import Path

from .. import options
from ..distributed import launcher
from ..errors import InputError, UsageError
from ..escaping import visible
from ..format.words import verdict_line
from ..progress import progress_steps
from ..report import OK, build_inspect_report, parse_group_by
from ..source.roles import role_counts
from ..source.vocabulary import NUMBERED_NAME, checkpoint_step, last_number
from .common import Releasers, emit, load, measure, measure_weights, output_format, speaks
from .previous import load_pair


def run(
    *, path: str, key: str | None, norm_type: str, device: str, format: str,
    max_norm: str | None, allow_nonfinite: bool, verify: bool, group_by: str, top: int,
    trust_pickle: bool, quiet: bool, output_file: Path | None, what: str = "auto",
    progress: bool = True, previous: str | None = None,
) -> int:
    # First: an error document (--format json) goes to --output-file too.
    reads = [path] if previous is None else [path, previous]
    options.report_file(output_file, reads=reads)
    if previous is not None and what not in ("auto", "grads"):
        raise UsageError(f"--previous reconstructs the gradients of one optimizer step: it "
                         f"measures --what grads, not --what {what}")
    fmt = output_format(format)
    report = build(path=path, key=key, norm_type=norm_type, device=device, max_norm=max_norm,
                   allow_nonfinite=allow_nonfinite, verify=verify, group_by=group_by,
                   trust_pickle=trust_pickle, what=what, progress=progress,
                   output_file=output_file, previous=previous)
    if quiet and format == "table":
        # -q: the verdict alone on stdout; what the finding is goes to stderr.
        from ..format import table

        if speaks():
            table.print_findings(report, sys.stderr)
        emit(lambda out: table.print_verdict(report, out), output_file, verdict_line(report))
    else:
        emit(lambda out: fmt.render_inspect(report, out, top=top), output_file,
             verdict_line(report))
    return 0 if report.status == OK else 1


def build(
    *, path: str, key: str | None, norm_type: object, device: str, max_norm: object,
    allow_nonfinite: bool, verify: bool, group_by: str, trust_pickle: bool, what: str,
    progress: bool, output_file: Path | None = None, launched: bool = True,
    previous: str | None = None,
):
    """The ``InspectReport`` of ``path`` (``report/model.py``), which every format renders.

    ``launched``: under a launcher (``torchrun``) the ranks share the work, as
    the command does; the Python API passes False and measures in this process.
    ``previous``: the checkpoint one optimizer step before ``path``, whose Adam state
    with ``path``'s determines the gradients of that step (``--previous``).
    """
    p = options.norm_type(norm_type)
    threshold = options.threshold("--max-norm", max_norm, allow_zero=True)
    dev = options.device(device)
    rule = parse_group_by(group_by)
    reads = [path] if previous is None else [path, previous]
    session = launcher.join(dev, device, reads) if launched else None
    if session is not None:
        dev = session.device
    check = None
    with progress_steps(not progress or not speaks()) as steps:
        if previous is not None:
            loaded, check, files = load_pair(path, previous, key, trust_pickle, verify, steps,
                                             dev)
        else:
            try:
                loaded = load(path, key, trust_pickle, verify, steps, what)
            except InputError as error:
                # A run's folder is not one checkpoint: say what it is instead of every
                # layout it is not, and where to go (trend, or its newest checkpoint).
                run = run_folder_message(path)
                if run is not None:
                    raise InputError(run) from None
                hint = trend_hint(path)
                if hint is None:
                    raise
                raise InputError(f"{error}; {hint}") from None
            files = loaded.contents.files
        options.report_file(output_file, reads=files)
        # inspect never writes a tensor, so pages read can go back at once:
        # resident memory stays flat whatever the file's size.
        release = Releasers(files)
        sums, owned = measure(loaded, p, dev, steps, "computing norms", release, session)
        weight_sums = measure_weights(loaded, p, dev, release, session)
    contents, selection = loaded.contents, loaded.selection
    # One step rule with trend's (source/vocabulary.py): what the checkpoint records,
    # else a step-numbered name, its own or its folder's.
    step = checkpoint_step(contents.step,
                           None if loaded.checkpoint is None else loaded.checkpoint.root, path)
    counts, owned_counts = loaded.counts()
    report = build_inspect_report(
        names=loaded.names, tensors=loaded.tensors, sums=sums, owned=owned,
        counts=counts, owned_counts=owned_counts,
        ties=loaded.ties, shares=loaded.shares,
        group_rule=rule, source=path, format=contents.kind,
        key=loaded.key, device=str(dev), max_norm=threshold,
        allow_nonfinite=allow_nonfinite, group_by=group_by, skipped=loaded.skipped,
        what=selection.what, step=step.step,
        description=[*contents.description, *([step.note] if step.note else []),
                     *([selection.ids_note] if selection.ids_note else []),
                     *_buffers_apart(contents, selection.what),
                     f"measured: {selection.measured}",
                     *([] if check is None else check.lines)],
        measured={"what": selection.what, "explain": selection.explain,
                  "evidence": selection.evidence,
                  **({} if check is None else {"cross_check": check.disagreement.as_json()})},
        roles=role_counts(contents),
        weight_sums=weight_sums,
        optimizer=selection.optimizer,
        chosen_by_auto=what == "auto",
    )
    # The lines of the description every format carries (markdown, github, junit too).
    notes = [*([step.note] if step.note else []),
             *([selection.ids_note] if selection.ids_note else [])]
    return dataclasses.replace(report, notes=notes) if notes else report


_SCANNED = 1000  # children looked at for a hint; a refusal never waits on a huge folder


def _is_log(path: Path) -> bool:
    from ..source.logs.recognise import log_kind

    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False
    return regular and log_kind(path) is not None


def run_folder_message(path: str) -> str | None:
    """Where ``path`` is a run's folder (numbered checkpoint folders: an HF
    ``output_dir``, DeepSpeed's ``global_stepN/``; per-step checkpoint files; a
    norm log), the one line inspect says instead of its refusal: what it is,
    ``gradclip trend PATH``, and the newest checkpoint in it to inspect. None
    for anything else (a layout that recognises it gives its own refusal)."""
    p = Path(path)
    if not p.is_dir():
        return None
    from ..source.layouts import LAYOUTS, deepspeed, hf_sharded

    if any(layout.recognises(p) for layout in LAYOUTS) or deepspeed.near_miss(p) is not None:
        return None  # a layout's own refusal says more (DeepSpeed's: what is missing)
    try:
        children = sorted(c for _, c in zip(range(_SCANNED), p.iterdir()))
    except OSError:
        return None
    if any(c.name.endswith(hf_sharded.INDEX_SUFFIX) for c in children):
        return None  # a sharded set's folder: its shards number parts, not steps
    folders = [c for c in children if NUMBERED_NAME.fullmatch(c.name) and c.is_dir()]
    files = [c for c in children if _step_of_name(c.name) is not None and _is_checkpoint_file(c)]
    trend = f"for norms over the run use 'gradclip trend {visible(path)}'"
    numbered = folders or files
    if numbered:
        numbered.sort(key=lambda c: (_step_of_name(c.name) or 0, c.name))
        what = "numbered checkpoints" if folders else "per-step checkpoint files"
        span = visible(numbered[0].name) if len(numbered) == 1 else \
            f"{visible(numbered[0].name)} .. {visible(numbered[-1].name)}"
        newest = visible(os.path.join(path, numbered[-1].name))
        return (f"{visible(path)}: a run's folder of {len(numbered)} {what} ({span}), not one "
                f"checkpoint: {trend}; to inspect the newest, 'gradclip inspect {newest}'")
    logs = [c for c in children if c.suffix in (".json", ".jsonl") and _is_log(c)]
    if logs:
        return (f"{visible(path)}: a run's folder with a log of gradient norms "
                f"({visible(logs[0].name)}), not one checkpoint: {trend}")
    return None


def _step_of_name(name: str) -> int | None:
    """The last number in a name's stem (``step_19.pt`` -> 19), the order trend gives."""
    return last_number(name.split(".", 1)[0])


def _is_checkpoint_file(path: Path) -> bool:
    """A regular file whose first bytes one of the file readers recognises."""
    from ..source import READERS
    from ..source.files.small_file import read_head

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        head = read_head(path, 64, what="a checkpoint file")
    except (OSError, InputError):
        return False
    return any(reader.recognises(head) for reader in READERS)


def trend_hint(path: str) -> str | None:
    """Where inspect refuses a run's logs or its output folder: the command that reads them.

    A ``trainer_state.json`` or a monitor's ``grads.jsonl`` holds norms over
    steps, and an ``output_dir`` holds several checkpoints: ``trend`` reads
    both (docs/reference/contract.md, "Over time"); inspect reads one checkpoint.
    """
    p = Path(path)
    if _is_log(p):
        what = "a log of gradient norms over steps"
    elif p.is_dir():
        from ..source.layouts import LAYOUTS

        if any(layout.recognises(p) for layout in LAYOUTS):
            return None  # a checkpoint: its own refusal says what it holds
        try:
            children = [c for _, c in zip(range(_SCANNED), p.iterdir())]
        except OSError:
            return None
        if any(NUMBERED_NAME.fullmatch(c.name) and c.is_dir() for c in children):
            what = "a run's folder of numbered checkpoints"
        elif any(c.suffix in (".json", ".jsonl") and _is_log(c) for c in children):
            what = "a run's folder with a log of gradient norms"
        else:
            return None
    else:
        return None
    return f"it is {what}: for norms over the run use 'gradclip trend {path}'"


def _buffers_apart(contents, what: str) -> list[str]:
    """The buffers set apart from the weights, named (a few), when weights are measured."""
    buffers = list(contents.buffers or ())
    if what != "weights" or not buffers:
        return []
    more = f" and {len(buffers) - 3} more" if len(buffers) > 3 else ""
    return [f"buffers, not weights: {visible(', '.join(buffers[:3]))}{more}"]
