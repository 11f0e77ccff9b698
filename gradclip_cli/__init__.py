"""gradclip: gradient diagnostics for PyTorch.

The Python API mirrors ``torch.nn.utils`` (same names, arguments and in-place
behaviour) with totals that are accurate and never overflow or underflow
spuriously; ``save_grads`` writes a model's gradients to a file gradclip reads;
``GradMonitor`` logs them every training step and saves the ones that spike.
``inspect`` and ``trend`` return the reports ``gradclip inspect`` and
``gradclip trend`` format (``inspection.py``); their errors are
``GradclipError``, carrying the command's message and exit code.

The package installs as ``gradclip`` and imports as ``gradclip_cli``;
``import gradclip`` gives the same names (``gradclip/__init__.py``).
"""

__version__ = "0.1.0"

# Imported on first use (PEP 562), so that the CLI can silence torch's
# import-time "Failed to initialize NumPy" warning before torch loads.
_EXPORTS = {
    "GradMonitor": "monitor",
    "adaptive_clip_grad_": "api",
    "clip_grad_norm_": "api",
    "clip_grad_value_": "api",
    "clip_grads_with_norm_": "api",
    "get_total_norm": "api",
    "save_grads": "producer",
    # Inspection: the commands' reports, in Python. (``autopsy`` joins these
    # once its command lands: one more line here, its function in inspection.py.)
    "inspect": "inspection",
    "trend": "inspection",
    "render": "inspection",
    "exit_code": "inspection",
    "GradclipError": "errors",
    "UsageError": "errors",
    "InputError": "errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's own names and every public one, loaded or not (a REPL's completion)."""
    return sorted({*globals(), *__all__})
