"""accelerate's FSDP checkpoints: ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, both DCP.

With ``state_dict_type="SHARDED_STATE_DICT"`` (accelerate's default for
FSDP2), ``Accelerator.save_state`` and the Trainer's ``checkpoint-N/`` save
through ``accelerate.utils.save_fsdp_model`` and ``save_fsdp_optimizer``:
each writes one DCP folder inside the checkpoint folder,
``pytorch_model_fsdp_<i>/`` holding ``{"model": model_state}`` and
``optimizer_<i>/`` holding ``{"optimizer": get_optimizer_state_dict(...)}``
(state and param groups keyed by parameter name). A Trainer adds
``trainer_state.json`` beside them, read for the step.

Recognised by content: a folder holding ``pytorch_model_fsdp_<i>/.metadata``.
Each DCP folder is read by the DCP folder reader (``dcp_folder``: the
allow-list metadata reader, the layout checks, chunks read on demand), its
keys named as the ``dcp`` layout names them; this module only puts the
model's weights and every optimizer's state together. Each subfolder is
also a checkpoint on its own, for gradclip given it directly.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import roles
from gradclip_cli.source.files.dcp_metadata import METADATA_NAME
from gradclip_cli.source.interface import Contents

from . import dcp, hf_trainer
from .dcp_folder import DcpFolder, read_folder
from .draft import Draft
from .facts import FILES, Found, NoGradients, wording
from .paths import inside

KIND = "accelerate-fsdp"
_MODEL = re.compile(r"pytorch_model_fsdp_(\d+)")
_OPTIMIZER = re.compile(r"optimizer_(\d+)")


def recognises(path: Path) -> bool:
    return bool(_parts(path, _MODEL))


def _parts(path: Path, pattern: re.Pattern) -> list[str]:
    """The subfolders of ``path`` named by ``pattern`` that hold DCP metadata, by number."""
    try:
        names = os.listdir(path) if os.path.isdir(path) else []
    except OSError:
        return []
    found = [n for n in names if pattern.fullmatch(n)
             and os.path.isfile(os.path.join(path, n, METADATA_NAME))]
    return sorted(found, key=lambda n: int(pattern.fullmatch(n).group(1)))


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    models = _parts(path, _MODEL)
    if len(models) > 1:
        raise InputError(
            f"{path}: holds {len(models)} FSDP models ({', '.join(models)}); "
            "give the folder of the one to read")
    contents = Draft(path=path, kind=KIND)
    contents.step = hf_trainer.global_step(path)
    model = _read_part(path, models[0], verify=verify, trust_pickle=trust_pickle)
    contents.weights = dcp.model_weights(model)
    said = "an accelerate FSDP checkpoint"
    contents.say(wording(Found(roles.WEIGHT, FILES, (f"{models[0]}/",), said)))
    contents.files += model.files
    optimizers = _parts(path, _OPTIMIZER)
    for name in optimizers:
        part = _read_part(path, name, verify=verify, trust_pickle=trust_pickle)
        tops = dcp.optimizer_tops(part)
        if not tops:
            raise InputError(f"{path / name / METADATA_NAME}: holds no optimizer state")
        contents.optimizers += [dcp.optimizer(part, top) for top in tops]
        contents.files += part.files
    if optimizers:
        contents.say(wording(Found(roles.OPTIMIZER_STATE, FILES,
                                   tuple(f"{n}/" for n in optimizers), said)))
    if key is not None:
        dcp.fill_gradients(contents, model, key, f"{said} ({models[0]}/)")
    else:
        contents.say(wording(NoGradients(path, said)))
    if os.path.exists(path / hf_trainer.STATE):
        contents.files.append(path / hf_trainer.STATE)
    step = f" at global_step {contents.step}" if contents.step is not None else ""
    held = ", ".join(f"{visible(n)}/" for n in optimizers)
    contents.description.append(
        f"accelerate FSDP checkpoint{step}: {visible(models[0])}/ "
        f"({len(contents.weights or {})} weights), "
        + (f"{held} (optimizer state)" if held else "no optimizer state"))
    return contents.finish()


def _read_part(path: Path, name: str, *, verify: bool, trust_pickle: bool) -> DcpFolder:
    """One of the checkpoint's DCP folders (checked to stay inside it), read and checked."""
    return read_folder(inside(path, name, named_by=path), verify=verify,
                       trust_pickle=trust_pickle)
