"""``Contents`` while a layout fills it: the one mutable form, private to the layouts.

A layout reads a checkpoint in steps (a header, then the weights, then the
optimizer's files), each step adding what it found; ``Draft`` holds those
findings under ``Contents``' own field names, and ``finish()`` hands them over
as the read-only inventory (``source/interface.py``). Nothing outside
``source/layouts/`` sees a draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from gradclip_cli.source import roles
from gradclip_cli.source.interface import Checkpoint, Contents, OptimizerState, StoredTensor
from gradclip_cli.source.roles import split_buffers


@dataclass(frozen=True)
class Wording:
    """A layout's report sentences, made from its facts by one function (``facts.py``,
    ``megatron/facts.py``, ``deepspeed/facts.py``), which ``Draft.say`` puts in place.

    ``description``: the report header's lines about the checkpoint. ``weight_evidence``,
    ``optimizer_evidence``, ``gradient_evidence``: why its tensors are weights, optimizer
    state, gradients. ``optimizer_error``, ``gradient_error``: why no moments or no
    gradients are measured, where none are. None: nothing said.
    """

    description: tuple[str, ...] = ()
    weight_evidence: str | None = None
    optimizer_evidence: str | None = None
    optimizer_error: str | None = None
    gradient_error: str | None = None
    gradient_evidence: str | None = None


@dataclass(slots=True)  # a field Contents does not have is an error, not a new attribute
class Draft:
    """``Contents``' fields, mutable (see there for each), and one of the draft's own:

    ``weights_sorted``: the files sort the weights' names (safetensors headers and
    HF indexes do), so their order is not the model's. ``order`` stays None unless
    the layout learned the model's order elsewhere; ``finish`` otherwise takes the
    weights' own order where they are not sorted. A reason in ``missing`` left None
    is no reason: ``finish`` leaves it out.
    """

    path: Path
    kind: str
    description: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    gradients: dict[str, StoredTensor] | None = None
    gradient_key: str = ""
    skipped: list[str] = field(default_factory=list)
    weights: dict[str, StoredTensor] | None = None
    order: list[str] | None = None
    weights_sorted: bool = False
    optimizers: list[OptimizerState] = field(default_factory=list)
    step: int | None = None
    checkpoint: Checkpoint | None = None
    shards: list[Checkpoint] = field(default_factory=list)
    index: Path | None = None
    folder: Path | None = None
    shard_of: Path | None = None
    trusted_pickle: bool = False
    missing: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, StoredTensor] | None = None
    evidence: dict[str, str] = field(default_factory=dict)
    keyed: str | None = None
    fused_weights: dict[str, StoredTensor] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    weights_of: str = ""

    def say(self, words: Wording) -> None:
        """Put a layout's sentences in place: description lines, evidence, what is missing
        (each said replaces what was; what is not said stays)."""
        self.description.extend(words.description)
        said = (roles.WEIGHT, roles.OPTIMIZER_STATE, roles.GRADIENT)
        evidence = (words.weight_evidence, words.optimizer_evidence, words.gradient_evidence)
        errors = (None, words.optimizer_error, words.gradient_error)
        self.evidence.update((r, s) for r, s in zip(said, evidence) if s is not None)
        self.missing.update((r, s) for r, s in zip(said, errors) if s is not None)

    def finish(self) -> Contents:
        """The inventory: these findings, read-only from here on. Buffers are set apart
        from the weights first, whatever layout read them: buffers are never weights or
        gradients (``source/roles.py``), and the weights' order is the parameters'."""
        values = {f.name: getattr(self, f.name) for f in fields(Contents)}
        if self.weights:
            params, buffers = split_buffers(self.weights)
            if buffers:
                values["weights"] = params or None
                values["buffers"] = {**(self.buffers or {}), **buffers}
                if self.weights is self.gradients:
                    values["gradients"] = values["weights"]
        weights = values["weights"]
        values["missing"] = {k: v for k, v in self.missing.items() if v is not None}
        if self.order:
            values["order"] = tuple(self.order)
        elif weights and not self.weights_sorted:
            values["order"] = tuple(weights)
        else:
            values["order"] = None
        return Contents(**values)
