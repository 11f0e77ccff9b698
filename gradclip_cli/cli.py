"""The ``gradclip`` command: declares options and wires each command's module.

Nothing here computes or reads files itself; each command's steps live in
``commands/`` and are imported only when that command runs. Options are
declared once each, on click's documented interface; every value is checked
by its type while the command line is parsed (``values.py``), so ``--help``,
a typo'd value and shell completion never import torch. This module maps the
outcome to the contract's exit codes: 0 no finding, 1 a finding (or a refused
clip), 2 usage error, 3 unreadable input or unwritable output.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import traceback
import warnings
from pathlib import Path

import click
from click.shell_completion import get_completion_class

from . import values as V
from .errors import REPORT_FILE_FLAG, GradclipError, stderr_lines
from .format import described as described_formats
from .format import failure_formats

# torch warns on import when numpy is absent; gradclip never needs numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

PROG = "gradclip"
COMPLETE_VAR = "_GRADCLIP_COMPLETE"  # click's completion protocol (see --show-completion)
SUMMARY = ("Gradient diagnostics for PyTorch checkpoints: accurate norms, non-finite flags, "
           "clipped copies. Exit codes: 0 ok, 1 finding, 2 usage error, 3 unreadable input "
           "or unwritable output.")
PATH_HELP = ("PATH is a checkpoint: a torch.save or .safetensors file, a sharded index or its "
             "folder, a DCP folder, a training framework's checkpoint folder (Trainer "
             "checkpoint-N/, Lightning, DeepSpeed, accelerate, Megatron, ...).")
CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True,
           "max_content_width": 100}


def _show_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from . import __version__

        click.echo(f"{PROG} {__version__}")
        ctx.exit(0)


def _show_completion(ctx: click.Context, _param, shell: str | None) -> None:
    """The script that makes ``shell`` complete gradclip's commands, options and values."""
    if shell is None or ctx.resilient_parsing:
        return
    cls = get_completion_class(shell)
    click.echo(cls(ctx.command, {}, PROG, COMPLETE_VAR).source())
    ctx.exit(0)


@click.group(context_settings=CONTEXT, no_args_is_help=True, help=SUMMARY)
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_show_version, help="Print gradclip's version and exit.")
@click.option("--show-completion", type=click.Choice(["bash", "zsh", "fish"]),
              metavar="SHELL", expose_value=False, is_eager=True, callback=_show_completion,
              help='Print the completion script for SHELL; e.g. eval "$(gradclip '
                   '--show-completion bash)" in ~/.bashrc.')
def app() -> None:
    pass


class _FormatOption(click.Option):
    """``--format``: its help is the format registry's, read when ``--help`` is drawn."""

    def get_help_record(self, ctx: click.Context):
        self.help = described_formats()
        return super().get_help_record(ctx)


# Options, each declared once. ``click.option`` makes a new Option for each
# command it decorates; options that differ between commands (defaults, help)
# are declared apart, where the command is.
key_option = click.option("--key", metavar="K", help="Dotted path to the gradients "
                     "(grads, state.grads); an integer indexes a list.")
norm_type_option = click.option("--norm-type", type=V.NORM_TYPE, default="2", metavar="P",
                           help="p of the p-norm: any number > 0, or inf.")
device_option = click.option("--device", type=V.DEVICE, default="cpu", metavar="DEVICE",
                        help=f"{V.DEVICES}.")
format_option = click.option("--format", "format", cls=_FormatOption, type=V.FORMAT,
                             default="table", metavar="FORMAT")
output_file_option = click.option("--output-file", metavar="FILE",
                             help="Write the report to FILE (atomically) instead of stdout.")
trust_option = click.option("--trust-pickle", is_flag=True, help="Allow full unpickling: runs "
                       "code from the file. Trusted files only.")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="Print only the verdict line "
                       "(findings also on stderr); the exit code is unchanged.")
no_progress_option = click.option("--no-progress", is_flag=True,
                             help="No progress display on stderr.")
debug_option = click.option("--debug", is_flag=True, help="Show Python tracebacks on errors.")
verify_option = click.option("--verify", is_flag=True,
                        help="Check every stored checksum before trusting the data.")
what_option = click.option("--what", type=V.WHAT, default="auto", metavar="WHAT",
                      help="What is measured: grads, exp_avg, grad_rms, update, weights or "
                      "auto (grads if saved, else exp_avg, else weights).")
group_by_option = click.option("--group-by", type=V.GROUP_BY, default="layer", metavar="RULE",
                          help="layer, module, tensor, depth:N or regex:PATTERN.")
