"""The ``gradclip`` command: declares options and wires each command's module.

Nothing here computes or reads files itself; each command's steps live in
``commands/`` and are imported only when that command runs (so ``--help``
and usage errors never import torch). This module maps the outcome to the
contract's exit codes: 0 no finding, 1 a finding (or a refused clip), 2 usage
error, 3 unreadable input or unwritable output.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import traceback
import warnings
from pathlib import Path

import typer

from .errors import GradclipError

# torch warns on import when numpy is absent; gradclip never needs numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Gradient diagnostics for PyTorch checkpoints: accurate norms, non-finite "
    "flags, clipped copies. Exit codes: 0 ok, 1 finding, 2 usage error, 3 unreadable input.",
)

PATH_HELP = ("A checkpoint: a torch.save or .safetensors file, a sharded index or its folder, "
             "a Trainer checkpoint-N/ folder, a Lightning .ckpt.")

# Options both commands take.
KeyOpt = typer.Option(
    None, "--key", metavar="K",
    help="Dotted path to the gradients (grads, state.grads); an integer indexes a list.",
)
NormOpt = typer.Option("2", "--norm-type", metavar="P",
                       help="p of the p-norm: any number > 0, or inf.")
DeviceOpt = typer.Option("cpu", "--device", metavar="DEVICE",
                         help="cpu, cuda, cuda:N, mps or auto.")
FormatOpt = typer.Option(
    "table", "--format", metavar="FORMAT",
    help="table (for people), json (for scripts), markdown (a PR comment or "
    "$GITHUB_STEP_SUMMARY), github (GitHub Actions annotations) or junit (JUnit XML).",
)
OutputFileOpt = typer.Option(
    None, "--output-file", metavar="FILE",
    help="Write the report to FILE (atomically) instead of stdout.",
)
TrustOpt = typer.Option(
    False, "--trust-pickle",
    help="Allow full unpickling: runs code from the file. Trusted files only.",
)
QuietOpt = typer.Option(
    False, "--quiet", "-q",
    help="Print only the verdict line (findings also on stderr); the exit code is unchanged.",
)
NoProgressOpt = typer.Option(False, "--no-progress", help="No progress display on stderr.")
PathArg = typer.Argument(..., metavar="PATH", show_default=False, help=PATH_HELP)
DebugOpt = typer.Option(False, "--debug", help="Show Python tracebacks on errors.")
AllowOpt = typer.Option(
    False, "--allow-nonfinite", help="Report NaN/inf gradients without treating them as a finding."
)
WhatOpt = typer.Option(
    "auto", "--what", metavar="WHAT",
    help="grads, exp_avg, grad_rms, update, weights or auto (grads if saved, else exp_avg).",
)
VerifyOpt = typer.Option(
    False, "--verify", help="Check every stored checksum before trusting the data."
)


def _show_version(value: bool) -> None:
    if value:
        from . import __version__

        print(f"gradclip {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_show_version,
        help="Print gradclip's version and exit.",
    ),
) -> None:
    """Gradient diagnostics for PyTorch checkpoints: accurate norms, non-finite flags, clipped
    copies. Exit codes: 0 ok, 1 finding, 2 usage error, 3 unreadable input."""


# The formats that carry a failure on stdout (or in --output-file) besides the line
# on stderr; a table is for a person, who reads stderr.
FAILURE_FORMATS = ("json", "junit", "github", "markdown")


def _report_error(message: str, code: int, *, format: str | None, source: object,
                  command: str = "gradclip", output_file: Path | None = None) -> None:
    """One line on stderr; with a CI format also that format's failure document.

    ``--format json`` prints the contract's ``gradclip.error/1`` object,
    ``junit`` a testcase with an ``<error>``, ``github`` an ``::error`` line,
    ``markdown`` a failure line: a report file is never silently empty.
    Paths are reported as given (``./h.pt`` stays ``./h.pt``): they arrive as
    strings, never normalised through ``Path``.

    The message names paths and keys that came from a file or the command
    line: ``visible`` keeps it one inert line (no escape sequence, no newline
    forging a second line); each format escapes it further as its data.
    """
    from .format.text import visible

    message = visible(message)
    print(f"gradclip: {message}", file=sys.stderr)
    if format not in FAILURE_FORMATS:
        return
    import io

    from .format import FORMATS
    from .report.model import FailureReport

    failure = FailureReport(command=command, message=message, exit_code=code,
                            source=None if source is None else str(source))
    buffer = io.StringIO()
    FORMATS[format].render_error(failure, buffer)
    document = buffer.getvalue()
    if output_file is not None:
        from .sink.atomic import atomic_write

        try:
            atomic_write(Path(output_file), lambda file: file.write(document.encode("utf-8")))
            return
        except GradclipError as error:
            if str(error) != message:  # --output-file itself was the error: say it once
                print(f"gradclip: {error}", file=sys.stderr)
    sys.stdout.write(document)
    sys.stdout.flush()


def _command(name: str):
    """The module of command ``name``; under the process's own entry point, collections resume.

    ``main()`` run as the process (``gradclip``, ``python -m gradclip_cli``)
    turns the cyclic garbage collector off while modules are imported:
    importing torch allocates some 170,000 objects that live as long as the
    process, and with the collector on, full collections walk all of them
    while they are being made (two during ``import torch``, one more while
    gradclip's modules load: 60-280 ms each on a loaded 2-core machine,
    BENCHMARKS.md "Startup").
    Here, once everything the command needs is imported, ``gc.freeze`` moves
    those objects to the permanent generation (the use CPython's documentation
    gives it) and the collector resumes for what the run itself allocates.
    """
    import torch  # noqa: F401  (first: the command's modules all need it)

    module = importlib.import_module(f"{__package__}.commands.{name}")
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
    return module


def _run(body, *, command: str, debug: bool, format: str | None = None, source: object = None,
         output_file: Path | None = None) -> None:
    """Run a command body, turning every error into one line and an exit code.

    Under a launcher every rank ends with the same code and rank 0 alone
    reports (``_settle``).
    """
    failed, code, message = _outcome(body, debug)
    code, message, speaks = _settle(failed, code, message)
    if message is not None and speaks:
        _report_error(message, code, format=format, source=source, command=command,
                      output_file=output_file)
    raise typer.Exit(code)


def _outcome(body, debug: bool) -> tuple[bool, int, str | None]:
    """(failed, exit code, message to report) of running ``body``."""
    try:
        return False, body(), None
    except GradclipError as error:
        if debug:
            traceback.print_exc()
        return True, error.exit_code, None if getattr(error, "quiet", False) else str(error)
    except SystemExit:
        # rich's Console ends the process with SystemExit(1) when stdout is a
        # closed pipe; that is not a finding.
        return True, 141, None
    except KeyboardInterrupt:
        print("gradclip: interrupted", file=sys.stderr)
        return True, 130, None
    except BrokenPipeError:
        # The reader went away (`gradclip ... | head`): stop quietly, as shell tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return True, 141, None
    except MemoryError:
        return True, 3, "out of memory"
    except (OSError, RuntimeError, ValueError) as error:
        if debug:
            traceback.print_exc()
        first_line = str(error).splitlines()[0] if str(error) else ""
        return True, 3, f"{type(error).__name__}: {first_line} (run with --debug for details)"


def _settle(failed: bool, code: int, message: str | None) -> tuple[int, str | None, bool]:
    """Under a launcher: the outcome all ranks agree on, and whether this rank reports it."""
    from .distributed import launcher

    if not launcher.launched():
        return code, message, True
    session = launcher.current()
    # An interrupt reaches every rank from the launcher; nobody waits for agreement.
    if session is not None and code != 130:
        code, message = session.agree(code, message, failed)
    launcher.leave()
    return code, message, launcher.launcher_rank() == 0


@app.command()
def inspect(
    path: str = PathArg,
    key: str | None = KeyOpt,
    norm_type: str = NormOpt,
    device: str = DeviceOpt,
    format: str = FormatOpt,
    output_file: Path | None = OutputFileOpt,
    max_norm: str | None = typer.Option(
        None, "--max-norm", metavar="FLOAT",
        help="Threshold: a total norm above it is a finding (exit 1).",
    ),
    allow_nonfinite: bool = AllowOpt,
    verify: bool = VerifyOpt,
    group_by: str = typer.Option(
        "layer", "--group-by", metavar="RULE",
        help="layer, module, tensor, depth:N or regex:PATTERN.",
    ),
    top: int = typer.Option(5, "--top", min=0, metavar="N",
                            help="Show the N largest tensors by norm."),
    what: str = WhatOpt,
    trust_pickle: bool = TrustOpt,
    quiet: bool = QuietOpt,
    no_progress: bool = NoProgressOpt,
    debug: bool = DebugOpt,
) -> None:
    """Report per-group and total gradient norms and non-finite values. Never writes PATH."""

    def body() -> int:
        command = _command("inspect")

        return command.run(
            path=path, key=key, norm_type=norm_type, device=device, format=format,
            max_norm=max_norm, allow_nonfinite=allow_nonfinite, verify=verify,
            group_by=group_by, top=top, trust_pickle=trust_pickle, quiet=quiet,
            progress=not (quiet or no_progress), output_file=output_file, what=what,
        )

    _run(body, command="inspect", debug=debug, format=format, source=path,
         output_file=output_file)


@app.command()
def clip(
    path: str = PathArg,
    max_norm: str | None = typer.Option(
        None, "--max-norm", metavar="FLOAT",
        help="Scale gradients so the total norm is at most FLOAT.",
    ),
    clip_value: str | None = typer.Option(
        None, "--clip-value", metavar="FLOAT",
        help="Instead: clamp every element to [-FLOAT, FLOAT].",
    ),
    output: str | None = typer.Option(
        None, "--output", "-o", metavar="FILE",
        help="Where to write (default: <stem>.clipped<suffix> beside PATH).",
    ),
    in_place: bool = typer.Option(False, "--in-place", help="Replace PATH itself, atomically."),
    key: str | None = KeyOpt,
    norm_type: str = NormOpt,
    device: str = DeviceOpt,
    format: str = FormatOpt,
    output_file: Path | None = OutputFileOpt,
    allow_nonfinite: bool = typer.Option(
        False, "--allow-nonfinite",
        help="Clip even when gradients hold NaN/inf (as torch with error_if_nonfinite=False).",
    ),
    verify: bool = VerifyOpt,
    what: str = typer.Option("grads", "--what", metavar="WHAT",
                             help="Only grads: clip changes gradients."),
    trust_pickle: bool = TrustOpt,
    quiet: bool = QuietOpt,
    no_progress: bool = NoProgressOpt,
    debug: bool = DebugOpt,
) -> None:
    """Write a copy of PATH with clipped gradients; everything else is kept as it was."""

    def body() -> int:
        command = _command("clip")

        return command.run(
            path=path, max_norm=max_norm, clip_value=clip_value, output=output,
            in_place=in_place, key=key, norm_type=norm_type, device=device, format=format,
            allow_nonfinite=allow_nonfinite, verify=verify, trust_pickle=trust_pickle,
            quiet=quiet, progress=not (quiet or no_progress), output_file=output_file, what=what,
        )

    _run(body, command="clip", debug=debug, format=format, source=path,
         output_file=output_file)


WhatOpt = typer.Option(
    "auto", "--what", metavar="WHAT",
    help="What is measured: grads, exp_avg, grad_rms, update, weights or auto."
)
GroupByOpt = typer.Option(
    "layer", "--group-by", help="layer, module, tensor, depth:N or regex:PATTERN."
)


@app.command()
def trend(
    paths: list[Path] = typer.Argument(
        ..., help="Checkpoints, folders of them, trainer_state.json files, gradclip monitor logs."
    ),
    what: str = WhatOpt,
    group_by: str = GroupByOpt,
    z: float | None = typer.Option(
        None, "--z", help="A point is a spike when its z-score exceeds this (default 2.5)."
    ),
    alpha: float | None = typer.Option(
        None, "--alpha", help="Factor of the exponential averages of mean and variance "
        "(default 0.97)."
    ),
    warmup: int | None = typer.Option(
        None, "--warmup", help="Points that seed the averages (default 25)."
    ),
    fail_on: str = typer.Option(
        "newest", "--fail-on", help="newest: exit 1 when the newest point spikes or is "
        "non-finite; any: when any point does."
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="Also draw the norms to FILE.png or FILE.svg (needs gradclip[plot])."
    ),
    key: str | None = KeyOpt,
    norm_type: str | None = typer.Option(
        None, "--norm-type", help="p of the p-norm (default: the logs' own, else 2)."
    ),
    device: str = DeviceOpt,
    format: str = FormatOpt,
    output_file: Path | None = OutputFileOpt,
    verify: bool = VerifyOpt,
    trust_pickle: bool = TrustOpt,
    quiet: bool = QuietOpt,
    debug: bool = DebugOpt,
) -> None:
    """Norms over a run, oldest to newest; flags spikes against the run's own history."""

    def body() -> int:
        command = _command("trend")

        return command.run(
            paths=paths, what=what, group_by=group_by, z=z, alpha=alpha, warmup=warmup,
            fail_on=fail_on, plot=plot, key=key, norm_type=norm_type, device=device,
            format=format, trust_pickle=trust_pickle, verify=verify, quiet=quiet,
            output_file=output_file,
        )

    source = str(paths[0]) if len(paths) == 1 else " ".join(map(str, paths))
    _run(body, command="trend", debug=debug, format=format, source=source,
         output_file=output_file)


