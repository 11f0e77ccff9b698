"""OLMo-core gradient dumps: what its ``GradientDumperCallback`` writes between backward and step.

The callback (``olmo_core.train.callbacks.gradient_dumper``, in OLMo-core's
repository; no release ships it yet) runs in ``pre_optim_step``, so what it saves
are the gradients the optimizer is about to use. Per dumped step it writes
``<work_dir>/gradient_dumper/stepN/`` holding one of:

* ``full_gradients/``: every parameter's gradient, each rank its shard, as a DCP
  folder through OLMo-core's ``save_state_dict`` (``save_first_n`` unset): the
  gradients by the model's parameter names, whole;
* ``sampled_gradients/<name>_first<n>.safetensors``: with ``save_first_n=N``,
  rank 0 gathers each full gradient and keeps its first ``n = min(N, rows)``
  rows along dimension 0, one file per parameter holding the tensor
  ``gradient``. A sample: its norms are the sample's, not the gradient's, and
  the report says so.

Recognised by content: a ``stepN/`` folder inside ``gradient_dumper/`` that holds
``full_gradients/.metadata`` or ``sampled_gradients/``, or either of those folders
given itself. The step is the folder's N. Measured as ``grads`` (the evidence
names the dumper); the dump holds no weights nor optimizer state. ``clip`` writes
a full dump back as the DCP folder it is; a sample is refused.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gradclip_cli.errors import InputError
from gradclip_cli.escaping import visible
from gradclip_cli.source import load_checkpoint, roles
from gradclip_cli.source.files.dcp_metadata import METADATA_NAME
from gradclip_cli.source.interface import Contents, StoredTensor
from gradclip_cli.source.vocabulary import step_after

from . import dcp, dcp_folder
from . import dcp_frameworks as frameworks
from .draft import Draft
from .facts import MARK, Found, wording
from .paths import inside

KIND = "olmo-core-gradients"
DUMPER, FULL, SAMPLED = "gradient_dumper", "full_gradients", "sampled_gradients"
_SAMPLE = re.compile(r"(.+)_first(\d+)\.safetensors")
_SAID = "OLMo-core's GradientDumperCallback"


def _step_folder(path: Path) -> Path | None:
    """The dump's ``stepN/`` folder: ``path`` itself, or its parent where ``path`` is the
    full or sampled folder; None where ``path`` is not one."""
    for folder, inner in ((path, None), (path.parent, path.name)):
        if not (step_after(folder.name, "step") is not None and folder.parent.name == DUMPER):
            continue
        full = os.path.isfile(folder / FULL / METADATA_NAME)
        sampled = os.path.isdir(folder / SAMPLED)
        if (inner is None and (full or sampled)) or (inner == FULL and full) or (
            inner == SAMPLED and sampled
        ):
            return folder
    return None


def recognises(path: Path) -> bool:
    return os.path.isdir(path) and _step_folder(path) is not None


def open(path: Path, *, key: str | None, trust_pickle: bool, verify: bool) -> Contents:
    frameworks.refuse_key(path, key, "an OLMo-core gradient dump")
    folder = _step_folder(path)
    assert folder is not None  # recognised
    step = step_after(folder.name, "step")
    full, sampled = folder / FULL, folder / SAMPLED
    has_full = os.path.isfile(full / METADATA_NAME)
    if path.name == SAMPLED or (path == folder and not has_full):
        contents = _sampled(path, sampled, verify=verify)
    elif path == folder and os.path.isdir(sampled):
        raise InputError(
            f"{folder}: holds both {FULL}/ and {SAMPLED}/ (two dumps of one step); "
            f"give the one to read"
        )
    else:
        contents = _full(path, full, trust_pickle=trust_pickle, verify=verify)
    contents.step = step
    contents.description.insert(0, f"OLMo-core gradient dump at step {step}: "
                                    f"{visible(folder.name)}/ of {DUMPER}/")
    return contents.finish()


def _full(path: Path, full: Path, *, trust_pickle: bool, verify: bool) -> Draft:
    """The DCP folder of whole gradients, by parameter name."""
    found = dcp_folder.read_folder(full, verify=verify, trust_pickle=trust_pickle)
    if not found.tensors or not all(len(p) == 1 for p in found.paths.values()):
        raise InputError(
            f"{found.metadata_file}: not a gradient dump: its entries are not one flat "
            "name -> tensor mapping"
        )
    contents = Draft(path=path, kind=KIND, files=found.files, index=found.metadata_file,
                     folder=found.folder, trusted_pickle=found.trusted)
    contents.gradients = dict(found.tensors)
    contents.say(wording(Found(roles.GRADIENT, MARK, (f"{FULL}/",), _SAID,
                               "saved in pre_optim_step, the gradients the optimizer stepped on")))
    contents.description.append(
        f"{len(found.tensors)} whole gradients in {found.chunk_count} chunks, "
        f"{len(found.files) - 1} DCP files"
    )
    return contents


def _sampled(path: Path, sampled: Path, *, verify: bool) -> Draft:
    """One safetensors file per parameter, each the first rows of its gradient."""
    try:
        names = sorted(os.listdir(sampled))
    except OSError as error:
        raise InputError(f"{sampled}: cannot be listed ({error.strerror})") from None
    gradients: dict[str, StoredTensor] = {}
    files, rows = [], set()
    for file_name in names:
        match = _SAMPLE.fullmatch(file_name)
        if match is None:
            raise InputError(
                f"{sampled / file_name}: not a sampled gradient "
                "(<name>_first<n>.safetensors)"
            )
        name, n = match.group(1), int(match.group(2))
        file = inside(sampled, file_name, named_by=sampled)
        ckpt = load_checkpoint(file, trust_pickle=False, verify=verify)
        if ckpt.format != "safetensors" or set(ckpt.root) != {"gradient"}:
            raise InputError(f"{file}: holds no single tensor 'gradient', as the dumper writes")
        tensor = ckpt.root["gradient"]
        if tensor.dim() == 0 or tensor.shape[0] != n:
            raise InputError(
                f"{file}: its name says the first {n} rows, but it holds "
                f"{list(tensor.shape)}"
            )
        if name in gradients:
            raise InputError(f"{file}: a second sample of {name}")
        gradients[name] = StoredTensor.whole(name, tensor, file)
        files.append(file)
        rows.add(n)
    if not gradients:
        raise InputError(f"{sampled}: holds no sampled gradient")
    contents = Draft(path=path, kind=KIND, files=files)
    contents.gradients = gradients
    contents.say(wording(Found(roles.GRADIENT, MARK, (f"{SAMPLED}/",), _SAID,
                               "saved in pre_optim_step, the first rows of each gradient")))
    shown = ", ".join(str(n) for n in sorted(rows))
    contents.description.append(
        f"a sample, not the whole gradients: the first {shown} rows (dimension 0) of each "
        f"of {len(gradients)} gradients (save_first_n); every norm here is the sample's"
    )
    return contents


def write_back(contents: Contents):
    """A full dump is written back as the DCP folder it is; a sample (the first rows of
    each gradient) is refused: clipping it by its own norm would not clip the gradients."""
    if contents.folder is None:
        raise InputError(
            f"{contents.path}: a sampled gradient dump holds the first rows of each gradient "
            "only: its norm is not the gradients', so it is not clipped"
        )
    return dcp.write_back(contents)