path_argument = click.argument("path", metavar="PATH")
# Reading runs (trend, and autopsy: the same inputs). docs/reference/contract.md, "Over time".
exclude_option = click.option("--exclude", multiple=True, metavar="GLOB",
                              help="Leave out inputs matching GLOB (the path as given, or its "
                              "base name; repeatable): a clipped copy beside the run's files.")
tag_option = click.option("--tag", metavar="NAME", help="The tracker tag to read as the "
                          "gradient norm (default: found by name, e.g. grad_norm).")
run_option = click.option("--run", "run_name", metavar="NAME", help="Which run of a tracker's "
                          "store holding several (a run's name or id).")


def _shared(command):
    """The options every command takes, in the order --help lists them."""
    for option in reversed((key_option, device_option, format_option, output_file_option,
                            verify_option, trust_option, quiet_option, no_progress_option,
                            debug_option)):
        command = option(command)
    return command


def _report_error(message: str, code: int, *, format: str | None, source: object,
                  command: str = "gradclip", output_file: Path | None = None,
                  inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = (),
                  notes: tuple[str, ...] = (), quiet: bool = False) -> None:
    """One error line on stderr; with a CI format also that format's failure document.

    ``notes``: what the run had found for its report before it failed (already
    ``visible``: what ``--verify`` could not check): the user is told of a check not
    made. They go in the failure document, stderr keeping its one line; where the format
    writes none (the table), on stderr as ``note:`` lines after the error line
    (``errors.stderr_lines``), as clip's exit-1 refusal says them; under ``-q`` the
    error line alone, as ``-q`` shows a report's verdict line without its notes.

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
    documented = format in failure_formats()
    for line in stderr_lines(message, () if documented or quiet else notes):
        print(line, file=sys.stderr)
    if not documented:
        return
    import io

    from .format import FORMATS
    from .report.model import FailureReport

    failure = FailureReport(command=command, message=message, exit_code=code,
                            source=None if source is None else str(source),
                            file=inputs[0] if len(inputs) == 1 else None, notes=notes)
    buffer = io.StringIO()
    FORMATS[format].render_error(failure, buffer)
    document = buffer.getvalue()
    # An error about --output-file itself is never written there, nor is any failure
    # written onto an input: stdout instead.
    if (output_file is not None and not message.startswith(REPORT_FILE_FLAG)
            and _may_hold_the_failure(output_file, (*inputs, *outputs))):
        from .sink.atomic import atomic_write

        try:
            atomic_write(Path(output_file), lambda file: file.write(document.encode("utf-8")))
            return
        except GradclipError as error:
            second = visible(str(error))
            if second != message:  # --output-file itself was the error: say it once
                print(f"gradclip: {second}", file=sys.stderr)
    sys.stdout.write(document)
    sys.stdout.flush()


def _may_hold_the_failure(output_file: Path, inputs: tuple[str, ...]) -> bool:
    """Whether a failed run's document may go to ``--output-file``: never onto a file the
    command reads or writes, nor into an input folder (by identity, links included);
    the document goes to stdout instead. A run can fail *because* ``--output-file``
    names its input, and a failure must not do the damage the check prevents."""
    target = os.path.realpath(output_file)
    try:
        identity = os.stat(output_file)
    except OSError:
        identity = None
    for given in inputs:
        real = os.path.realpath(given)
        if target == real or target.startswith(real.rstrip(os.sep) + os.sep):
            return False
        try:
            other = os.stat(given)
        except OSError:
            continue
        if identity is not None and (other.st_dev, other.st_ino) == (identity.st_dev,
                                                                       identity.st_ino):
            return False
    return True


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
         output_file: Path | None = None, inputs: tuple[str, ...] = (),
         outputs: tuple[str, ...] = (), quiet: bool = False) -> None:
    """Run a command body, turning every error into one line and an exit code.

    Under a launcher every rank ends with the same code and rank 0 alone
    reports (``_settle``).
    """
    failed, code, message, notes = _outcome(body, debug)
    code, message, speaks = _settle(failed, code, message)
    if message is not None and speaks:
        _report_error(message, code, format=format, source=source, command=command,
                      output_file=output_file, inputs=inputs, outputs=outputs, notes=notes,
                      quiet=quiet)
    raise click.exceptions.Exit(code)


def _outcome(body, debug: bool) -> tuple[bool, int, str | None, tuple[str, ...]]:
    """(failed, exit code, message to report, the notes made before it failed) of running
    ``body``."""
    try:
        return False, body(), None, ()
    except GradclipError as error:
        if debug:
            traceback.print_exc()
        message = None if getattr(error, "quiet", False) else str(error)
        return True, error.exit_code, message, error.notes
    except SystemExit:
        # rich's Console ends the process with SystemExit(1) when stdout is a
        # closed pipe; that is not a finding.
        return True, 141, None, ()
    except KeyboardInterrupt:
        print("gradclip: interrupted", file=sys.stderr)
        return True, 130, None, ()
    except BrokenPipeError:
        # The reader went away (`gradclip ... | head`): stop quietly, as shell tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return True, 141, None, ()
    except MemoryError:
        return True, 3, "out of memory", ()
    except (OSError, RuntimeError, ValueError) as error:
        if debug:
            traceback.print_exc()
        first_line = str(error).splitlines()[0] if str(error) else ""
        return True, 3, f"{type(error).__name__}: {first_line} (run with --debug for details)", ()


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


def _output_file(value: str | None) -> Path | None:
    return None if value is None else Path(value)


@app.command(context_settings=CONTEXT, help="Report per-group and total gradient norms and "
             "non-finite values. Never writes PATH.\n\n" + PATH_HELP)
@path_argument
@norm_type_option
@click.option("--max-norm", type=V.positive("--max-norm", allow_zero=True), metavar="FLOAT",
         help="Threshold: a total norm above it is a finding (exit 1).")
@click.option("--allow-nonfinite", is_flag=True,
         help="Report NaN/inf gradients without treating them as a finding.")
@group_by_option
@click.option("--top", type=V.count("--top", 0), default="5", metavar="N",
         help="Show the N largest tensors by norm.")
@what_option
@click.option("--previous", metavar="PREV", help="With --what grads: the checkpoint one "
              "optimizer step before PATH; measures the gradients of PATH's last step, "
              "reconstructed from the two Adam-family states.")
@_shared
def inspect(path, key, norm_type, device, format, output_file, max_norm, allow_nonfinite,
            verify, group_by, top, what, previous, trust_pickle, quiet, no_progress,
            debug) -> None:
    def body() -> int:
        return _command("inspect").run(
            path=path, key=key, norm_type=norm_type, device=device, format=format,
            max_norm=max_norm, allow_nonfinite=allow_nonfinite, verify=verify,
            group_by=group_by, top=top, trust_pickle=trust_pickle, quiet=quiet,
            progress=not (quiet or no_progress), output_file=_output_file(output_file),
            what=what, previous=previous,
        )

    _run(body, command="inspect", debug=debug, quiet=quiet, format=format, source=path,
         output_file=_output_file(output_file),
         inputs=(path,) if previous is None else (path, previous))


@app.command(context_settings=CONTEXT, help="Write a copy of PATH with clipped gradients; "
             "everything else is kept as it was.\n\n" + PATH_HELP)
@path_argument
@click.option("--max-norm", type=V.positive("--max-norm"), metavar="FLOAT",
         help="Scale gradients so the total norm is at most FLOAT.")
@click.option("--clip-value", type=V.positive("--clip-value"), metavar="FLOAT",
         help="Instead: clamp every element to [-FLOAT, FLOAT].")
@click.option("--output", "-o", metavar="FILE",
         help="Where to write (default: <stem>.clipped<suffix> beside PATH).")
@click.option("--in-place", is_flag=True, help="Replace PATH itself, atomically.")
@norm_type_option
@click.option("--allow-nonfinite", is_flag=True, help="Clip even when gradients hold NaN/inf "
         "(as torch with error_if_nonfinite=False).")
@click.option("--what", type=V.CLIP_WHAT, default="grads", metavar="WHAT",
         help="Only grads: clip changes gradients.")
@_shared
def clip(path, max_norm, clip_value, output, in_place, key, norm_type, device, format,
         output_file, allow_nonfinite, verify, what, trust_pickle, quiet, no_progress,
         debug) -> None:
    def body() -> int:
        return _command("clip").run(
            path=path, max_norm=max_norm, clip_value=clip_value, output=output,
            in_place=in_place, key=key, norm_type=norm_type, device=device, format=format,
            allow_nonfinite=allow_nonfinite, verify=verify, trust_pickle=trust_pickle,
            quiet=quiet, progress=not (quiet or no_progress),
            output_file=_output_file(output_file), what=what,
        )

    _run(body, command="clip", debug=debug, quiet=quiet, format=format, source=path,
         output_file=_output_file(output_file), inputs=(path,),
         outputs=(output,) if output else ())


@app.command(context_settings=CONTEXT, help="Norms over a run, oldest to newest; flags "
             "spikes against the run's own history.\n\nEach PATH is a checkpoint, a folder "
             "of them (an HF output_dir), a trainer_state.json, a gradclip monitor log, or a "
             "tracker's files (TensorBoard, MLflow, trackio, W&B, Lightning's metrics.csv).")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@what_option
@group_by_option
@click.option("--z", type=V.positive("--z"), metavar="Z", help="A point is a spike when its "
         "total's z-score exceeds Z (default 2.5), or a group's exceeds the z that keeps the "
         "chance of any of its G groups crossing that of one series (3.02 for 5).")
@click.option("--alpha", type=V.between_0_and_1("--alpha"), metavar="A",
         help="Factor of the exponential averages of mean and variance (default 0.97).")
@click.option("--warmup", type=V.count("--warmup", 1), metavar="N",
         help="Points that seed the averages (default 25).")
@click.option("--fail-on", type=V.FAIL_ON_TYPE, default="newest", metavar="WHEN",
         help="newest: exit 1 when the newest point spikes or is non-finite; any: when any "
         "point does.")
@click.option("--plot", type=V.PLOT, metavar="FILE",
         help="Also draw the norms to FILE.png or FILE.svg (needs gradclip[plot]).")
@click.option("--norm-type", type=V.NORM_TYPE, metavar="P",
         help="p of the p-norm (default: the logs' own, else 2).")
@tag_option
@run_option
@exclude_option
@_shared
def trend(paths, what, group_by, z, alpha, warmup, fail_on, plot, key, norm_type, device,
          format, output_file, verify, trust_pickle, quiet, no_progress, debug, tag=None,
          run_name=None, exclude=()) -> None:
    # None when not given: a log's groups are fixed when it is written.
    given = click.get_current_context().get_parameter_source("group_by")
    group_by = None if given is click.core.ParameterSource.DEFAULT else group_by

    def body() -> int:
        return _command("trend").run(
            paths=[Path(p) for p in paths], what=what, group_by=group_by, z=z, alpha=alpha,
            warmup=warmup, fail_on=fail_on, plot=None if plot is None else Path(plot),
            key=key, norm_type=norm_type, device=device, format=format,
            trust_pickle=trust_pickle, verify=verify, quiet=quiet,
            output_file=_output_file(output_file), progress=not (quiet or no_progress),
            tag=tag, run_name=run_name, exclude=tuple(exclude),
        )

    _run(body, command="trend", debug=debug, quiet=quiet, format=format, source=" ".join(paths),
         output_file=_output_file(output_file), inputs=tuple(paths),
         outputs=(plot,) if plot else ())


@app.command(context_settings=CONTEXT, help="Per-group norms of A and B side by side with "
             "B/A, largest change first.\n\nA is the earlier checkpoint (the last good one), "
             "B the later (the first bad one).")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option("--fail-above", type=V.RATIO, metavar="R", help="Exit 1 when the total's or some "
         "group's ratio B/A exceeds R or falls below 1/R, or a group is on one side only.")
@what_option
@group_by_option
@norm_type_option
@_shared
def compare(a, b, fail_above, what, group_by, key, norm_type, device, format, output_file,
            verify, trust_pickle, quiet, no_progress, debug) -> None:
    def body() -> int:
        return _command("compare").run(
            a=Path(a), b=Path(b), what=what, fail_above=fail_above, group_by=group_by,
            key=key, norm_type=norm_type, device=device, format=format,
            trust_pickle=trust_pickle, verify=verify, quiet=quiet,
            output_file=_output_file(output_file), progress=not (quiet or no_progress),
        )

    _run(body, command="compare", debug=debug, quiet=quiet, format=format, source=f"{a} {b}",
         output_file=_output_file(output_file), inputs=(a, b))


@app.command(context_settings=CONTEXT, help="Take a spike apart: where it began (each "
             "group's onset, how many steps before the total), what changed across it "
             "(gradients, Adam's moments, the update, the weights) and which group first."
             "\n\nThe same PATHs as trend: run folders, checkpoints, monitor logs and their "
             "dumps, trainer_state.json, trackers' files. Exit 1 when it explains a spike or "
             "non-finite step.")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option("--step", type=V.count("--step", 0), metavar="S", help="Explain step S "
         "(default: the newest spike or non-finite step of the finest series).")
@click.option("--window", type=V.count("--window", 1), metavar="N", help="Look for onsets "
         "up to N steps before the explained one (default 50).")
@click.option("--outlier-k", type=V.positive("--outlier-k"), metavar="K", help="Count "
         "gradient elements with |g| > K * sqrt(v_hat) (default 6).")
@click.option("--plot", type=V.PLOT, metavar="FILE",
         help="Also draw the top groups' series to FILE.png or FILE.svg (needs gradclip[plot]).")
@tag_option
@run_option
@exclude_option
@_shared
def autopsy(paths, step, window, outlier_k, plot, key, device, format, output_file, verify,
            trust_pickle, quiet, no_progress, debug, tag=None, run_name=None,
            exclude=()) -> None:
    def body() -> int:
        return _command("autopsy").run(
            paths=[Path(p) for p in paths], step=step, window=window, outlier_k=outlier_k,
            plot=None if plot is None else Path(plot), key=key, device=device, format=format,
            trust_pickle=trust_pickle, verify=verify, quiet=quiet,
            output_file=_output_file(output_file), progress=not (quiet or no_progress),
            tag=tag, run_name=run_name, exclude=tuple(exclude),
        )

    _run(body, command="autopsy", debug=debug, quiet=quiet, format=format, source=" ".join(paths),
         output_file=_output_file(output_file), inputs=tuple(paths),
         outputs=(plot,) if plot else ())


def _requested(argv: list[str], flag: str) -> tuple[str | None, int | None]:
    """The value of ``flag`` as written on the command line, for errors raised before
    parsing ends, and the position of the word that holds it."""
    found, at = None, None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found, at = argv[i + 1], i + 1
        elif arg.startswith(f"{flag}="):
            found, at = arg.split("=", 1)[1], i
    return found, at


def _named_paths(argv: list[str], skip: int | None) -> tuple[str, ...]:
    """Every word of a command line that did not parse (but the one at ``skip``), and
    where clip would write each by default: what the command reads and writes is not
    known, so any of them may be, and the error document must not replace one."""
    from .options import default_output

    words = [arg for i, arg in enumerate(argv) if i != skip and arg]
    return (*words, *(default_output(word) for word in words if Path(word).name))


def _given_inputs(ctx: click.Context, args: list[str]) -> tuple[str, ...]:
    """The PATH (or paths) of a command line that failed to parse, for the error document.

    click reads arguments after options, so a bad option value stops it before
    PATH is known; a resilient parse (values that fail become None) finds it.
    """
    try:
        rest = args[args.index(ctx.info_name) + 1:]
        probe = ctx.command.make_context(ctx.info_name, rest, parent=ctx.parent,
                                         resilient_parsing=True)
    except Exception:  # noqa: BLE001 (best effort: the error itself is what is reported)
        return ()
    params = probe.params
    if params.get("path"):
        return (params["path"],)
    if params.get("paths"):
        return tuple(params["paths"])
    if params.get("a") and params.get("b"):
        return (params["a"], params["b"])
    return ()


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
    args = list(sys.argv[1:] if argv is None else argv)
    from .distributed import launcher

    launcher.set_command_line(args)  # under a launcher, every rank's must be the same
    if "--debug" not in args:
        # A damaged file can make CPython complain while freeing what torch's
        # unpickler built ("deallocated bytearray object has exported buffers");
        # the file's error is already the one line the contract allows.
        sys.unraisablehook = lambda unraisable: None
    try:
        code = app.main(args=args, prog_name=PROG, complete_var=COMPLETE_VAR,
                        standalone_mode=False)
    except click.exceptions.Exit as exit_:
        sys.exit(exit_.exit_code)
    except click.Abort:
        print("gradclip: interrupted", file=sys.stderr)
        sys.exit(130)
    except click.UsageError as error:
        ctx = error.ctx
        if type(error).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help(), file=sys.stderr)
            sys.exit(2)
        where = ctx.command_path if ctx is not None else PROG
        command = ctx.info_name if ctx is not None and ctx.parent is not None else PROG
        inputs = _given_inputs(ctx, args) if command != PROG else ()
        format = _requested(args, "--format")[0]
        output_file, at = _requested(args, "--output-file")
        # The report file gets the document as for any other failure, where it is none
        # of the paths the command line names.
        named = _named_paths(args, at) if output_file and format in failure_formats() else ()
        _report_error(f"{error.format_message()} (see '{where} --help')", 2,
                      format=format, source=" ".join(inputs) or None, command=command,
                      output_file=_output_file(output_file), inputs=inputs, outputs=named)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