@app.command()
def compare(
    a: Path = typer.Argument(..., help="The earlier checkpoint (the last good one)."),
    b: Path = typer.Argument(..., help="The later checkpoint (the first bad one)."),
    fail_above: str | None = typer.Option(
        None, "--fail-above",
        help="Exit 1 when some group's ratio B/A exceeds R or falls below 1/R.",
    ),
    what: str = WhatOpt,
    group_by: str = GroupByOpt,
    key: str | None = KeyOpt,
    norm_type: str = NormOpt,
    device: str = DeviceOpt,
    format: str = FormatOpt,
    output_file: Path | None = OutputFileOpt,
    verify: bool = VerifyOpt,
    trust_pickle: bool = TrustOpt,
    quiet: bool = QuietOpt,
    debug: bool = DebugOpt,
) -> None:
    """Per-group norms of A and B side by side with B/A, largest change first."""

    def body() -> int:
        command = _command("compare")

        return command.run(
            a=a, b=b, what=what, fail_above=fail_above, group_by=group_by, key=key,
            norm_type=norm_type, device=device, format=format, trust_pickle=trust_pickle,
            verify=verify, quiet=quiet, output_file=output_file,
        )

    _run(body, command="compare", debug=debug, format=format, source=f"{a} {b}",
         output_file=output_file)


