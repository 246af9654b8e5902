"""Key scores of per-channel key groups (OScaR's keys), with a token's codes unpacked in vector registers.

A per-channel group of tokens shares one scale and offset per channel: ``q . k_t = (q * scale) . code_t + q .
offset``, so per group the query rows are multiplied by the scales once, and per token only the codes vary. Numba's
loops do not vectorize a dot with the token's channels in the lanes; this LLVM vector IR does, and adds the rows'
products of ``block`` tokens together by folding pairs of vectors (about 3 operations per token and row instead of
a horizontal sum's 2 log2(width)).
"""

from __future__ import annotations

import numpy as np

from .bits import fma_reference
from .jit import NUMBA


def _fold_halves(v: np.ndarray) -> np.float32:
    while len(v) > 1:
        v = v[:len(v) // 2] + v[len(v) // 2:]
    return v[0]


def channel_key_scores_reference(scores, score_at, score_stride, codes, q_planes, q_rows, q_at, group_scale, group_lo,
                                 group_at, norm, norm_at, bias, bias_at, n, d4, width, block, rows):
    """:func:`channel_key_scores` as the NumPy loop it replaces (same operations, same order, in place)."""
    d, chunks = 4 * d4, d4 // width
    lane = np.arange(width)
    for r in range(rows):
        q_plane = q_planes[q_at + r * d:q_at + (r + 1) * d]
        q_row = q_rows[q_at + r * d:q_at + (r + 1) * d]
        scaled = [[(q_plane[i * d4 + m * width + lane] * group_scale[group_at + 4 * (m * width + lane) + i])
                   .astype(np.float32) for i in range(4)] for m in range(chunks)]
        lo = q_row[:width] * group_lo[group_at:group_at + width]
        for c in range(1, d // width):
            lo = fma_reference(q_row[c * width:(c + 1) * width], group_lo[group_at + c * width:group_at + (c + 1) * width],
                               lo)
        lo = _fold_halves(lo)
        for t in range(n):
            token = codes[t * d4:(t + 1) * d4].astype(np.int32)
            acc = None
            for m in range(chunks):
                for i in range(4):
                    code = ((token[m * width + lane] >> (2 * i)) & 3).astype(np.float32)
                    acc = (scaled[m][i] * code).astype(np.float32) if acc is None else \
                        fma_reference(scaled[m][i], code, acc)
            score = np.float32(_fold_halves(acc) + lo)
            scores[score_at + t * score_stride + r] = fma_reference(score, norm[norm_at + t], bias[bias_at + r])


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
        fold_pairs,
        fold_to_scalar,
        i64,
        lane_list,
        load_vector,
        loop_end,
        loop_start,
        per_row_count,
        splat,
        undef,
        vector_at,
    )

    @intrinsic
    def channel_key_scores(typingctx, scores, score_at, score_stride, codes, q_planes, q_rows, q_at, group_scale,
                           group_lo, group_at, norm, norm_at, bias, bias_at, n, d4, width, block, rows):
        """Key scores of one per-channel group for ``rows`` query rows (1 .. LANES) and ``n`` of its tokens (a
        multiple of ``block``), head_dim D = 4 d4, in place (float32 arrays, flat)::

            scores[score_at + t * score_stride + r] = fma((q_r * group_scale) . code_t + q_r . group_lo,
                                                          norm[norm_at + t], bias[bias_at + r])

        with ``q_r = q_rows[q_at + r * D ..]`` (channel order), ``q_planes`` the same rows in the codes' plane order
        (channel 4j + i at i * d4 + j), the group's scales and offsets at ``group_at`` (channel order), and token
        t's d4 code bytes at ``codes[t * d4]``. Both dots run over ``width``-lane vectors in a fixed order (chunk by
        chunk, plane by plane; the first term a product, the rest fused multiply-adds) and their lanes are folded
        in halves. ``d4``, ``width`` (4, 8 or 16, dividing d4) and ``block`` (tokens folded together: 1 or width) are
        literals; ``width`` 0 emits no code (for a caller's branch that head_dims without a vector width never
        take). The NumPy loop: :func:`channel_key_scores_reference`."""
        if not all(isinstance(x, types.IntegerLiteral) for x in (d4, width, block)) or \
                not isinstance(rows, types.Integer):
            return None
        nd4, w, bt = d4.literal_value, width.literal_value, block.literal_value
        signature = types.void(scores, score_at, score_stride, codes, q_planes, q_rows, q_at, group_scale, group_lo,
                               group_at, norm, norm_at, bias, bias_at, n, d4, width, block, rows)
        if w <= 0:
            return signature, lambda context, builder, sig, args: context.get_dummy_value()
        chunks, d = nd4 // w, 4 * nd4

        def codegen(context, builder, sig, args):
            sc_p, codes_p, qp_p, qr_p, gs_p, gl_p, norm_p, bias_p = (array_data(context, builder, sig.args[i], args[i])
                                                                     for i in (0, 3, 4, 5, 7, 8, 10, 12))
            sc_at, sc_stride, q_at_, g_at, norm_at_, bias_at_, n_, rows_v = (
                as_i64(context, builder, args[i], sig.args[i]) for i in (1, 2, 6, 9, 11, 13, 14, 18))

            def load(p, offset):
                return load_vector(builder, p, offset, w)

            def scale_planes(m):  # the scales of bytes m * w .. in plane order: a stride-4 deinterleave of 4 vectors
                parts = [load(gs_p, builder.add(g_at, i64(4 * m * w + u * w))) for u in range(4)]
                ab = builder.shuffle_vector(parts[0], parts[1], lane_list(list(range(2 * w))))
                cd = builder.shuffle_vector(parts[2], parts[3], lane_list(list(range(2 * w))))
                return [builder.shuffle_vector(ab, cd, lane_list([4 * lane + i for lane in range(w)])) for i in range(4)]

            def row_offset(r, x):
                return builder.add(q_at_, i64(r * d + x))

            def offsets_dot(r):  # q_r . group_lo
                dot = None
                for c in range(d // w):
                    q, lo = load(qr_p, row_offset(r, c * w)), load(gl_p, builder.add(g_at, i64(c * w)))
                    dot = builder.fmul(q, lo) if dot is None else fused(builder, q, lo, dot)
                return fold_to_scalar(builder, dot)

            scales = [scale_planes(m) for m in range(chunks)]

            def emit(lanes):
                qv = [[[builder.fmul(load(qp_p, row_offset(r, i * nd4 + m * w)), scales[m][i]) for i in range(4)]
                       for m in range(chunks)] for r in range(lanes)]
                lo = [splat(builder, offsets_dot(r), bt) for r in range(lanes)]
                bias = [splat(builder, builder.load(builder.gep(bias_p, [builder.add(bias_at_, i64(r))])), bt)
                        for r in range(lanes)]
                loop_ = loop_start(builder, "scores", n_)
                t = loop_[0]
                stacks = [[] for _ in range(lanes)]  # per row: (vector, its tokens, segment), folded as tokens come
                for tt in range(bt):
                    token = builder.add(t, i64(tt))
                    sums = [None] * lanes
                    for m in range(chunks):
                        planes = code_planes(builder, codes_p, builder.add(builder.mul(token, i64(nd4)), i64(m * w)), w)
                        for i, plane in enumerate(planes):
                            for r in range(lanes):
                                sums[r] = builder.fmul(qv[r][m][i], plane) if sums[r] is None else \
                                    fused(builder, qv[r][m][i], plane, sums[r])
                    for r in range(lanes):
                        stack = stacks[r]
                        stack.append((sums[r], [tt], w))
                        while len(stack) > 1 and len(stack[-1][1]) == len(stack[-2][1]) and stack[-1][2] > 1:
                            (b_vec, b_tok, seg), (a_vec, a_tok, _) = stack.pop(), stack.pop()
                            stack.append((fold_pairs(builder, a_vec, b_vec, seg), a_tok + b_tok, seg // 2))
                norms = builder.load(vector_at(builder, norm_p, builder.add(norm_at_, t), ir.VectorType(F32, bt)),
                                     align=4)
                for r in range(lanes):
                    (vec, toks, seg), = stacks[r]
                    while seg > 1:  # fold within the vector until one lane per token
                        vec, seg = fold_pairs(builder, vec, vec, seg), seg // 2
                    vec = builder.shuffle_vector(vec, undef(vec.type), lane_list([toks.index(j) for j in range(bt)]))
                    vec = fused(builder, builder.fadd(vec, lo[r]), norms, bias[r])  # lane j: token t + j
                    for j in range(bt):
                        at = builder.add(sc_at, builder.add(builder.mul(builder.add(t, i64(j)), sc_stride), i64(r)))
                        builder.store(builder.extract_element(vec, ir.Constant(I32, j)), builder.gep(sc_p, [at]))
                loop_end(builder, loop_, bt)

            per_row_count(builder, rows_v, emit)
            return context.get_dummy_value()

        return signature, codegen
