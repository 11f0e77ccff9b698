"""The key vocabulary: top-level keys under which training scripts keep the model and the
optimizer, shared by every layout that reads a state dict (a single file, a DCP folder).

Gradients have theirs in ``source/locate.py`` (``GRADIENT_KEYS``).
"""

from __future__ import annotations

WEIGHT_KEYS = ("model", "model_state_dict", "state_dict", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_state")
