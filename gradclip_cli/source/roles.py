"""What each tensor of a checkpoint is, from evidence the files carry (the contract's roles).

A tensor is a gradient, a weight (a model parameter), a buffer (running
statistics and counters), optimizer state, or something else. Layouts know
most roles from their structure (a Trainer's ``model.safetensors`` holds
weights, its ``optimizer.pt`` optimizer state). A flat ``name -> tensor``
mapping is the ambiguous case: it is gradients only when nothing marks it as
something else. Evidence that it is a model's weights, strongest first:

* torch's ``_metadata`` (``Module.state_dict()`` returns an ``OrderedDict``
  carrying each module's version; a dict of gradients has none);
* buffer names (``running_mean``, ``running_var``, ``num_batches_tracked``
  of BatchNorm and InstanceNorm). Integer tensors are never weights or
  gradients (they are set apart as buffers), but alone they are no evidence:
  scripts save counters beside gradients;
* a model folder's ``config.json`` beside the file, or a framework's weight
  file name (``model.safetensors``, ``pytorch_model.bin``, ``lit_model.pth``,
  ``model-00001-of-00002.safetensors``...).

gradclip's own mark says gradients: ``save_grads`` (and so ``GradMonitor``)
writes ``"gradclip": "gradients"`` beside the gradients, in a safetensors
file's metadata too. A mark or a ``grads`` key that contradicts other
evidence (buffers among "gradients") is an error naming both sides.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradclip_cli.errors import InputError
from gradclip_cli.source import optimizers
from gradclip_cli.source.interface import Contents, StoredTensor

GRADIENT, WEIGHT, BUFFER, OPTIMIZER_STATE, OTHER = (
    "gradient", "weight", "buffer", "optimizer state", "other")
# Not a tensor's role: the optimizer's parameter names, a key of ``Contents.missing``.
PARAMETER_NAMES = "parameter names"
MARK_KEY = "gradclip"  # what save_grads writes beside the gradients
MARK_GRADIENTS = "gradients"
BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")
_WEIGHT_FILE = re.compile(
    r"(model|pytorch_model|lit_model|consolidated|adapter_model|diffusion_pytorch_model)"
    r"([-.]\d+(-of-\d+)?)?\.(safetensors|bin|pth|pt)|hf_model_\d+_\d+\.pt|"
    r"model-\d+-of-\d+\.(safetensors|bin|pt)|"
    r"layer_\d+(-model_\d+)?-model_states\.pt")  # a DeepSpeed PipelineModule layer's weights


# An adapter's weights saved apart from its model: PEFT's (and torchtune's) adapter_model.*.
_ADAPTER_FILE = re.compile(r"adapter_model\.(safetensors|bin|pth|pt)")
ADAPTERS = "an adapter's"


def weights_of(file: Path | None) -> str:
    """Whose weights a weight file named ``file`` holds where they are not the model's
    (``Contents.weights_of``): an adapter's, saved apart from its model; "" otherwise."""
    return ADAPTERS if file is not None and _ADAPTER_FILE.fullmatch(file.name) else ""


@dataclass(frozen=True)
class Role:
    """One tensor's role and the evidence for it; for optimizer state, whose and which."""

    name: str
    role: str
    evidence: str
    optimizer: str | None = None
    state_key: str | None = None
    parameter: str | None = None


def is_buffer(name: str, tensor: Any) -> bool:
    """A running statistic or counter by name, or any tensor that is not floating point."""
    if name.rsplit(".", 1)[-1] in BUFFER_NAMES:
        return True
    dtype = getattr(tensor, "dtype", None)
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex)


def split_buffers(tensors: Mapping[str, StoredTensor]
                  ) -> tuple[dict[str, StoredTensor], dict[str, StoredTensor]]:
    """``(parameters, buffers)`` of a model's state dict, each in the given order."""
    params = {n: t for n, t in tensors.items() if not is_buffer(n, t)}
    buffers = {n: t for n, t in tensors.items() if n not in params}
    return params, buffers


def marked_as_gradients(root: Any, metadata: Mapping[str, str] | None = None) -> bool:
    """gradclip's own mark: ``save_grads`` wrote this file."""
    if metadata is not None and metadata.get(MARK_KEY) == MARK_GRADIENTS:
        return True
    return isinstance(root, Mapping) and root.get(MARK_KEY) == MARK_GRADIENTS


