"""litgpt LoRA fine-tuning folders: ``out/finetune/lora/step-NNNNNN/lit_model.pth.lora``.

``litgpt finetune_lora`` saves at every ``save_interval``
``<out_dir>/step-{step_count:06d}/``, and at the end ``<out_dir>/final/``:

* ``lit_model.pth.lora``: ``torch.save({"model": ...})`` of the LoRA
  adapter's tensors alone (``save_lora_checkpoint``: every ``lora_``
  entry of the model's state dict, ``lora_A``/``lora_B``). No model, no
  optimizer, no step: the base model's weights stay in the checkpoint
  fine-tuning started from;
* ``model_config.yaml`` (copied from the base checkpoint),
  ``hyperparameters.yaml``, ``prompt_style.yaml`` and the tokenizer's files.

``final/`` also holds ``lit_model.pth``, the base model with the adapter
merged in (``merge_lora``), which the ``litgpt`` layout reads first.

Recognised by content: a folder holding ``lit_model.pth.lora`` and
``model_config.yaml``, or that file itself. What it holds is measured as what
it is, the adapter's weights, not the model's; the step is the folder's
number, litgpt's ``step_count`` (optimizer steps) when it saved.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.interface import Contents, stored

from .draft import Draft
from .facts import FILES, Found, NoGradients, wording
from .paths import member

KIND = "litgpt-lora"
ADAPTER_FILE, CONFIG_FILE = "lit_model.pth.lora", "model_config.yaml"
_STEP = re.compile(r"step-(\d+)")
_SAID = "litgpt's"
ADAPTERS = "the LoRA adapter's"


def recognises(path: Path) -> bool:
    if os.path.isdir(path):
        folder = path
    elif path.name == ADAPTER_FILE and os.path.isfile(path):
        folder = Path(os.path.abspath(path)).parent
    else:
        return False
    return os.path.isfile(folder / ADAPTER_FILE) and os.path.isfile(folder / CONFIG_FILE)


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    folder = path if os.path.isdir(path) else Path(os.path.abspath(path)).parent
    file = member(folder, ADAPTER_FILE)
    if key is not None:
        raise InputError(f"{file}: --key: a litgpt LoRA checkpoint holds one thing, "
                         "the LoRA adapter's weights; drop --key")
    ckpt = load_checkpoint(file, trust_pickle=trust_pickle, verify=verify)
    root = ckpt.root
    held = root.get("model", root) if isinstance(root, Mapping) else None
    if not isinstance(held, Mapping) or not held:
        raise InputError(f"{file}: not a litgpt LoRA checkpoint: its 'model' entry is not "
                         "name -> tensor")
    adapter = stored({str(k): v for k, v in held.items() if hasattr(v, "dtype")}, file)
    contents = Draft(path=path, kind=KIND, files=[file], checkpoint=ckpt,
                     trusted_pickle=ckpt.trusted_pickle)
    contents.weights, contents.weights_of = adapter, ADAPTERS
    named = _STEP.fullmatch(folder.name)
    contents.step = int(named.group(1)) if named else None
    at = f" at step {contents.step}" if contents.step is not None else ""
    contents.description.append(
        f"litgpt LoRA checkpoint{at}: {ADAPTER_FILE}, {ADAPTERS} weights alone "
        f"({len(adapter)} tensors; finetune_lora saves no optimizer and no model beside them)")
    contents.say(wording(
        Found(roles.WEIGHT, FILES, (f"{folder.name}/{ADAPTER_FILE}",), _SAID,
              "its 'model' entry, the adapter's lora_ tensors"),
        NoGradients(path, "a litgpt LoRA checkpoint", (f"{ADAPTERS} weights",)),
    ))
    return contents.finish()
