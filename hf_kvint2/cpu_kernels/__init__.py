"""Numba CPU kernels (optional: ``pip install '.[cpu]'`` in a clone): the INT2 body's attention, a dynamic layer's
whole decode step, the write path's quantizer and the update's NaN/Inf check.

Modules, in the order data flows through a decode step:

* :mod:`.calls`: the entry points from PyTorch (:func:`body_attention`, the ``"numba"`` body backend of
  :mod:`hf_kvint2.backends`, and :func:`layer_step_attention`), the numpy views they pass and the split-K choice;
* :mod:`.kernel`: the parallel kernel (one per head_dim) and the records it takes (a stream of the body, the
  windows, the mask); its stages: :mod:`.windows` (query rotation, full-precision windows, the final merge),
  :mod:`.keys` (a split's key scores), :mod:`.softmax` (weights, the split merge), :mod:`.values` (weighted values);
* vector intrinsics written as LLVM IR, each with the NumPy loop it replaces: :mod:`.key_scores`,
  :mod:`.value_sums`, :mod:`.lanes`, built from :mod:`.ir`; scalar ones and stored-value widening in :mod:`.bits`;
* :mod:`.quantizer` (the write path) and :mod:`.finite` (the NaN/Inf check);
* :mod:`.jit`: how everything here is compiled (no fast-math, so results do not depend on where the code was
  compiled; a disk cache keyed by this package's source; one line when a process compiles).
"""

from .calls import (
                    SPLIT_COST_TOKENS,
                    SPLIT_MAX_ROWS,
                    SPLIT_MIN_TOKENS,
                    body_attention,
                    kernel_threads,
                    layer_step_attention,
                    serves_layer_step,
                    split_tokens,
)
from .finite import all_finite, finite_check_supports
from .jit import available
from .quantizer import (
                    QUANTIZER_TOP_MAX,
                    TokenGroupQuantizer,
                    quantize_token_groups,
                    quantizer_serves_layout,
                    quantizer_supports,
                    token_group_quantizer,
)

__all__ = [
                    "QUANTIZER_TOP_MAX",
                    "SPLIT_COST_TOKENS",
                    "SPLIT_MAX_ROWS",
                    "SPLIT_MIN_TOKENS",
                    "TokenGroupQuantizer",
                    "all_finite",
                    "available",
                    "body_attention",
                    "finite_check_supports",
                    "kernel_threads",
                    "layer_step_attention",
                    "quantize_token_groups",
                    "quantizer_serves_layout",
                    "quantizer_supports",
                    "serves_layer_step",
                    "split_tokens",
                    "token_group_quantizer",
]
