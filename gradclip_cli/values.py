"""Every option value's rule, checked while the command line is parsed, before torch loads.

One function per kind of value: it takes the text as given and returns the
value, or raises ``UsageError`` with one line that names the flag and the
value (``--z must be a finite number > 0, got 'nan'``). The click parameter
types below wrap these functions, so a typo costs the parse alone (no torch,
no rich); the commands call the same functions for values that reach them by
another road (the Python API, a test), so there is one rule and one message
per value. Each type also says how the shell completes it.

Nothing here imports torch, rich or any gradclip module that does.
"""

from __future__ import annotations

import math
import re
from importlib.util import find_spec

import click
from click.shell_completion import CompletionItem

from .errors import UsageError
from .format import names as format_names

# What is measured (docs/reference/contract.md, "--what"); source/what.py holds the same tuple.
WHATS = ("auto", "grads", "exp_avg", "grad_rms", "update", "weights")
FAIL_ON = ("newest", "any")
GROUP_BY_WORDS = ("layer", "module", "tensor", "depth:", "regex:")
DEVICES = "cpu, cuda, cuda:N, mps or auto"
PLOT_SUFFIXES = (".png", ".svg")
_DEVICE = re.compile(r"(cpu|cuda|mps)(:\d+)?|auto")


def _one_of(words) -> str:
    words = list(words)
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]


def number(flag: str, text: object) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise UsageError(f"{flag} must be a number, got {text!r}") from None


def norm_type(text: object, flag: str = "--norm-type") -> float:
    """p > 0 or inf."""
    p = number(flag, text)
    if math.isnan(p) or not p > 0:
        raise UsageError(f"{flag} must be a number > 0 or 'inf', got {text!r}")
    return p


def threshold(flag: str, text: object, *, allow_zero: bool) -> float | None:
    """A finite number > 0 (>= 0 with ``allow_zero``), or None when absent."""
    if text is None:
        return None
    x = number(flag, text)
    if not (math.isfinite(x) and (x >= 0 if allow_zero else x > 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise UsageError(f"{flag} must be a finite number {bound}, got {text!r}")
    return x


def ratio_limit(flag: str, text: object) -> float | None:
    """``--fail-above R``: R and 1/R bound one band, so R < 1 would flag every group."""
    x = threshold(flag, text, allow_zero=False)
    if x is not None and x < 1:
        raise UsageError(f"{flag} must be >= 1 (a ratio R flags b/a > R or < 1/R), "
                         f"got {text!r}")
    return x


def whole(flag: str, text: object, *, least: int) -> int:
    """A whole number >= ``least`` (``--top``, ``--warmup``)."""
    try:
        n = int(str(text).strip(), 10) if not isinstance(text, int) else text
    except ValueError:
        n = None
    if n is None or n < least:
        raise UsageError(f"{flag} must be a whole number >= {least}, got {text!r}")
    return n


def fraction(flag: str, text: object) -> float:
    """A number strictly between 0 and 1 (``--alpha``)."""
    x = number(flag, text)
    if not 0 < x < 1:
        raise UsageError(f"{flag} must be a number between 0 and 1 (exclusive), got {text!r}")
    return x


def word(flag: str, text: object, words, why: str | None = None) -> str:
    """One of ``words``; ``why`` replaces the message where the words are one command's."""
    if text not in words:
        raise UsageError(why.format(text=text) if why else
                         f"{flag} must be one of {', '.join(words)}, got {text!r}")
    return text


def format_name(text: object) -> str:
    """``--format``: a name in the format registry (format/__init__.py), read when checked."""
    return word("--format", text, format_names())


def group_by(text: str) -> str:
    """A ``--group-by`` rule, checked by the rule's own parser (report/grouping.py)."""
    from .report.grouping import parse_group_by

    parse_group_by(text)
    return text


def device_name(text: str) -> str:
    """The form of ``--device``; whether it exists here is known once torch is loaded."""
    if not _DEVICE.fullmatch(str(text).strip().lower()):
        raise UsageError(f"--device must be {DEVICES}, got {text!r}")
    return text


def plot_file(text: str) -> str:
    """``--plot FILE``: a .png or .svg, and matplotlib present to draw it."""
    if not str(text).lower().endswith(PLOT_SUFFIXES):
        raise UsageError(f"--plot {text}: the file name must end in .png or .svg")
    if find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, an optional extra: "
                         "pip install 'gradclip[plot]'")
    return text


# -- click parameter types ------------------------------------------------------


class ValueRejected(click.BadParameter):
    """A value a rule above refused: its message already names the flag, so it is
    shown as it is (not as click's "Invalid value for ...")."""

    def format_message(self) -> str:
        return self.message


class Checked(click.ParamType):
    """A value checked by ``rule(text)``; completed from ``words`` (or what the callable
    ``words`` returns, read at completion: a registry's names), when given."""

    def __init__(self, name: str, rule, words=()):
        self.name = name
        self._rule = rule
        self._words = words if callable(words) else tuple(words)

    def convert(self, value, param, ctx):
        try:
            return self._rule(value)
        except UsageError as error:
            raise ValueRejected(str(error), ctx=ctx, param=param) from None

    def shell_complete(self, ctx, param, incomplete):
        words = self._words() if callable(self._words) else self._words
        return [CompletionItem(w) for w in words if w.startswith(incomplete)]

    def get_metavar(self, *args, **kwargs) -> str | None:
        return None  # every option names its own metavar


def choice(flag: str, words, why: str | None = None) -> Checked:
    return Checked(flag.lstrip("-"), lambda text: word(flag, text, words, why), words)


def number_type(flag: str, rule) -> Checked:
    return Checked(flag.lstrip("-"), lambda text: rule(flag, text))


FORMAT = Checked("format", format_name, format_names)
WHAT = choice("--what", WHATS)
CLIP_WHAT = choice("--what", ("grads", "auto"),
                   "clip changes gradients only: --what grads, got {text!r}")
FAIL_ON_TYPE = choice("--fail-on", FAIL_ON)
GROUP_BY = Checked("group-by", group_by, GROUP_BY_WORDS)
NORM_TYPE = Checked("norm-type", norm_type, ("1", "2", "inf"))
DEVICE = Checked("device", device_name, ("cpu", "cuda", "mps", "auto"))
PLOT = Checked("plot", plot_file)


def positive(flag: str, *, allow_zero: bool = False) -> Checked:
    return number_type(flag, lambda f, t: threshold(f, t, allow_zero=allow_zero))


RATIO = number_type("--fail-above", ratio_limit)


def count(flag: str, least: int) -> Checked:
    return number_type(flag, lambda f, t: whole(f, t, least=least))


def between_0_and_1(flag: str) -> Checked:
    return number_type(flag, fraction)


__all__ = [
    "CLIP_WHAT", "DEVICE", "FAIL_ON", "FAIL_ON_TYPE", "FORMAT", "GROUP_BY", "NORM_TYPE",
    "PLOT", "RATIO", "WHAT", "WHATS", "Checked", "ValueRejected", "between_0_and_1", "count",
    "device_name", "format_name", "fraction", "group_by", "norm_type", "number", "plot_file",
    "positive", "ratio_limit", "threshold", "whole", "word",
]  # fmt: skip
