"""``gradclip inspect``: load, measure, report. Never writes the input."""

from __future__ import annotations

from pathlib import Path

from .. import options
from ..distributed import launcher
from ..errors import InputError, UsageError
from ..progress import Steps, progress_steps
from ..report import build_inspect_report, parse_group_by
from ..report.build import inspect_header
from ..report.outcome import exit_code
from ..source.not_a_checkpoint import run_folder_message, trend_hint
from ..source.roles import role_counts
from ..source.vocabulary import checkpoint_step
from .common import Loaded, Releasers, load, measure, speaks
from .output import Output
from .previous import load_pair


def run(
    *, path: str, key: str | None, norm_type: str, device: str, format: str,
    max_norm: str | None, allow_nonfinite: bool, verify: bool, group_by: str, top: int,
    trust_pickle: bool, quiet: bool, output_file: Path | None, what: str = "auto",
    progress: bool = True, previous: str | None = None,
) -> int:
    output = Output.of(format, output_file, quiet=quiet, top=top,
                       reads=[path] if previous is None else [path, previous])
    report = build(path=path, key=key, norm_type=norm_type, device=device, max_norm=max_norm,
                   allow_nonfinite=allow_nonfinite, verify=verify, group_by=group_by,
                   trust_pickle=trust_pickle, what=what, progress=progress, output=output,
                   previous=previous)
    output.emit(report)
    return exit_code(report)


def build(
    *, path: str, key: str | None, norm_type: object, device: str, max_norm: object,
    allow_nonfinite: bool, verify: bool, group_by: str, trust_pickle: bool, what: str,
    progress: bool, output: Output | None = None, launched: bool = True,
    previous: str | None = None,
):
    """The ``InspectReport`` of ``path`` (``report/model.py``), which every format renders.

    ``output``: where the report goes, checked against every file a layout
    reads. ``launched``: under a launcher (``torchrun``) the ranks share the
    work, as the command does; the Python API passes False and measures in
    this process. ``previous``: the checkpoint one optimizer step before
    ``path``, whose Adam state with ``path``'s determines the gradients of that
    step (``--previous``).
    """
    if previous is not None and what not in ("auto", "grads"):
        raise UsageError(f"--previous reconstructs the gradients of one optimizer step: it "
                         f"measures --what grads, not --what {what}")
    p = options.norm_type(norm_type)
    threshold = options.threshold("--max-norm", max_norm, allow_zero=True)
    dev = options.device(device)
    rule = parse_group_by(group_by)
    session = launcher.join(dev, device, [path] if previous is None else [path, previous]) \
        if launched else None
    if session is not None:
        dev = session.device
    check = None
    with progress_steps(not progress or not speaks()) as steps:
        if previous is None:
            loaded = _load(path, key, trust_pickle, verify, steps, what)
            files = loaded.contents.files
        else:
            loaded, check, files = load_pair(path, previous, key, trust_pickle, verify, steps,
                                             dev)
        if output is not None:
            output.check(reads=files)
        # inspect never writes a tensor, so pages read can go back at once:
        # resident memory stays flat whatever the file's size.
        measurement = measure(loaded, p, dev, steps, "computing norms", Releasers(files),
                              session, weights=True)
    contents, selection = loaded.contents, loaded.selection
    # One step rule with trend's (source/vocabulary.py): what the checkpoint records,
    # else a step-numbered name, its own or its folder's.
    step = checkpoint_step(contents.step,
                           None if loaded.checkpoint is None else loaded.checkpoint.root, path)
    return build_inspect_report(
        measurement, tensors=loaded.tensors, ties=loaded.ties, group_rule=rule, source=path,
        format=contents.kind, key=loaded.key, device=str(dev), max_norm=threshold,
        allow_nonfinite=allow_nonfinite, group_by=group_by, skipped=loaded.skipped,
        what=selection.what, step=step.step, roles=role_counts(contents),
        optimizer=selection.optimizer, chosen_by_auto=what == "auto",
        **inspect_header(contents, selection, step, check, auto=what == "auto"),
    )  # fmt: skip


def _load(path: str, key: str | None, trust_pickle: bool, verify: bool, steps: Steps,
          what: str) -> Loaded:
    try:
        return load(path, key, trust_pickle, verify, steps, what)
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
