"""gradclip: gradient diagnostics for PyTorch.

The Python API mirrors ``torch.nn.utils`` (same names, arguments and in-place
behaviour) with totals that are accurate and never overflow or underflow
spuriously; ``save_grads`` writes a model's gradients to a file gradclip reads.
"""

__version__ = "0.1.0"
