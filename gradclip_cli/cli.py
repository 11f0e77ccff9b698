"""The ``gradclip`` command: wires source -> core -> report -> format/sink.

Nothing here computes or reads files itself; it checks flags, calls the
layers in order, prints, and maps the outcome to the contract's exit codes:
0 no finding, 1 a finding (or a refused clip), 2 usage error, 3 unreadable
input or unwritable output.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

# torch warns on import when numpy is absent; gradclip never needs numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import typer  # noqa: E402

from . import options  # noqa: E402
from .core import clamp_, clip_coefficient, find_ties, scale_, tensor_power_sums  # noqa: E402
from .errors import GradclipError, UsageError  # noqa: E402
from .format import FORMATS  # noqa: E402
from .progress import Steps, progress_steps  # noqa: E402
from .report import OK, ClipReport, NonFinite, build_inspect_report, parse_group_by  # noqa: E402
from .sink import write_checkpoint  # noqa: E402
from .source import Checkpoint, load_checkpoint, select_gradients  # noqa: E402
from .source.pages import PageReleaser  # noqa: E402

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Gradient diagnostics for PyTorch checkpoints: accurate norms, non-finite "
    "flags, clipped copies. Exit codes: 0 ok, 1 finding, 2 usage error, 3 unreadable input.",
)

# Options both commands take.
KeyOpt = typer.Option(None, "--key", help="Dotted path to the gradient dict (grads, state.grads).")
NormOpt = typer.Option("2", "--norm-type", help="p of the p-norm: any number > 0, or inf.")
DeviceOpt = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N, mps or auto.")
FormatOpt = typer.Option("table", "--format", help="table (for people) or json (for scripts).")
TrustOpt = typer.Option(
    False, "--trust-pickle",
    help="Allow full unpickling: runs code from the file. Trusted files only.",
)
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress display.")
DebugOpt = typer.Option(False, "--debug", help="Show Python tracebacks on errors.")
AllowOpt = typer.Option(
    False, "--allow-nonfinite", help="Report NaN/inf gradients without treating them as a finding."
)
VerifyOpt = typer.Option(
    False, "--verify", help="Check every stored checksum before trusting the data."
)


@dataclass
class Loaded:
    checkpoint: Checkpoint
    key: str
    names: list[str]  # without tie duplicates
    tensors: list[torch.Tensor]
    ties: dict[str, list[str]]
    skipped: list[str]


def _format(name: str):
    if name not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


def _load(path: Path, key: str | None, trust_pickle: bool, verify: bool, steps: Steps) -> Loaded:
    steps.begin("loading")
    ckpt = load_checkpoint(path, trust_pickle=trust_pickle, verify=verify)
    if ckpt.trusted_pickle:
        print(f"gradclip: warning: {path}: loaded with --trust-pickle (full unpickling; "
              "code in the file may have run)", file=sys.stderr)
    selection = select_gradients(ckpt.root, key, path=path)
    all_names = list(selection.tensors)
    all_tensors = list(selection.tensors.values())
    owner = find_ties(all_tensors)
    ties: dict[str, list[str]] = {}
    for i, o in enumerate(owner):
        if o != i:
            ties.setdefault(all_names[o], []).append(all_names[i])
    keep = [i for i, o in enumerate(owner) if o == i]
    return Loaded(ckpt, selection.key, [all_names[i] for i in keep],
                  [all_tensors[i] for i in keep], ties, list(selection.skipped))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# torch's intra-op threads become gradclip's own workers (see tensor_power_sums).
WORKERS = torch.get_num_threads()
torch.set_num_threads(1)


def _measure(loaded: Loaded, p: float, device: torch.device, steps: Steps, label: str,
             release: PageReleaser | None = None):
    steps.begin(label, total=_nbytes(loaded.tensors))

    def done(batch) -> None:
        steps.advance(_nbytes(batch))
        if release is not None:
            release.release(batch)

    return tensor_power_sums(loaded.tensors, p, device=device, on_batch=done, workers=WORKERS)


def _run(body, debug: bool) -> None:
    """Run a command body, turning every error into one line and an exit code."""
    try:
        code = body()
    except GradclipError as error:
        if debug:
            traceback.print_exc()
        print(f"gradclip: {error}", file=sys.stderr)
        raise typer.Exit(error.exit_code) from None
    except SystemExit:
        # rich's Console ends the process with SystemExit(1) when stdout is a
        # closed pipe; that is not a finding.
        raise typer.Exit(141) from None
    except KeyboardInterrupt:
        print("gradclip: interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
    except BrokenPipeError:
        # The reader went away (`gradclip ... | head`): stop quietly, as shell tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(141) from None
    except MemoryError:
        print("gradclip: out of memory", file=sys.stderr)
        raise typer.Exit(3) from None
    except (OSError, RuntimeError, ValueError) as error:
        if debug:
            traceback.print_exc()
        first_line = str(error).splitlines()[0] if str(error) else ""
        print(f"gradclip: {type(error).__name__}: {first_line} (run with --debug for details)",
              file=sys.stderr)
        raise typer.Exit(3) from None
    raise typer.Exit(code)


@app.command()
def inspect(
    path: Path = typer.Argument(..., help="A torch.save file or a .safetensors file."),
    key: str | None = KeyOpt,
    norm_type: str = NormOpt,
    device: str = DeviceOpt,
    format: str = FormatOpt,
    max_norm: str | None = typer.Option(
        None, "--max-norm", help="Threshold: a total norm above it is a finding (exit 1)."
    ),
    allow_nonfinite: bool = AllowOpt,
    verify: bool = VerifyOpt,
    group_by: str = typer.Option(
        "layer", "--group-by", help="layer, module, tensor, depth:N or regex:PATTERN."
    ),
    top: int = typer.Option(5, "--top", min=0, help="Show the K largest tensors by norm."),
    trust_pickle: bool = TrustOpt,
    quiet: bool = QuietOpt,
    debug: bool = DebugOpt,
) -> None:
    """Report per-group and total gradient norms and non-finite values. Never writes PATH."""

    def body() -> int:
        p = options.norm_type(norm_type)
        threshold = options.threshold("--max-norm", max_norm, allow_zero=True)
        dev = options.device(device)
        fmt = _format(format)
        rule = parse_group_by(group_by)
        with progress_steps(quiet) as steps:
            loaded = _load(path, key, trust_pickle, verify, steps)
            # inspect never writes a tensor, so pages read can go back at once:
            # resident memory stays flat whatever the file's size.
            release = PageReleaser(path)
            sums = _measure(loaded, p, dev, steps, "computing norms", release)
        report = build_inspect_report(
            names=loaded.names, tensors=loaded.tensors, sums=sums, ties=loaded.ties,
            group_rule=rule, source=str(path), format=loaded.checkpoint.format,
            key=loaded.key, device=str(dev), max_norm=threshold,
            allow_nonfinite=allow_nonfinite, group_by=group_by, skipped=loaded.skipped,
        )
        fmt.render_inspect(report, sys.stdout, top=top)
        return 0 if report.status == OK else 1

    _run(body, debug)


@app.command()
def clip(
    path: Path = typer.Argument(..., help="A torch.save file or a .safetensors file."),
    max_norm: str | None = typer.Option(
        None, "--max-norm", help="Scale gradients so the total norm is at most this."
    ),
    clip_value: str | None = typer.Option(
        None, "--clip-value", help="Instead: clamp every element to [-V, V]."
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Where to write (default: <stem>.clipped<suffix> beside PATH)."
    ),
    in_place: bool = typer.Option(False, "--in-place", help="Replace PATH itself, atomically."),
    key: str | None = KeyOpt,
    norm_type: str = NormOpt,
    device: str = DeviceOpt,
    format: str = FormatOpt,
    allow_nonfinite: bool = typer.Option(
        False, "--allow-nonfinite",
        help="Clip even when gradients hold NaN/inf (as torch with error_if_nonfinite=False).",
    ),
    verify: bool = VerifyOpt,
    trust_pickle: bool = TrustOpt,
    quiet: bool = QuietOpt,
    debug: bool = DebugOpt,
) -> None:
    """Write a copy of PATH with clipped gradients; everything else is kept as it was."""

    def body() -> int:
        p = options.norm_type(norm_type)
        limit = options.threshold("--max-norm", max_norm, allow_zero=False)
        value = options.threshold("--clip-value", clip_value, allow_zero=False)
        if (limit is None) == (value is None):
            raise UsageError("clip needs exactly one of --max-norm X or --clip-value V")
        target = options.clip_output(path, output, in_place)
        dev = options.device(device)
        fmt = _format(format)
        with progress_steps(quiet) as steps:
            loaded = _load(path, key, trust_pickle, verify, steps)
            before = _measure(loaded, p, dev, steps, "computing norms").total()
            total_before = float(before.norm[0])
            nonfinite = NonFinite(int(before.nan[0]), int(before.posinf[0]), int(before.neginf[0]))
            if nonfinite.total and not allow_nonfinite:
                print(f"gradclip: {path}: total norm is {total_before} ({nonfinite.nan} NaN, "
                      f"{nonfinite.posinf} +inf, {nonfinite.neginf} -inf); refusing to clip, "
                      "nothing written (--allow-nonfinite clips anyway)", file=sys.stderr)
                return 1
            coef = None
            if limit is not None:
                c = clip_coefficient(torch.tensor(total_before, dtype=torch.float64), limit)
                coef = float(c)
                scale_(loaded.tensors, c)
                clipped = coef < 1.0
            else:
                clamp_(loaded.tensors, value)
                clipped = float(before.max_abs[0]) > value
            after = float(_measure(loaded, p, dev, steps, "checking").total().norm[0])
            steps.begin("writing")
            write_checkpoint(loaded.checkpoint, target)
        report = ClipReport(
            source=str(path), output=str(target), format=loaded.checkpoint.format,
            key=loaded.key, norm_type=p, max_norm=limit, clip_value=value,
            total_norm_before=total_before, clip_coef=coef, total_norm_after=after,
            clipped=clipped, num_tensors=len(loaded.tensors), nonfinite=nonfinite,
        )
        fmt.render_clip(report, sys.stdout)
        return 0

    _run(body, debug)


def main(argv: list[str] | None = None) -> None:
    """Entry point: usage errors become one line and exit 2, as the contract says."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="gradclip", standalone_mode=False)
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
        print(f"gradclip: {error.format_message()} (see '{where} --help')", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