def weight_evidence(mapping: Mapping[str, Any], *, file: Path | None = None,
                    folder: Path | None = None) -> str | None:
    """Why a flat ``name -> tensor`` mapping is a model's weights, or None when nothing says so.

    ``file``: the file it was read from (its name is evidence); ``folder``: the
    folder of the checkpoint (a ``config.json`` there is evidence).
    """
    if isinstance(getattr(mapping, "_metadata", None), Mapping):
        return "a state_dict: torch's _metadata"
    names = [str(n) for n in mapping]
    buffers = [n for n in names if n.rsplit(".", 1)[-1] in BUFFER_NAMES]
    if buffers:
        return f"a model's buffers: {buffers[0]}"
    if weights_of(file):
        return f"an adapter's weight file name: {file.name}"
    if file is not None and _WEIGHT_FILE.fullmatch(file.name):
        return f"a model's weight file name: {file.name}"
    if folder is not None and os.path.isfile(folder / "config.json"):
        return "a model folder: config.json beside it"
    return None


def contradiction(gradients: Mapping[str, Any], said: str) -> None:
    """Gradients that are a model's state dict (buffers, torch's ``_metadata``): exit 3
    naming both sides."""
    buffers = [str(n) for n in gradients if str(n).rsplit(".", 1)[-1] in BUFFER_NAMES]
    if buffers:
        raise InputError(f"{said} says gradients, but it holds a model's buffers "
                         f"({buffers[0]}): gradients have no running statistics")
    if isinstance(getattr(gradients, "_metadata", None), Mapping):
        raise InputError(f"{said} says gradients, but it is a model's state_dict (torch's "
                         "_metadata): a module's weights, not gradients")


class KeyNotGradients(InputError):
    """A ``--key`` that names, holds or lies inside a model's weights or an optimizer's
    state: not gradients. The message offers what ``inspect`` measures there;
    ``refusal`` is the line without that remedy, for ``clip``, which changes saved
    gradients only and words its own (the contract: "clip never offers weights or
    optimizer state")."""

    def __init__(self, message: str, refusal: str):
        super().__init__(message)
        self.refusal = refusal


def not_gradients(said: str, key: str, relation: str, entry: str, whole: str,
                  measured_whole: bool = True) -> KeyNotGradients:
    """A ``--key`` that ``relation`` (lies inside, holds, is) ``entry``, a model's weights or
    an optimizer's state dict (``whole`` says which, and why): not gradients. gradclip
    measures such an entry only whole, as what it is, where ``measured_whole``; else
    (below a DCP folder's top level) not at all."""
    remedy = (f"gradclip measures it whole (gradclip inspect --key {entry})"
              if measured_whole else
              "gradclip reads a DCP folder's weights and optimizer state at its top level only")
    # Raw: the line is escaped once, whole, where it is shown.
    refusal = f"{said}: --key '{key}' {relation} '{entry}', {whole}: not gradients"
    return KeyNotGradients(f"{refusal}; {remedy}", refusal)


def describe(contents: Contents) -> list[Role]:
    """Every tensor of ``contents`` with its role, in one list: the checkpoint's description."""
    out: list[Role] = []
    ev = contents.evidence
    for name in contents.gradients or {}:
        out.append(Role(name, GRADIENT, ev.get(GRADIENT, contents.kind)))
    if contents.weights is not contents.gradients:
        for name in contents.weights or {}:
            out.append(Role(name, WEIGHT, ev.get(WEIGHT, contents.kind)))
    for name in contents.buffers or {}:
        out.append(Role(name, BUFFER, "buffer names and integer dtypes"))
    for opt in contents.optimizers:
        kind = optimizers.identify(opt)
        names = opt.param_names or {}
        for pid, entry in opt.state.items():
            for key, value in entry.items():
                if isinstance(value, StoredTensor):
                    out.append(Role(f"{pid}.{key}", OPTIMIZER_STATE,
                                    ev.get(OPTIMIZER_STATE, contents.kind), kind.name, key,
                                    names.get(pid, str(pid))))
    return out


def role_counts(contents: Contents) -> dict[str, int]:
    """How many tensors of ``contents`` have each role (``describe``), for the report."""
    counts: dict[str, int] = {}
    for role in describe(contents):
        counts[role.role] = counts.get(role.role, 0) + 1
    return counts
