"""litgpt adapter fine-tuning folders: ``out/finetune/<method>/step-NNNNNN/lit_model.pth.<method>``.

litgpt's three adapter fine-tunings, ``finetune_lora``, ``finetune_adapter``
(LLaMA-Adapter, Zhang et al. 2023) and ``finetune_adapter_v2`` (LLaMA-Adapter
V2, Gao et al. 2023), save at every ``save_interval``
``<out_dir>/step-{step_count:06d}/``, and at the end ``<out_dir>/final/``:

* the adapter's tensors alone, ``torch.save({"model": ...})`` of the model's
  state dict filtered to what the method trains: ``lit_model.pth.lora``
  (``save_lora_checkpoint``: every ``lora_`` entry, ``lora_A``/``lora_B``),
  ``lit_model.pth.adapter`` (``adapter_filter``: the prompts ``adapter_wte``
  and their ``gating_factor``), ``lit_model.pth.adapter_v2`` (those, each
  linear layer's ``adapter_bias``/``adapter_scale``, and the norms it trains).
  No model, no optimizer, no step: the base model's weights stay in the
  checkpoint fine-tuning started from;
* ``model_config.yaml`` (copied from the base checkpoint),
  ``hyperparameters.yaml``, ``prompt_style.yaml`` and the tokenizer's files.

LoRA's ``final/`` also holds ``lit_model.pth``, the base model with the
adapter merged in (``merge_lora``), which the ``litgpt`` layout reads first;
the two LLaMA-Adapters' ``final/`` holds the adapter alone, read here.

Recognised by content: a folder holding one of those files and
``model_config.yaml``, or that file itself, also when copied away from its
folder (the file name is litgpt's alone; a copy has no step). What it holds is measured as what
it is, the adapter's weights, not the model's (kind ``litgpt-lora``,
``litgpt-adapter`` or ``litgpt-adapter-v2``); the step is the folder's number,
litgpt's ``step_count`` (optimizer steps) when it saved.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.interface import Contents, stored

from .draft import Draft
from .facts import FILES, Found, NoGradients, wording
from .paths import member

KIND = "litgpt-adapter"
CONFIG_FILE = "model_config.yaml"
_STEP = re.compile(r"step-(\d+)")
_SAID = "litgpt's"


@dataclass(frozen=True)
class Method:
    """One of litgpt's adapter fine-tunings, as its files and the report name it."""

    kind: str
    title: str  # "litgpt LoRA checkpoint"
    command: str  # the litgpt command that saves it
    whose: str  # whose weights: Contents.weights_of
    held: str  # which tensors its 'model' entry holds


METHODS: dict[str, Method] = {
    "lit_model.pth.lora": Method(
        "litgpt-lora", "litgpt LoRA checkpoint", "finetune_lora", "the LoRA adapter's",
        "the adapter's lora_ tensors"),
    "lit_model.pth.adapter": Method(
        KIND, "litgpt Adapter checkpoint", "finetune_adapter", "the LLaMA-Adapter's",
        "the adapter's adapter_wte and gating_factor tensors"),
    "lit_model.pth.adapter_v2": Method(
        "litgpt-adapter-v2", "litgpt Adapter v2 checkpoint", "finetune_adapter_v2",
        "the LLaMA-Adapter v2's",
        "the adapter's adapter_ tensors, gating factors and the norms it trains"),
}


def _folder_of(path: Path) -> Path | None:
    if os.path.isdir(path):
        return path
    if path.name in METHODS and os.path.isfile(path):
        return Path(os.path.abspath(path)).parent
    return None


def recognises(path: Path) -> bool:
    folder = _folder_of(path)
    if folder is None:
        return False
    if folder != path:  # the file itself: its name is litgpt's alone, config or not
        return True
    return os.path.isfile(folder / CONFIG_FILE) and any(
        os.path.isfile(folder / name) for name in METHODS)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    folder = _folder_of(path)
    assert folder is not None  # recognises() said so
    if folder != path:
        name = path.name
    else:
        held = [name for name in METHODS if os.path.isfile(folder / name)]
        if len(held) > 1:
            raise InputError(f"{path}: holds {' and '.join(held)}, two litgpt adapters; "
                             "give one of the files")
        name = held[0]
    method = METHODS[name]
    file = member(folder, name)
    if key is not None:
        raise InputError(f"{file}: --key: a {method.title} holds one thing, "
                         f"{method.whose} weights; drop --key")
    ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
    root = ckpt.root
    entry = root.get("model", root) if isinstance(root, Mapping) else None
    if not isinstance(entry, Mapping) or not entry:
        raise InputError(f"{file}: not a {method.title}: its 'model' entry is not "
                         "name -> tensor")
    adapter = stored({str(k): v for k, v in entry.items() if hasattr(v, "dtype")}, file)
    contents = Draft(path=path, kind=method.kind, files=[file], checkpoint=ckpt,
                     trusted_pickle=ckpt.trusted_pickle)
    contents.weights, contents.weights_of = adapter, method.whose
    named = _STEP.fullmatch(folder.name)
    contents.step = int(named.group(1)) if named else None
    at = f" at step {contents.step}" if contents.step is not None else ""
    contents.description.append(
        f"{method.title}{at}: {name}, {method.whose} weights alone ({len(adapter)} tensors; "
        f"{method.command} saves no optimizer and no model beside them)")
    contents.say(wording(
        Found(roles.WEIGHT, FILES, (f"{folder.name}/{name}",), _SAID,
              f"its 'model' entry, {method.held}"),
        NoGradients(path, f"a {method.title}", (f"{method.whose} weights",)),
    ))
    return contents.finish()
