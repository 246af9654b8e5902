"""The weighted sum of a split's INT2 value codes for per-token value groups, in vector registers across tokens.

Per query row the value partial is ``sum_t w[t] * (codes[t] * scale[t, g] + offset[t, g])``. The codes' part is
summed here per channel (unpacked from the bytes in registers), the offsets' part per group (``sum_t w[t] *
offset[t, g]``, spread over the group's channels by the caller), and the weights' sum with it. Numba's own loop
would load and store every accumulator for every token (arrays may overlap), 4x slower: this is LLVM vector IR that
keeps them in registers.
"""

from __future__ import annotations

import numpy as np

from .bits import fma_reference
from .ir import LANES
from .jit import NUMBA


def accumulate_values_reference(acc, acc_at, codes, weights, weight_at, weight_stride, scales, offsets, sums, sums_at,
                                n, d4, width, group_bytes, rows):
    """:func:`accumulate_values` as the NumPy loop it replaces (same operations, same order, in place)."""
    groups = d4 // group_bytes
    byte = np.arange(d4)
    chunk, lane = byte // width, byte % width
    for t in range(n):
        token_codes = codes[t * d4:(t + 1) * d4].astype(np.int32)
        token_scales = scales[t * groups + byte // group_bytes]
        for r in range(rows):
            w = weights[weight_at + t * weight_stride + r]
            wv = (w * token_scales).astype(np.float32)
            for i in range(4):
                at = acc_at + ((chunk * LANES + r) * 4 + i) * width + lane
                acc[at] = fma_reference(wv, ((token_codes >> (2 * i)) & 3).astype(np.float32), acc[at])
            at = sums_at + r * (groups + 1)
            sums[at] = sums[at] + w
            sums[at + 1:at + 1 + groups] = fma_reference(np.full(groups, w, np.float32),
                                                         offsets[t * groups:(t + 1) * groups], sums[at + 1:at + 1 + groups])


if NUMBA:
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    from .bits import fused
    from .ir import (
        F32,
        I32,
        array_data,
        as_i64,
        code_planes,
        i64,
        loop_end,
        loop_start,
        per_row_count,
        splat,
        undef,
        vector_at,
    )

    @intrinsic
    def accumulate_values(typingctx, acc, acc_at, codes, weights, weight_at, weight_stride, scales, offsets, sums,
                          sums_at, n, d4, width, group_bytes, rows):
        """For ``rows`` query rows (1 .. LANES) and ``n`` tokens, in place (float32 arrays, flat):

        * ``acc[acc_at + ((m * LANES + r) * 4 + i) * width + lane]`` += ``w[t, r] * scales[t * G + g]`` times the
          code ``i`` (bits 2i, 2i+1) of byte ``m * width + lane`` of token ``t`` (``codes[t * d4 + byte]``, uint8),
          summed over the tokens in order with one fused multiply-add per token; ``g = byte // group_bytes``;
        * ``sums[sums_at + r * (G + 1)]`` += ``w[t, r]`` and ``sums[sums_at + r * (G + 1) + 1 + g]`` +=
          ``w[t, r] * offsets[t * G + g]`` (fused), over the tokens in order;

        with ``w[t, r] = weights[weight_at + t * weight_stride + r]`` and ``G = d4 // group_bytes`` groups.
        ``d4`` (bytes per token), ``width`` (4, 8 or 16 bytes per vector, dividing d4) and ``group_bytes`` (a
        multiple or divisor of width) are literals; ``width`` or ``group_bytes`` 0 or less emits no code (for a
        caller's branch that head_dims without a vector width never take). The NumPy loop:
        :func:`accumulate_values_reference`."""
        if not all(isinstance(x, types.IntegerLiteral) for x in (d4, width, group_bytes)) or \
                not isinstance(rows, types.Integer):
            return None
        nd4, w, gb = d4.literal_value, width.literal_value, group_bytes.literal_value
        signature = types.void(acc, acc_at, codes, weights, weight_at, weight_stride, scales, offsets, sums, sums_at, n,
                               d4, width, group_bytes, rows)
        if w <= 0 or gb <= 0:
            return signature, lambda context, builder, sig, args: context.get_dummy_value()
        groups = nd4 // gb

        def codegen(context, builder, sig, args):
            acc_p, codes_p, wt_p, sc_p, off_p, sums_p = (array_data(context, builder, sig.args[i], args[i])
                                                         for i in (0, 2, 3, 6, 7, 8))
            acc_at_, wt_at, wt_stride, sums_at_, n_ = (as_i64(context, builder, args[i], sig.args[i])
                                                      for i in (1, 4, 5, 9, 10))
            rows_v = as_i64(context, builder, args[14], sig.args[14])
            vf, vs = ir.VectorType(F32, w), ir.VectorType(F32, groups + 1)

            def acc_at_chunk(chunk, r, i):
                return vector_at(builder, acc_p, builder.add(acc_at_, i64(((chunk * LANES + r) * 4 + i) * w)), vf)

            def sums_at_row(r):
                return vector_at(builder, sums_p, builder.add(sums_at_, i64(r * (groups + 1))), vs)

            def scales_of(row, chunk):
                # the scale of each of the chunk's bytes: one group's, or the w // gb groups it spans, spread
                g0 = chunk * w // gb
                if gb >= w:
                    return splat(builder, builder.load(builder.gep(sc_p, [builder.add(row, i64(g0))])), w)
                sv = undef(ir.VectorType(F32, w // gb))
                for g in range(w // gb):
                    sv = builder.insert_element(sv, builder.load(builder.gep(sc_p, [builder.add(row, i64(g0 + g))])),
                                                ir.Constant(I32, g))
                return builder.shuffle_vector(sv, undef(sv.type), ir.Constant(ir.VectorType(I32, w),
                                                                              [lane // gb for lane in range(w)]))

            def offsets_of(row):
                # [1, offset of group 0, ..., of group G - 1]: the weights' sum and the offsets' sums in one fma
                ov = builder.insert_element(undef(vs), ir.Constant(F32, 1.0), ir.Constant(I32, 0))
                for g in range(groups):
                    ov = builder.insert_element(ov, builder.load(builder.gep(off_p, [builder.add(row, i64(g))])),
                                                ir.Constant(I32, g + 1))
                return ov

            def loop(lanes, chunk, with_sums):
                # one pass over the tokens for byte chunk `chunk`; with_sums: also the weights' and offsets' sums
                accs0 = [builder.load(acc_at_chunk(chunk, r, i), align=4) for r in range(lanes) for i in range(4)]
                sums0 = [builder.load(sums_at_row(r), align=4) for r in range(lanes)] if with_sums else []
                loop_ = loop_start(builder, "values", n_, accs0 + sums0)
                t, phis = loop_[:2]
                planes = code_planes(builder, codes_p, builder.add(builder.mul(t, i64(nd4)), i64(chunk * w)), w)
                row = builder.mul(t, i64(groups))
                scale = scales_of(row, chunk)
                ov = offsets_of(row) if with_sums else None
                wt_row = builder.add(wt_at, builder.mul(t, wt_stride))
                new, new_sums = [], []
                for r in range(lanes):
                    p = builder.load(builder.gep(wt_p, [builder.add(wt_row, i64(r))]))
                    wv = builder.fmul(splat(builder, p, w), scale)
                    new += [fused(builder, wv, planes[i], phis[r * 4 + i]) for i in range(4)]
                    if with_sums:
                        new_sums.append(fused(builder, splat(builder, p, groups + 1), ov, phis[lanes * 4 + r]))
                loop_end(builder, loop_, 1, new + new_sums)
                for m, v in enumerate(phis[:lanes * 4]):
                    builder.store(v, acc_at_chunk(chunk, *divmod(m, 4)), align=4)
                for r, v in enumerate(phis[lanes * 4:]):
                    builder.store(v, sums_at_row(r), align=4)

            def emit(lanes):
                for chunk in range(nd4 // w):
                    loop(lanes, chunk, chunk == 0)

            per_row_count(builder, rows_v, emit)
            return context.get_dummy_value()

        return signature, codegen
