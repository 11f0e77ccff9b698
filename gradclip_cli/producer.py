"""Write a model's gradients to a file that gradclip reads.

This is the producing side of gradclip: call :func:`save_grads` in a training
loop right after ``loss.backward()`` (and before ``optimizer.zero_grad()``),
then run ``gradclip inspect`` on the file, offline or in CI.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gradclip_cli.core.elements import apart, distinct_elements
from gradclip_cli.distributed import dtensor
from gradclip_cli.sink.atomic import atomic_write
from gradclip_cli.sink.safetensors_file import write_safetensors
from gradclip_cli.source.interface import Checkpoint
from gradclip_cli.source.roles import MARK_GRADIENTS, MARK_KEY

__all__ = ["save_grads"]


def save_grads(model: torch.nn.Module, path: str | os.PathLike[str], /, **extra: Any) -> None:
    """Save every parameter gradient of ``model`` to ``path``.

    The file holds ``{"grads": {name: grad}, "gradclip": "gradients", **extra}``
    written with :func:`torch.save`, so it loads with ``torch.load(path,
    weights_only=True)`` and ``gradclip inspect`` finds the gradients under
    ``grads`` by itself; ``"gradclip": "gradients"`` is gradclip's mark, the
    evidence that the tensors are gradients (in a safetensors file's metadata
    too).

    Each gradient is a detached copy moved to the CPU: later optimizer steps,
    ``zero_grad()`` or in-place updates do not change what was saved.
    Gradients that share elements (overlapping views of one buffer, one tensor
    given to two parameters, an expansion) are copied together and stay views
    of one copy, so that ``gradclip inspect`` counts each element once and
    reports the total the drop-ins and ``GradMonitor`` give for them; a
    ``.safetensors`` file cannot hold such views (``ValueError``: save to a
    ``.pt`` path). Names are those of ``model.named_parameters()``:

    - parameters whose ``.grad`` is ``None`` (frozen, or unused in the
      backward pass) are left out;
    - a parameter registered under several names (tied weights, such as a
      language model head sharing the token embedding) appears once, under the
      first name ``named_parameters()`` yields.

    DTensor gradients (FSDP2, tensor parallel) are saved whole: each is
    gathered with ``full_tensor()``, a collective, so every rank must call
    ``save_grads``; rank 0 writes the file and the other ranks write nothing.

    When ``path`` ends with ``.safetensors`` the file is a safetensors file of
    the gradients alone, and ``extra`` becomes its header metadata, which the
    format restricts to text: every value must then be a ``str``.

    The file is written atomically: the data goes to a temporary file in the
    same folder, which then replaces ``path`` in one step, so a crash never
    leaves a half-written file behind (and an older file at ``path`` stays
    whole until the new one is complete).

    Args:
        model: the module whose parameters' ``.grad`` are saved.
        path: where to write; a ``.safetensors`` suffix selects that format,
            anything else (``.pt``, ``.pth``, ``.bin``, ...) is a torch file.
        **extra: further top-level entries saved beside ``grads`` (a step
            number, a config dict, ...); for ``.safetensors``, text metadata.
            Keep them to plain Python values and tensors so the file still
            loads with ``weights_only=True``. ``model`` and ``path`` are
            positional-only, so a whole training checkpoint can be written
            with ``model=model.state_dict()`` among the extras.

    Raises:
        ValueError: no parameter has a gradient; ``extra`` has a ``grads``
            entry; or, for ``.safetensors``, an ``extra`` value is not a
            ``str``, a gradient is not a dense floating-point tensor, or
            gradients share elements.
        gradclip_cli.errors.OutputError: the file could not be written (or
            ``torch.save`` failed on an ``extra`` value); ``path`` is untouched.

    Example::

        >>> import torch
        >>> from gradclip_cli.producer import save_grads
        >>> model = torch.nn.Linear(4, 2)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> save_grads(model, "grads.pt", step=1200)
        >>> sorted(torch.load("grads.pt", weights_only=True)["grads"])
        ['bias', 'weight']

    Then, from a shell: ``gradclip inspect grads.pt --max-norm 1.0``.
    """
    grads = _detached_grads(model)
    if grads is None:
        return  # DTensor gradients gathered for rank 0, which writes them
    if not grads:
        raise ValueError(
            "save_grads: no parameter of the model has a gradient; "
            "call it after loss.backward() and before optimizer.zero_grad()"
        )
    if "grads" in extra or MARK_KEY in extra:
        raise ValueError(
            "save_grads: 'grads' is the gradient entry itself and 'gradclip' its mark; "
            "give the extra another name"
        )

    if Path(path).suffix.lower() == ".safetensors":
        metadata = {MARK_KEY: MARK_GRADIENTS, **(_text_metadata(extra) or {})}
        atomic_write(Path(path), _safetensors_writer(grads, metadata))
    else:
        payload = {"grads": grads, MARK_KEY: MARK_GRADIENTS, **extra}
        # Saving to a file object (not a name) also keeps the zip's inner
        # folder name fixed ("archive/") instead of the temporary file's name.
        atomic_write(Path(path), lambda file: torch.save(payload, file))


def _detached_grads(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """``{name: copy of p.grad on the CPU}``; named_parameters() already drops tied duplicates.

    A DTensor gradient (FSDP2, tensor parallel) is gathered whole with
    ``full_tensor()``, a collective: every rank must call, and ranks other
    than 0 get None (they write nothing).
    """
    named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    grads = [g for _, g in named]
    if dtensor.has_dtensor(grads):
        import torch.distributed as dist

        with torch.no_grad():
            whole = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        grads = whole
    return dict(zip((name for name, _ in named), _cpu_copies(grads)))


def _cpu_copies(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``grads`` on the CPU, sharing elements where the gradients do.

    A gradient whose elements no other one names is copied as it is. Gradients
    that share elements (overlapping views of one buffer, one tensor given to
    two parameters, an expansion of fewer stored elements) are copied as one
    span of their storage and rebuilt as the same views of the copy:
    ``torch.save`` then stores each element once, and ``gradclip inspect``
    counts and clips it once, as the monitor and the drop-ins do (separate
    copies would count it once per view: the file would not inspect to the
    total the monitor logged).
    """
    grads = [g.detach() for g in grads]
    copies = [g.to("cpu", copy=True) for g in grads] if apart(grads) else [None] * len(grads)
    if all(c is not None for c in copies):
        return copies
    elements = distinct_elements(grads)
    spans: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        shared = g.layout == torch.strided and g.numel() and (
            elements.shares[i] or elements.count(i) != g.numel())
        if shared:
            key = (g.device, g.untyped_storage().data_ptr(), g.dtype)
            spans.setdefault(key, []).append(i)
        else:
            copies[i] = g.to("cpu", copy=True)
    for members in spans.values():
        views = [grads[i] for i in members]
        lo = min(v.storage_offset() for v in views)
        hi = max(v.storage_offset() + sum((n - 1) * s for n, s in zip(v.shape, v.stride()))
                 for v in views) + 1
        span = views[0].as_strided((hi - lo,), (1,), lo).to("cpu", copy=True)
        for i, v in zip(members, views):
            copies[i] = span.as_strided(v.shape, v.stride(), v.storage_offset() - lo)
    return copies


