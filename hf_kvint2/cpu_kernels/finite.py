"""The update's NaN/Inf check on CPU: one compiled pass over the new K and V.

Every update's check (:func:`hf_kvint2.layers.validate_kv`) reads the float bits (an all-ones exponent is NaN or Inf)
instead of the ~5 PyTorch ops and host sync of a reduction (~100 us per layer inside a decode step, where the
model's weights have evicted them from the caches).
"""

from __future__ import annotations

import numpy as np
import torch

from .jit import NUMBA

_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.float16: (torch.int16, 0x7C00),
                  torch.bfloat16: (torch.int16, 0x7F80)}

if NUMBA:
    from .jit import njit

    @njit
    def _count_nonfinite_in(x, exponent):
        # x: a rank-4 integer view of floats (any strides): elements whose exponent bits are all set (NaN, Inf)
        bad = 0
        for a in range(x.shape[0]):
            for b in range(x.shape[1]):
                for c in range(x.shape[2]):
                    for e in range(x.shape[3]):
                        bad += (x[a, b, c, e] & exponent) == exponent
        return bad

    @njit
    def _count_nonfinite(k_bits, v_bits, exponent):
        return _count_nonfinite_in(k_bits, exponent) + _count_nonfinite_in(v_bits, exponent)

    @njit
    def _count_nonfinite_floats_in(x):
        # x: rank-4 float32 (any strides); no fast-math here, so isfinite sees NaN and Inf
        bad = 0
        for a in range(x.shape[0]):
            for b in range(x.shape[1]):
                for c in range(x.shape[2]):
                    for e in range(x.shape[3]):
                        bad += not np.isfinite(x[a, b, c, e])
        return bad

    @njit
    def _count_nonfinite_floats(k, v):
        return _count_nonfinite_floats_in(k) + _count_nonfinite_floats_in(v)


def finite_check_supports(x: torch.Tensor) -> bool:
    """Whether :func:`all_finite` serves ``x``: rank-4 float32/float16/bfloat16 on CPU, eager."""
    return (NUMBA and x.device.type == "cpu" and x.dim() == 4 and x.dtype in _EXPONENT_BITS
            and not torch.compiler.is_compiling())


def all_finite(k: torch.Tensor, v: torch.Tensor) -> bool:
    """No NaN/Inf in ``k`` or ``v`` (of one dtype, each served by :func:`finite_check_supports`): float32 read as
    floats, 16-bit floats (which numpy lacks or Numba cannot check) by their exponent bits."""
    k, v = (k.detach() if k.requires_grad else k), (v.detach() if v.requires_grad else v)
    if k.dtype == torch.float32:  # no bit views: each tensor op costs microseconds inside a model's step
        return not _count_nonfinite_floats(k.numpy(), v.numpy())
    view, exponent = _EXPONENT_BITS[k.dtype]
    return not _count_nonfinite(k.view(view).numpy(), v.view(view).numpy(), exponent)
