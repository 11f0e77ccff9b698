"""The plain data objects that formats render and the CLI maps to exit codes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NonFinite:
    nan: int = 0
    posinf: int = 0
    neginf: int = 0

    @property
    def total(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass(frozen=True)
class TensorRow:
    name: str
    group: str
    shape: tuple[int, ...]
    dtype: str
    num_elements: int
    norm: float
    max_abs: float
    nonfinite: NonFinite
    tied: tuple[str, ...] = ()  # other names of exactly these storage elements
    shares: tuple[str, ...] = ()  # other tensors holding some of these elements
    ratio: float | None = None  # norm / the same parameter's weight norm


@dataclass(frozen=True)
class GroupRow:
    name: str
    norm: float
    share: float  # (norm / total) ** p: the group's part of sum |g| ** p
    max_abs: float
    num_tensors: int
    num_elements: int
    nonfinite: NonFinite
    ratio: float | None = None  # norm / the norm of the same parameters' weights


# What a report concludes; the CLI maps each to an exit code.
OK, EXCEEDED, NONFINITE, OVERFLOW = "ok", "exceeded", "nonfinite", "overflow"
# What a trend concludes besides those (report/trend.py).
SPIKE, INSUFFICIENT_HISTORY = "spike", "insufficient_history"


@dataclass(frozen=True)
class InspectReport:
    source: str
    format: str
    key: str
    device: str
    norm_type: float
    total_norm: float
    max_abs: float
    num_tensors: int
    num_elements: int
    nonfinite: NonFinite
    status: str
    groups: list[GroupRow]
    tensors: list[TensorRow]
    max_norm: float | None = None
    allow_nonfinite: bool = False
    group_by: str = "layer"
    skipped: list[str] = field(default_factory=list)
    what: str = "grads"  # what was measured (--what, resolved)
    step: int | None = None  # the training step, when the checkpoint records it
    description: list[str] = field(default_factory=list)  # lines for the header
    # What was measured and the evidence for each role (source/roles.py), for scripts:
    # {"what": ..., "evidence": "a state_dict: torch's _metadata"}.
    measured: dict[str, Any] = field(default_factory=dict)
    # How many tensors of the checkpoint have each role: {"weight": 12, "buffer": 3, ...}.
    roles: dict[str, int] = field(default_factory=dict)
    # A finite total beyond float64's range: total_norm is inf, log10 says how far.
    overflow: bool = False
    total_norm_log10: float | None = None
    # The optimizer whose state gave an optimizer quantity ("Adam"), for the verdict's
    # words ("Adam exp_avg total norm ..."); None for gradients and weights.
    optimizer: str | None = None
    # ``--what auto`` chose ``what`` (rather than ``--what`` naming it): a verdict under
    # ``--max-norm`` then says what the threshold was applied to (docs/reference/contract.md).
    chosen_by_auto: bool = False
    # Lines of ``description`` that every format carries, not the table and json alone:
    # where the report corrects what the file's name says (a step), or says why names
    # are missing (state under its ids).
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ClipReport:
    source: str
    output: str
    format: str
    key: str
    norm_type: float
    max_norm: float | None
    clip_value: float | None
    total_norm_before: float
    clip_coef: float | None
    total_norm_after: float
    clipped: bool
    num_tensors: int
    nonfinite: NonFinite
    # Other hard links of the file the output replaced: they keep its old bytes.
    other_links_unchanged: int = 0
    overflow: bool = False  # total_norm_before beyond float64's range (reported as inf)
    clip_coef_log2: float | None = None  # exact even where clip_coef underflows float64
    # torch's coefficient, when rounding to the stored dtype made a lower one necessary
    # (after clipping, the stored total must not exceed max_norm)
    clip_coef_torch: float | None = None
    coef_lowered: bool = False
    # non-gradient entries that shared storage with a gradient: given their own
    # copy before scaling, so they keep their values
    unshared: list[str] = field(default_factory=list)
    # Why nothing was written (exit 1, a finding): the line on stderr. The output is
    # then where the copy would have gone, and the norms are the input's.
    refused: str | None = None
    # The layout's notes (``Contents.notes``): what ``--verify`` could not check.
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FailureReport:
    """A run that ended with exit 2 (usage) or 3 (unreadable input, unwritable output).

    Every format renders it, so CI that reads a report file still learns why
    there is no report (docs/reference/contract.md, "Options both commands take").
    ``message`` is the one line printed on stderr, already made ``visible``;
    ``source`` is PATH as given (several joined by spaces), None when the
    failure came before one was known; ``file`` the one input it concerns,
    None when there are several (an annotation names one file).
    """

    command: str  # "inspect", "clip", "trend", "compare"; "gradclip" before one was chosen
    message: str
    exit_code: int
    source: str | None
    file: str | None = None
    # What the run had found for its report before it failed, each already ``visible``:
    # what ``--verify`` could not check (``GradclipError.notes``).
    notes: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return "usage error" if self.exit_code == 2 else "input unreadable or output unwritable"

    @property
    def title(self) -> str:
        return f"{self.kind} (exit {self.exit_code})"