def _text_metadata(extra: Mapping[str, Any]) -> dict[str, str] | None:
    not_text = {
        key: type(value).__name__ for key, value in extra.items() if not isinstance(value, str)
    }
    if not_text:
        listed = ", ".join(f"{key} ({kind})" for key, kind in not_text.items())
        raise ValueError(
            "save_grads: extra entries of a .safetensors file become its header metadata, "
            f"which holds text only; not str: {listed}. "
            "Pass str values, or save to a .pt path to keep other values."
        )
    return dict(extra) or None


def _sharing(grads: list[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first gradient whose elements another one shares or it repeats."""
    tensors = [g for _, g in grads]
    if apart(tensors):
        return None
    elements = distinct_elements(tensors)
    for i, (name, g) in enumerate(grads):
        if g.numel() and (elements.shares[i] or elements.count(i) != g.numel()):
            return name
    return None


def _safetensors_writer(
    grads: dict[str, torch.Tensor], metadata: dict[str, str] | None
) -> Callable[[BinaryIO], None]:
    """Check the gradients fit the format, then hand them to the sink's safetensors writer."""
    for name, grad in grads.items():
        if not grad.is_floating_point() or grad.layout != torch.strided:
            raise ValueError(
                f"save_grads: gradient {name!r} ({grad.dtype}, {grad.layout}) "
                "cannot be stored in a .safetensors file; save to a .pt path instead"
            )
    shared = _sharing(list(grads.items()))
    if shared:
        raise ValueError(
            f"save_grads: gradient {shared!r} shares elements with another or repeats its own "
            "(views of one buffer, an expansion); a .safetensors file would store, and "
            "gradclip inspect count, each element once per view: save to a .pt path instead"
        )
    # Widest elements first, as the safetensors library orders them: with the
    # header padded to 8 bytes, every tensor then starts at a multiple of its
    # element size, which readers that map the file need to view it in place.
    ordered = dict(sorted(grads.items(), key=lambda item: -item[1].element_size()))
    checkpoint = Checkpoint(path=Path(), format="safetensors", root=ordered, metadata=metadata)
    return lambda file: write_safetensors(checkpoint, file)
