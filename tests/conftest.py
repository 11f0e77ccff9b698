"""Every test sees a pipe's width (120 columns) unless it sets ``COLUMNS`` itself.

A ``COLUMNS`` exported by the shell or the CI runner would otherwise change
where the table shortens names and drops optional columns, in this process
and in every process a test starts. Assertions on prose do not depend on
where it wraps either (``tests/cli/support.py``, ``logical_lines``): a
temporary path's length moves every break.
"""

from __future__ import annotations

import os


def pytest_configure(config):
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
    # Without a GPU, Triton's kernels (core/triton_norms.py) run in its interpreter,
    # which must be chosen before Triton is first imported (tests/core/test_triton_norms.py).
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
