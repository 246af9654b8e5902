"""Shared test configuration and fixtures."""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter (tests/test_kernels.py). Triton reads
# TRITON_INTERPRET when it is first imported (torch._dynamo imports it early), so set it before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