def _requested_format(argv: list[str]) -> str | None:
    """``--format`` as written on the command line, for errors raised before parsing ends."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--format" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--format="):
            found = arg.split("=", 1)[1]
    return found


class _TypedValuesFirst:
    """A parameter's coercion that passes through values already of its type.

    typer 0.29 coerces every parameter's value, defaults included, through a
    pydantic ``TypeAdapter`` built on first use; importing pydantic (44
    modules) and building the adapters costs about as much as all of
    gradclip's own imports (BENCHMARKS.md, "Startup"). A string option's value is
    already a string and a default already has its type, so those are returned
    as they are, exactly what the adapter would return. Anything else (``--top
    3`` arrives as the string ``"3"``, a path as a string) goes to typer's own
    coercion, built then, so its parsing and its messages are typer's.
    """

    def coerce(self, value, param, ctx):
        single = not (param.multiple or param.nargs == -1)
        if single and (value is None or type(value) is param.type_descriptor.annotation):
            return value
        param._runtime_param = None  # typer builds its own from here on
        return param.get_runtime_param().coerce(value, param=param, ctx=ctx)


def _pass_typed_values(command) -> None:
    """Give every parameter ``_TypedValuesFirst`` where typer builds coercions lazily (0.29+).

    Older typers (click's own types, no pydantic) have no such attribute and
    are left alone.
    """
    # click makes --help on first need and keeps it (``get_help_option``): make it now.
    params = [*getattr(command, "params", ()), command.get_help_option(typer.Context(command))]
    for param in params:
        if getattr(param, "_runtime_param", False) is None and hasattr(param, "type_descriptor"):
            param._runtime_param = _TypedValuesFirst()
    for sub in getattr(command, "commands", {}).values():
        _pass_typed_values(sub)


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage errors become one line and exit 2, as the contract says."""
    # The process's own entry point: no collections until the command's
    # modules are imported (_command). Callers that pass argv (tests,
    # embedding) keep their collector as it is.
    entry = argv is None and gc.isenabled()
    if entry:
        gc.disable()
    try:
        _main(argv)
    finally:
        if entry:
            gc.enable()


def _main(argv: list[str] | None) -> None:
    command = typer.main.get_command(app)
    _pass_typed_values(command)
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" not in args:
        # A damaged file can make CPython complain while freeing what torch's
        # unpickler built ("deallocated bytearray object has exported buffers");
        # the file's error is already the one line the contract allows.
        sys.unraisablehook = lambda unraisable: None
    try:
        code = command.main(args=args, prog_name="gradclip", standalone_mode=False)
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except typer.Abort:
        print("gradclip: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        # click's UsageError family (typer vendors click in recent releases, so
        # the class is matched by shape): a parse error of flags or arguments.
        if not (hasattr(error, "format_message") and getattr(error, "exit_code", None) == 2):
            raise
        ctx = getattr(error, "ctx", None)
        if type(error).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help(), file=sys.stderr)
            sys.exit(2)
        where = ctx.command_path if ctx is not None else "gradclip"
        source = ctx.params.get("path") if ctx is not None else None
        _report_error(f"{error.format_message()} (see '{where} --help')", 2,
                      format=_requested_format(args), source=source,
                      command=ctx.info_name if ctx is not None else "gradclip")
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
