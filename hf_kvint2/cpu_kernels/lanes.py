"""A dot product with its summation order stated: the full-precision windows' scores and the query's key-mean logits.

Numba would sum ``x[c] * y[c]`` one term after another (a chain of dependent adds); vectorizing it needs fast-math's
licence to reorder, which the kernels do without (see :mod:`.jit`). :func:`dot` fixes an order that vectorizes.
"""

from __future__ import annotations

import numpy as np

from .jit import NUMBA


def dot_reference(x: np.ndarray, y: np.ndarray, width: int) -> np.float32:
    """:func:`dot` in NumPy: ``width`` lanes of running sums over the chunks of ``width`` values (a fused
    multiply-add per lane and chunk, emulated in float64), then the lanes folded in halves."""
    acc = x[:width].astype(np.float32) * y[:width].astype(np.float32)
    for c in range(width, len(x), width):
        acc = (x[c:c + width].astype(np.float64) * y[c:c + width] + acc).astype(np.float32)
    while len(acc) > 1:
        acc = acc[:len(acc) // 2] + acc[len(acc) // 2:]
    return acc[0]


if NUMBA:
    from numba.core import types
    from numba.extending import intrinsic

    from .bits import fused
    from .ir import array_data, as_i64, fold_to_scalar, i64, load_vector, loop_end, loop_start

    @intrinsic
    def dot(typingctx, x, x_at, y, y_at, n, width):
        """``sum(x[x_at + c] * y[y_at + c] for c in range(n))`` for float32 arrays, n a multiple of the literal
        ``width`` (4, 8 or 16), in this order (:func:`dot_reference`): lane u accumulates the terms c = u, u + width,
        u + 2 width, ... (the first a product, the rest fused multiply-adds), then lanes are added in halves
        (u + width / 2 onto u, and so on) down to one."""
        if not isinstance(width, types.IntegerLiteral) or not all(
                isinstance(a, types.Array) and a.dtype == types.float32 for a in (x, y)):
            return None
        w = width.literal_value

        def codegen(context, builder, sig, args):
            x_a, y_a = args[0], args[2]
            x_at_, y_at_, n_ = (as_i64(context, builder, args[i], sig.args[i]) for i in (1, 3, 4))
            x_p, y_p = array_data(context, builder, sig.args[0], x_a), array_data(context, builder, sig.args[2], y_a)
            first = builder.fmul(load_vector(builder, x_p, x_at_, w), load_vector(builder, y_p, y_at_, w))
            loop = loop_start(builder, "dot", builder.sub(n_, i64(w)), [first])
            c, (acc,) = loop[:2]
            c = builder.add(c, i64(w))
            acc_next = fused(builder, load_vector(builder, x_p, builder.add(x_at_, c), w),
                             load_vector(builder, y_p, builder.add(y_at_, c), w), acc)
            loop_end(builder, loop, w, [acc_next])
            return fold_to_scalar(builder, loop[1][0])

        return types.float32(x, x_at, y, y_at, n, width), codegen

