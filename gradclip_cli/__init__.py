"""gradclip: gradient diagnostics for PyTorch.

The Python API mirrors ``torch.nn.utils`` (same names, arguments and in-place
behaviour) with totals that are accurate and never overflow or underflow
spuriously; ``save_grads`` writes a model's gradients to a file gradclip reads;
``GradMonitor`` logs them every training step and saves the ones that spike.
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
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
