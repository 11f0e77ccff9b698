"""What a layout found for each role, as facts, and the one function that words them.

A layout records where a role's tensors were and what showed them to be that role
(``Found``), and why it holds no gradients (``NoGradients``: it saves none; ``NotGradients``:
what was asked for is something else); ``wording`` makes the report's evidence and messages
of them into the ``Wording`` that ``Draft.say`` puts in place (as ``megatron/facts.py`` and
``deepspeed/facts.py`` do theirs), so facts and words are tested apart (``test_facts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from gradclip_cli.escaping import visible
from gradclip_cli.source import roles
from gradclip_cli.source.files.small_file import quoted

from .draft import Wording

# What showed the tensors to be their role (``Found.by``).
KEY = "key"  # --key named them (``names``: the key)
ENTRY = "entry"  # the entries a script keeps them under (``names``: those entries)
MARK = "mark"  # their writer's mark: gradclip's save_grads, or a framework's (``layout``)
FLAT = "flat"  # a flat name -> tensor mapping (``detail``: which) that nothing marks as weights
UNMARKED = "unmarked"  # the same, taken as gradients and weights alike: nothing marks it
PROOF = "proof"  # the tensors themselves (``detail``: roles.weight_evidence's result)
STATE = "state"  # a whole file that is an optimizer's state dict: state and param_groups
FILES = "files"  # a framework's own files or entries (``names``), where it keeps them

_STATE_DICT = "state and param_groups"
_OPTIMIZER = f"an optimizer's state dict ({_STATE_DICT})"


@dataclass(frozen=True)
class Found:
    """One role's tensors: what showed them to be that role, where they were, who says so."""

    role: str
    by: str  # KEY, ENTRY, MARK, FLAT, UNMARKED, PROOF, STATE or FILES
    names: tuple[str, ...] = ()  # the keys, entries or files that held them, as stored
    layout: str = ""  # the layout, as the report names it ("a DCP checkpoint"); "" a plain file
    detail: str = ""  # what completes it, already worded: roles.weight_evidence's result...


@dataclass(frozen=True)
class NoGradients:
    """``path``, a checkpoint of ``layout``'s, keeps no gradients."""

    path: Path
    layout: str
    saves: tuple[str, ...] | None = None  # what it keeps instead (None: it holds none, unsaid)


@dataclass(frozen=True)
class NotGradients:
    """What ``path`` holds where gradients were looked for is ``role`` (``WEIGHT``, shown by
    ``proof``; or ``OPTIMIZER_STATE``): under ``--key key``, else the whole ``file``."""

    path: Path
    role: str
    proof: str = ""
    key: str | None = None
    file: str = "the file"
    whose: str = "a model's"  # whose weights they are: an adapter's (roles.weights_of)


def wording(*facts: Found | NoGradients | NotGradients) -> Wording:
    """The evidence and the reason no gradients are measured, from ``facts``."""
    said: dict[str, str] = {}
    error = None
    for fact in facts:
        if isinstance(fact, Found):
            said[fact.role] = evidence(fact)
            if fact.by == UNMARKED:
                said[roles.WEIGHT] = said[fact.role]
        elif isinstance(fact, NoGradients):
            verb = "holds" if fact.saves is None else "saves"
            error = f"{fact.path}: {fact.layout} {verb} no gradients" + (
                f" ({', '.join(fact.saves)})" if fact.saves else "")
        else:
            held = _OPTIMIZER if fact.role == roles.OPTIMIZER_STATE else \
                f"{fact.whose} weights ({fact.proof})"
            where = f"{fact.file} is" if fact.key is None else f"--key {fact.key} holds"
            error = f"{fact.path}: {where} {held}, not gradients"
    return Wording((), said.get(roles.WEIGHT), said.get(roles.OPTIMIZER_STATE),
                   gradient_error=error, gradient_evidence=said.get(roles.GRADIENT))


def evidence(fact: Found) -> str:
    """The report's evidence for one role, from what showed it: a description line,
    escaped here (its names and ``detail`` arrive raw, as refusals quote them too)."""
    f, shown = replace(fact, detail=visible(fact.detail)), [visible(n) for n in fact.names]
    at = f"{f.layout}: " if f.layout else ""
    entries = [visible(quoted(n)) for n in f.names]
    kind = "entry" if len(entries) == 1 else "entries"
    if f.by == MARK:
        return f"{f.layout}, {shown[0]}: {f.detail}" if f.layout else \
            "gradclip's mark: save_grads wrote it"
    if f.by == KEY:
        proof = _STATE_DICT if f.role == roles.OPTIMIZER_STATE else f.detail
        return f"{at}--key {shown[0]}" + (f": {proof}" if proof else "")
    if f.by == ENTRY and f.layout:
        also = f", {_STATE_DICT}" if f.role == roles.OPTIMIZER_STATE else ""
        return f"{at}its {', '.join(entries)} {kind}{also}"
    if f.by == ENTRY:
        if f.role == roles.GRADIENT:
            return f"a {entries[0]} key"
        return f"the {' and '.join(entries)} {kind}" + (
            f": {f.detail}" if f.detail else "")
    if f.by in (FLAT, UNMARKED):
        other = "something else" if f.by == UNMARKED else "weights"
        return f"{at}{f.detail} that nothing marks as {other}"
    if f.by == STATE:
        return f"a state dict with {_STATE_DICT}"
    if f.by == PROOF:
        return f"{at}{f.detail}"
    owned = f"{f.layout} " if f.layout.endswith("'s") else at  # FILES
    return owned + ", ".join(shown) + (f", {f.detail}" if f.detail else "")
