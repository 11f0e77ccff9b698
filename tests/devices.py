"""The devices a device-generic test runs on, as torch's own device-type tests do: the
CPU always, CUDA where there is one (marked ``cuda``, skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda,
           pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)
DEVICES = ["cpu", CUDA]
