"""Inspect a checkpoint and trend a run from Python: the reports the commands format.

``gradclip inspect`` and ``gradclip trend`` build one plain report object
each (``report/``) and hand it to a format; these functions return that
object, so a script or a notebook reads the numbers without running the CLI
and parsing its JSON::

    >>> import gradclip_cli as gradclip
    >>> report = gradclip.inspect("out/checkpoint-500")        # InspectReport
    >>> report.what, report.total_norm, report.status
    ('exp_avg', 0.191, 'ok')
    >>> [(g.name, g.norm) for g in report.groups][:2]
    >>> run = gradclip.trend(["out/"])                          # TrendReport
    >>> [p.step for p in run.points if p.spike]
    >>> print(gradclip.render(run, "markdown"))                 # as --format markdown

They take the commands' options as keyword arguments, with the same names
and meanings (``--norm-type`` is ``norm_type=``) and the same defaults, and
measure in this process: under ``torchrun`` they do not split the work
across ranks as the commands do (each rank measures all of it). Nothing is
printed and nothing is written.

Errors raise :class:`~gradclip_cli.errors.GradclipError` (never
``SystemExit``): ``str(error)`` and ``error.message`` are the one line the
command prints, ``error.exit_code`` its exit code (2: a bad argument, 3: an
input that cannot be read, holds nothing to measure, or is refused as
unsafe). Its subclasses ``UsageError`` (2) and ``InputError`` (3) tell the
two apart. A finding (a NaN, a total above ``max_norm``, a spike) is not an
error: it is the report's ``status``, and :func:`exit_code` gives the code
the command would exit with.

``autopsy`` returns the report of ``gradclip autopsy``: where a spike began and
what changed across it (docs/reference/contract.md, "Over time").
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import GradclipError, InputError

if TYPE_CHECKING:
    from .report.autopsy import AutopsyReport
    from .report.model import InspectReport
    from .report.trend import TrendReport

__all__ = ["autopsy", "exit_code", "inspect", "render", "trend"]

PathLike = str | os.PathLike[str]


def inspect(
    path: PathLike,
    *,
    what: str = "auto",
    key: str | None = None,
    norm_type: float | str = 2.0,
    group_by: str = "layer",
    device: str = "cpu",
    max_norm: float | None = None,
    allow_nonfinite: bool = False,
    verify: bool = False,
    trust_pickle: bool = False,
    previous: PathLike | None = None,
) -> InspectReport:
    """Measure one checkpoint, as ``gradclip inspect PATH``: its ``InspectReport``.

    Args:
        path: a checkpoint: a file, a sharded index or its folder, a DCP
            folder, a training framework's checkpoint folder (the contract's
            PATH). Never written.
        what: ``grads``, ``exp_avg``, ``grad_rms``, ``update``, ``weights``
            or ``auto`` (gradients if saved, else Adam's first moment, else
            the weights); ``report.what`` says which was measured and
            ``report.measured`` the evidence.
        key: dotted path to the gradients inside a nested checkpoint.
        norm_type: p of the p-norm, > 0 or ``inf``.
        group_by: ``layer``, ``module``, ``tensor``, ``depth:N`` or
            ``regex:PATTERN``.
        device: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto``.
        max_norm: a threshold: a total above it makes ``status``
            ``"exceeded"``.
        allow_nonfinite: NaN/inf are reported but are not a finding.
        verify: check every stored checksum first (a mismatch raises).
        trust_pickle: allow full unpickling (runs code from the file).
        previous: the checkpoint one optimizer step before ``path``: the gradients
            of that step, reconstructed from the two Adam-family states
            (``--previous``; ``what`` must be ``grads`` or ``auto``).

    Returns:
        The report every ``--format`` renders: ``total_norm``, ``max_abs``,
        ``nonfinite``, ``status`` (``ok``, ``exceeded``, ``nonfinite``,
        ``overflow``), ``groups`` and ``tensors`` (rows with ``norm``,
        ``max_abs``, ``ratio`` to the weights where known), ``what``,
        ``step``, ``description`` (the header's lines: what was read and
        why). Norms are floats, accurate to 1e-6 relative in every dtype.

    Raises:
        GradclipError: with the command's one-line message and exit code.
    """
    from .commands import inspect as command

    with _as_the_command():
        return command.build(
            path=os.fspath(path), key=key, norm_type=norm_type, device=device,
            max_norm=max_norm, allow_nonfinite=allow_nonfinite, verify=verify,
            group_by=group_by, trust_pickle=trust_pickle, what=what, progress=False,
            launched=False, previous=None if previous is None else os.fspath(previous),
        )  # fmt: skip


def trend(
    paths: PathLike | Iterable[PathLike],
    *,
    what: str = "auto",
    group_by: str | None = None,
    norm_type: float | str | None = None,
    z: float | None = None,
    alpha: float | None = None,
    warmup: int | None = None,
    fail_on: str = "newest",
    key: str | None = None,
    device: str = "cpu",
    verify: bool = False,
    trust_pickle: bool = False,
    tag: str | None = None,
    run: str | None = None,
    exclude: Iterable[str] = (),
) -> TrendReport:
    """Norms over a run, as ``gradclip trend PATH...``: its ``TrendReport``.

    Args:
        paths: one path or several: checkpoints, folders of them (an HF
            ``output_dir``), ``trainer_state.json`` files, GradMonitor logs.
        what: as :func:`inspect`; one trend judges one quantity.
        group_by: regroups checkpoints' tensors; None keeps a log's own
            groups (and ``layer`` for checkpoints). A log cannot be
            regrouped: giving it with a log raises.
        norm_type: None: the logs' own p, else 2.
        z, alpha, warmup: the spike rule's threshold, averaging factor and
            warm-up (None: 2.5, 0.97, 25).
        fail_on: ``newest`` or ``any``: which points make :func:`exit_code` 1.
        key, device, verify, trust_pickle: as :func:`inspect`.
        tag: the tracker tag to read as the gradient norm (``--tag``).
        run: which run of a tracker's store holding several (``--run``).
        exclude: globs of inputs to leave out (``--exclude``).

    Returns:
        ``points`` (each with ``step``, ``source``, ``total_norm``,
        ``groups``, ``z``, ``spike``, ``spike_groups``), ``status`` (``ok``,
        ``spike``, ``nonfinite``, ``insufficient_history``) and, for run
        folders, ``series`` (every series found, which one was judged),
        ``clipping`` (who clipped: the Trainer, gradclip's monitor) and
        ``notes``.

    Raises:
        GradclipError: with the command's one-line message and exit code.
    """
    from .commands import trend as command

    with _as_the_command():
        return command.build(
            paths=_paths(paths), what=what, group_by=group_by, z=z, alpha=alpha,
            warmup=warmup, fail_on=fail_on, key=key, norm_type=norm_type, device=device,
            trust_pickle=trust_pickle, verify=verify, progress=False, launched=False,
            tag=tag, run_name=run, exclude=tuple(exclude),
        )  # fmt: skip


def autopsy(
    paths: PathLike | Iterable[PathLike],
    *,
    step: int | None = None,
    window: int = 50,
    outlier_k: float = 6.0,
    key: str | None = None,
    device: str = "cpu",
    verify: bool = False,
    trust_pickle: bool = False,
    tag: str | None = None,
    run: str | None = None,
    exclude: Iterable[str] = (),
) -> AutopsyReport:
    """Take a spike apart, as ``gradclip autopsy PATH...``: its ``AutopsyReport``.

    Args:
        paths: as :func:`trend`: run folders, checkpoints, monitor logs and their
            dumps, ``trainer_state.json``, trackers' files; every grain they hold
            is read.
        step: the step to explain; None: the newest spike or non-finite step of
            the finest series.
        window: how many steps before it an onset is looked for.
        outlier_k: count gradient elements with ``|g| > k * sqrt(v_hat)``.
        key, device, verify, trust_pickle, tag, run, exclude: as :func:`trend`.

    Returns:
        ``status`` (``explained``, ``nothing``, ``insufficient``), ``step``,
        ``groups`` ranked (each with ``onset``, ``lead``, ``changes`` per
        quantity with ``before``, ``after``, ``ratio``, and ``outliers``),
        ``inputs`` and ``verdict``.

    Raises:
        GradclipError: with the command's one-line message and exit code.
    """
    from .commands import autopsy as command

    with _as_the_command():
        return command.build(
            paths=_paths(paths), step=step, window=window, outlier_k=outlier_k,
            key=key, device=device, trust_pickle=trust_pickle, verify=verify, progress=False,
            tag=tag, run_name=run, exclude=tuple(exclude), launched=False,
        )  # fmt: skip


def render(report: Any, format: str = "table", *, top: int = 5) -> str:
    """``report`` as ``--format FORMAT`` writes it: ``table``, ``json``, ``markdown``,
    ``github`` or ``junit`` (``json.loads`` of the json is the contract's document);
    ``top``: an inspect report's largest tensors listed, as ``--top``."""
    from .format import names
    from .format import render as draw
    from .report.autopsy import AutopsyReport
    from .report.model import InspectReport
    from .report.trend import TrendReport
    from .values import word

    with _as_the_command():
        name = word("format", format, names())
        if not isinstance(report, (InspectReport, TrendReport, AutopsyReport)):
            raise TypeError("render: an InspectReport, TrendReport or AutopsyReport, got "
                            f"{type(report)!r}")
        buffer = io.StringIO()
        draw(name, report, buffer, top=top)
        return buffer.getvalue()


def exit_code(report: Any) -> int:
    """The exit code the command would end with for ``report``: 0 no finding, 1 a finding."""
    from .report.outcome import exit_code as code

    return code(report)


def _paths(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    """One path or several, as the commands' ``PATH...`` takes them."""
    return [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]


@contextmanager
def _as_the_command():
    """Run a command's steps in this process as the CLI runs them, and leave it as found.

    The commands make torch's intra-op threads their own workers
    (``commands/common.py`` sets torch to one thread when it is imported): the
    caller's thread count is put back after each call. An error that the CLI
    turns into a one-line exit 3 (a file the OS cannot read, a value torch
    refuses) is raised as an ``InputError`` with that line, as the CLI prints it.
    """
    import torch

    threads = torch.get_num_threads()
    try:
        from .commands import common  # noqa: F401  (sets one thread on first import)

        torch.set_num_threads(1)
        yield
    except GradclipError:
        raise
    except (OSError, RuntimeError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise InputError(f"{type(error).__name__}: {first_line}") from error
    finally:
        torch.set_num_threads(threads)
