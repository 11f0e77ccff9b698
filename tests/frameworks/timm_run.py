"""Save with timm's own ``CheckpointSaver`` after 2 epochs of a small BatchNorm CNN.

Run in the frameworks venv: ``python timm_run.py OUT``. timm is installed
there without its dependencies: its package import pulls torchvision, whose
PyPI build is a CUDA one that breaks beside CPU torch. So ``CheckpointSaver``
is loaded from its own file (``timm/utils/checkpoint_saver.py``), and the one
module that file imports (``.model``: ``unwrap_model``, ``get_state_dict``) is
given as timm defines it for a plain module: unwrapping is the identity.

Writes ``OUT/{sgd,adamw}/checkpoint-{0,1}.pth.tar`` (and ``last.pth.tar``):
SGD with Nesterov momentum (timm's default optimizer) and AdamW, no ``args``;
``OUT/adamw_args/``, AdamW saved with ``args`` as timm's ``train.py`` does
(an ``argparse.Namespace``); and ``OUT/{lamb,lars}/``, timm's own LAMB and
LARS (trust-ratio optimizers keeping Adam's and SGD's state), loaded from
their files as the saver is.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch


def checkpoint_saver():
    spec = importlib.util.find_spec("timm")
    source = Path(spec.submodule_search_locations[0]) / "utils" / "checkpoint_saver.py"
    package = types.ModuleType("_timm_utils")
    package.__path__ = []
    helpers = types.ModuleType("_timm_utils.model")
    helpers.unwrap_model = lambda model: model
    helpers.get_state_dict = lambda model, unwrap_fn=helpers.unwrap_model: unwrap_fn(
        model
    ).state_dict()
    sys.modules["_timm_utils"] = package
    sys.modules["_timm_utils.model"] = helpers
    module_spec = importlib.util.spec_from_file_location("_timm_utils.checkpoint_saver", source)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.CheckpointSaver


def timm_optimizers():
    """timm's ``Lamb`` and ``Lars``, from ``timm/optim/lamb.py`` and ``lars.py``: their
    package is given its real folder, so their own imports (``._helpers``, ``._types``)
    are timm's files, without the package's ``__init__``."""
    spec = importlib.util.find_spec("timm")
    folder = Path(spec.submodule_search_locations[0]) / "optim"
    package = types.ModuleType("_timm_optim")
    package.__path__ = [os.fspath(folder)]
    sys.modules["_timm_optim"] = package
    classes = []
    for name, cls in (("lamb", "Lamb"), ("lars", "Lars")):
        module_spec = importlib.util.spec_from_file_location(
            f"_timm_optim.{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        classes.append(getattr(module, cls))
    return classes


def main(out: Path) -> None:
    saver_class = checkpoint_saver()
    lamb, lars = timm_optimizers()
    runs = (
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), None),
        ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2), None),
        (
            "adamw_args",
            lambda p: torch.optim.AdamW(p, lr=1e-2),
            argparse.Namespace(model="tiny_cnn", lr=1e-2, epochs=2, opt="adamw"),
        ),
        ("lamb", lambda p: lamb(p, lr=1e-2, weight_decay=0.01), None),
        ("lars", lambda p: lars(p, lr=0.1, momentum=0.9, weight_decay=0.01), None),
    )
    for name, make, args in runs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(2, 3, 3),
            torch.nn.BatchNorm2d(3),
            torch.nn.Flatten(),
            torch.nn.Linear(48, 2),
        )
        opt = make(model.parameters())
        folder = out / name
        folder.mkdir(parents=True)
        saver = saver_class(
            model,
            opt,
            args=args,
            checkpoint_dir=os.fspath(folder),
            recovery_dir=os.fspath(folder),
            max_history=2,
        )
        for epoch in range(2):
            x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(epoch))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            saver.save_checkpoint(epoch, metric=float(epoch))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
