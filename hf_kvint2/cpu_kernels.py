"""Numba CPU kernel for the INT2 body partial attention (optional: ``pip install '.[cpu]'`` in a clone).

Same contract as :func:`hf_kvint2.read_path.body_partial_blocked` (its PyTorch fallback; registered in
:mod:`hf_kvint2.backends`). The query rows of one KV head (``groups * query_len``, padded to a multiple of four)
are scored together: per-token key groups' scores come from a per-(row, KV head) table of ``q . codes`` for every
byte value (d/4 lookups per token), per-channel groups' from the codes unpacked in vector registers
(:func:`_channel_key_scores`); values are weighted and summed with their codes unpacked likewise
(:func:`_accumulate_values`; both written as LLVM vector IR). Split-K: the body's tokens are cut into splits
(:func:`split_tokens`: at batch 1 a step would otherwise have as many parallel tasks as KV heads), one parallel task
per (batch row, KV head, split) writes an unnormalised partial softmax, and the splits are merged by log-sum-exp.
The kernel is compiled per head_dim and pair of layouts, so that its loop bounds are constants (about 3x faster
inner loops than with runtime bounds), and cached on disk (``NUMBA_CACHE_DIR``). Nothing of the size of a layer's
full-precision K/V history is allocated.

:func:`layer_step_attention` is the same kernel's variant for a whole decode step of a dynamic layer: it also
rotates the query, attends the full-precision windows and merges everything in the original space (one call per
layer instead of the read pipeline's small PyTorch ops). :func:`quantize_token_groups` is the write path's
quantizer for per-token groups, :func:`all_finite` the update's NaN/Inf check. The kernel reads scales, offsets
and norms as stored (float16 / bfloat16 bits, widened in registers), not float32 copies of them.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from .quant import QuantizedGroups, scale_range_error
from .read_path import mask_to_additive

# Split-K (cpu_kernels.split_tokens): the body's tokens are split so that a step has work for every thread the kernel
# runs with, no split under SPLIT_MIN_TOKENS tokens, and no split for more query rows per KV head than
# SPLIT_MAX_ROWS. A split has a fixed cost (its partial's set-up and merge; SPLIT_COST_TOKENS counts it as 300 body
# tokens, an upper estimate), so there are as few splits as keep the threads busy: on one thread none. split_tokens
# caches its answers, so these are read once per argument tuple.
SPLIT_COST_TOKENS = 300
SPLIT_MIN_TOKENS = 2048
SPLIT_MAX_ROWS = 64
# The write path's clip quantile: taken from the row's largest |x| kept apart when at most this many (else a sort)
QUANTIZER_TOP_MAX = 16

_NUMBA = importlib.util.find_spec("numba") is not None
# A first call slower than this (the kernel was compiled, not loaded from Numba's disk cache) warns once.
JIT_NOTICE_S = 3.0
_called: set[tuple] = set()  # kernel specialisations already run in this process
_numba_threads = threading.local()  # .count: the Numba thread count this Python thread last set (_run_kernel)


def available() -> bool:
    """True when Numba is installed (the kernel compiles on first use, then is cached on disk)."""
    return _NUMBA


if _NUMBA:
    import numba

    # No 'nnan'/'ninf' fast-math flags: masked scores are -inf.
    _FASTMATH = {"reassoc", "contract", "arcp", "nsz"}

    _CODES = np.array([[(byte >> (2 * i)) & 3 for i in range(4)] for byte in range(256)], np.float32)
    LANES = 4  # query rows are padded to a multiple of this: four rows per pass, in registers

    def _superword_vectorized(fn, *args):
        # Numba leaves LLVM's superword-level (SLP) vectorizer off by default. The kernels' four query rows per
        # pass are four independent scalar chains (key-table sums, softmax sums) that it turns into one
        # vector: 2-2.7x faster inner loops. On for every call (a call with new argument types compiles), and
        # only there, so other Numba code keeps Numba's setting.
        before = numba.config.SLP_VECTORIZE
        numba.config.SLP_VECTORIZE = 1
        try:
            return fn(*args)
        finally:
            numba.config.SLP_VECTORIZE = before


if _NUMBA:
    _LOG2E = np.float32(1.4426950408889634)
    _LN2_HI = np.float32(0.693359375)  # ln 2 in two parts (Cody-Waite): x - n ln 2 without cancellation
    _LN2_LO = np.float32(-2.12194440e-4)
    _EXP_MIN = np.float32(-87.0)  # below it exp(x) underflows float32's normal range: the weight is 0

    # No 'reassoc' here: it would let LLVM fold the two-part ln 2 back into one.
    @numba.njit(fastmath={"contract", "nsz"}, cache=True, nogil=True)
    def _exp_nonpositive(x, pow2):  # pragma: no cover
        # x[k] = exp(x[k]) in place for x <= 0 (softmax scores minus their row's max; -inf gives 0): range
        # reduction x = n ln 2 + r, a degree-6 polynomial for exp(r), 2^n from its float32 bits (pow2: int32
        # scratch of x's size). One loop LLVM vectorizes, unlike the scalar libm exp: 8x faster, within 2 ulp.
        for k in range(x.shape[0]):
            v = x[k]
            vc = max(v, _EXP_MIN)
            n = np.int32(vc * _LOG2E - np.float32(0.5))  # round to nearest for vc <= 0 (truncation toward 0)
            nf = np.float32(n)
            r = vc - nf * _LN2_HI - nf * _LN2_LO
            p = np.float32(1.9875691500e-4)
            p = p * r + np.float32(1.3981999507e-3)
            p = p * r + np.float32(8.3334519073e-3)
            p = p * r + np.float32(4.1665795894e-2)
            p = p * r + np.float32(1.6666665459e-1)
            p = p * r + np.float32(5.0000001201e-1)
            p = p * r * r + r + np.float32(1.0)
            x[k] = p if v >= _EXP_MIN else np.float32(0.0)
            pow2[k] = (n + np.int32(127)) << 23
        two_n = pow2.view(np.float32)
        for k in range(x.shape[0]):
            x[k] = x[k] * two_n[k]


if _NUMBA:
    import llvmlite.binding as llvmlite_binding
    from llvmlite import ir as _llvm_ir
    from numba.core import types as _nb_types
    from numba.extending import intrinsic as _intrinsic

    def _low_bits(builder, v, width: int):
        # the integer value v cut or zero-extended to `width` bits (LLVM IR)
        if v.type.width > width:
            return builder.trunc(v, _llvm_ir.IntType(width))
        return builder.zext(v, _llvm_ir.IntType(width)) if v.type.width < width else v

    # LLVM IR pieces the vector-IR intrinsics below share
    def _vector_at(builder, p, offset, ty):
        # the element pointer p + offset as a pointer to ty (a vector load or store there)
        return builder.bitcast(builder.gep(p, [offset]), ty.as_pointer())

    def _splat(builder, x, count):
        # the float32 x in each of `count` lanes
        i32 = _llvm_ir.IntType(32)
        undef = _llvm_ir.Constant(_llvm_ir.VectorType(_llvm_ir.FloatType(), count), _llvm_ir.Undefined)
        v = builder.insert_element(undef, x, _llvm_ir.Constant(i32, 0))
        return builder.shuffle_vector(v, undef, _llvm_ir.Constant(_llvm_ir.VectorType(i32, count), [0] * count))

    def _code_planes(builder, codes_p, byte_at, w):
        # the 2-bit codes of the w bytes at codes_p + byte_at as four float32 vectors: plane i holds bits 2i, 2i+1
        # of every byte
        vi, vf = _llvm_ir.VectorType(_llvm_ir.IntType(32), w), _llvm_ir.VectorType(_llvm_ir.FloatType(), w)
        raw = builder.load(_vector_at(builder, codes_p, byte_at, _llvm_ir.VectorType(_llvm_ir.IntType(8), w)), align=1)
        word = builder.zext(raw, vi)
        return [builder.sitofp(builder.and_(builder.lshr(word, _llvm_ir.Constant(vi, [2 * i] * w)),
                                            _llvm_ir.Constant(vi, [3] * w)), vf) for i in range(4)]

    def _loop_start(builder, name, n, carried=()):
        # a loop over t = 0, 1 step, ... while t < n carrying the values `carried`: returns (t, their phis, the header
        # and exit blocks) with the builder in the body; _loop_end closes it
        entry = builder.basic_block
        header = builder.append_basic_block(f"{name}_header")
        body = builder.append_basic_block(f"{name}_body")
        done = builder.append_basic_block(f"{name}_done")
        builder.branch(header)
        builder.position_at_end(header)
        t = builder.phi(_llvm_ir.IntType(64))
        t.add_incoming(_llvm_ir.Constant(t.type, 0), entry)
        phis = []
        for v in carried:
            phi = builder.phi(v.type)
            phi.add_incoming(v, entry)
            phis.append(phi)
        builder.cbranch(builder.icmp_signed("<", t, n), body, done)
        builder.position_at_end(body)
        return t, phis, header, done

    def _loop_end(builder, loop, step, carried=()):
        # closes a _loop_start loop: t advances by `step` and its phis take `carried`; the builder moves to the exit
        t, phis, header, done = loop
        end = builder.basic_block
        t.add_incoming(builder.add(t, _llvm_ir.Constant(t.type, step)), end)
        for phi, v in zip(phis, carried):
            phi.add_incoming(v, end)
        builder.branch(header)
        builder.position_at_end(done)

    @_intrinsic
    def _float32_from_bits(typingctx, bits):  # pragma: no cover
        # The float32 whose IEEE bits are the low 32 bits of the integer ``bits`` (a register bit-cast).
        if not isinstance(bits, _nb_types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(_low_bits(builder, args[0], 32), _llvm_ir.FloatType())

        return _nb_types.float32(bits), codegen

    @_intrinsic
    def _float32_from_half_bits(typingctx, bits):  # pragma: no cover
        # The float16 whose bits are the low 16 bits of the integer ``bits``, widened to float32 (exact; one
        # conversion instruction on CPUs with F16C, and it vectorizes).
        if not isinstance(bits, _nb_types.Integer):
            return None

        def codegen(context, builder, signature, args):
            half = builder.bitcast(_low_bits(builder, args[0], 16), _llvm_ir.HalfType())
            return builder.fpext(half, _llvm_ir.FloatType())

        return _nb_types.float32(bits), codegen

    @_intrinsic
    def _two_bit_code(typingctx, byte, shift):  # pragma: no cover
        # (byte >> shift) & 3 as float32, in 32-bit integer arithmetic: Numba widens integer operations to 64 bits,
        # and a loop of 64-bit lanes unpacks half as many codes per vector instruction (1.3x slower key scores)
        if not isinstance(byte, _nb_types.Integer) or not isinstance(shift, _nb_types.Integer):
            return None

        def codegen(context, builder, signature, args):
            i32 = _llvm_ir.IntType(32)
            word = _low_bits(builder, args[0], 32)
            code = builder.and_(builder.lshr(word, _low_bits(builder, args[1], 32)), _llvm_ir.Constant(i32, 3))
            return builder.uitofp(code, _llvm_ir.FloatType())

        return _nb_types.float32(byte, shift), codegen

    def _per_row_count(builder, rows, emit):
        # Calls emit(count) for the runtime row count `rows` (1 .. LANES) as a compile-time one: a copy of the code
        # per count, chosen by a switch (the vector loops keep every row's sums in registers, and a padding row
        # would cost as much as a query row)
        done = builder.append_basic_block("rows_done")
        switch = builder.switch(rows, done)
        for count in range(1, LANES + 1):
            case = builder.append_basic_block(f"rows_{count}")
            switch.add_case(_llvm_ir.Constant(rows.type, count), case)
            builder.position_at_end(case)
            emit(count)
            builder.branch(done)
        builder.position_at_end(done)

    @_intrinsic
    def _accumulate_values(typingctx, acc, acc_at, codes, weights, weight_at, weight_stride, scales, offsets, sums,
                           sums_at, n, d4, width, group_bytes, rows):  # pragma: no cover
        # For `rows` (1 .. LANES) query rows and n tokens of per-token value groups, the codes' part of the value
        # sum in vectors of `width` bytes' codes, in registers across tokens:
        #   acc[acc_at + ((m * LANES + r) * 4 + i) * width + lane] += sum_t w[t, r] * scales[t, g] * code_i(byte)
        # for byte m * width + lane of token t (group g = byte // group_bytes; weights w[t, r] at weight_at + t *
        # weight_stride + r), and the weights' sums: sums[sums_at + r * (G + 1)] += sum_t w[t, r], then per group
        # += sum_t w[t, r] * offsets[t, g] (G = d4 // group_bytes groups). Written as LLVM vector IR: Numba's loops
        # over array slices keep the accumulators in memory (arrays may alias), 4x slower.
        if not all(isinstance(x, _nb_types.IntegerLiteral) for x in (d4, width, group_bytes)) or \
                not isinstance(rows, _nb_types.Integer):
            return None
        nd4, w, gb = d4.literal_value, width.literal_value, group_bytes.literal_value
        groups = nd4 // gb

        def codegen(context, builder, sig, args):
            acc_a, acc_at, codes_a, wt_a, wt_at, wt_stride, sc_a, off_a, sums_a, sums_at, n = args[:11]
            rows_v = args[14]
            i32, i64, f32 = _llvm_ir.IntType(32), _llvm_ir.IntType(64), _llvm_ir.FloatType()
            vf, vi = _llvm_ir.VectorType(f32, w), _llvm_ir.VectorType(i32, w)
            vs = _llvm_ir.VectorType(f32, groups + 1)
            undef = lambda ty: _llvm_ir.Constant(ty, _llvm_ir.Undefined)
            k = lambda x: _llvm_ir.Constant(i64, x)

            def data(index, value):
                return context.make_array(sig.args[index])(context, builder, value).data

            acc_p, codes_p, wt_p, sc_p, off_p, sums_p = (data(0, acc_a), data(2, codes_a), data(3, wt_a), data(6, sc_a),
                                                         data(7, off_a), data(8, sums_a))

            def at(p, offset, ty):
                return _vector_at(builder, p, offset, ty)

            def fma(a, b, c):
                return builder.fadd(c, builder.fmul(a, b, flags=("contract",)), flags=("contract",))

            def loop(lanes, chunk, with_sums):
                # one pass over the tokens for byte chunk `chunk`; with_sums: also the weights' sums
                accs0 = [builder.load(at(acc_p, builder.add(acc_at, k(((chunk * LANES + r) * 4 + i) * w)), vf), align=4)
                         for r in range(lanes) for i in range(4)]
                sums0 = [builder.load(at(sums_p, builder.add(sums_at, k(r * (groups + 1))), vs), align=4)
                         for r in range(lanes)] if with_sums else []
                loop_ = _loop_start(builder, "values", n, accs0 + sums0)
                t, phis = loop_[:2]
                planes = _code_planes(builder, codes_p, builder.add(builder.mul(t, k(nd4)), k(chunk * w)), w)
                row = builder.mul(t, k(groups))
                g0 = chunk * w // gb
                if gb >= w:  # the chunk lies in one group
                    scale = _splat(builder, builder.load(builder.gep(sc_p, [builder.add(row, k(g0))])), w)
                else:  # the chunk spans w // gb whole groups
                    ng = w // gb
                    sv = undef(_llvm_ir.VectorType(f32, ng))
                    for g in range(ng):
                        sv = builder.insert_element(sv, builder.load(builder.gep(sc_p, [builder.add(row, k(g0 + g))])),
                                                    _llvm_ir.Constant(i32, g))
                    spread = _llvm_ir.Constant(vi, [lane // gb for lane in range(w)])
                    scale = builder.shuffle_vector(sv, undef(sv.type), spread)
                if with_sums:
                    ov = builder.insert_element(undef(vs), _llvm_ir.Constant(f32, 1.0), _llvm_ir.Constant(i32, 0))
                    for g in range(groups):
                        ov = builder.insert_element(ov, builder.load(builder.gep(off_p, [builder.add(row, k(g))])),
                                                    _llvm_ir.Constant(i32, g + 1))
                wt_row = builder.add(wt_at, builder.mul(t, wt_stride))
                new = []
                new_sums = []
                for r in range(lanes):
                    p = builder.load(builder.gep(wt_p, [builder.add(wt_row, k(r))]))
                    wv = builder.fmul(_splat(builder, p, w), scale, flags=("contract",))
                    new += [fma(wv, planes[i], phis[r * 4 + i]) for i in range(4)]
                    if with_sums:
                        new_sums.append(fma(_splat(builder, p, groups + 1), ov, phis[lanes * 4 + r]))
                _loop_end(builder, loop_, 1, new + new_sums)
                for m, v in enumerate(phis[:lanes * 4]):
                    r, i = divmod(m, 4)
                    builder.store(v, at(acc_p, builder.add(acc_at, k(((chunk * LANES + r) * 4 + i) * w)), vf), align=4)
                for r, v in enumerate(phis[lanes * 4:]):
                    builder.store(v, at(sums_p, builder.add(sums_at, k(r * (groups + 1))), vs), align=4)

            def emit(lanes):
                for chunk in range(nd4 // w):
                    loop(lanes, chunk, chunk == 0)

            _per_row_count(builder, rows_v, emit)
            return context.get_dummy_value()

        return _nb_types.void(acc, acc_at, codes, weights, weight_at, weight_stride, scales, offsets, sums, sums_at, n,
                              d4, width, group_bytes, rows), codegen

    def _fold_pairs(builder, a, b, segment):
        # a, b: vectors whose lanes hold some tokens' partial sums in contiguous segments of `segment` lanes (b may be
        # a itself). Returns the vector of a's then b's tokens (b's only when b is not a) with segments halved
        # (each half segment summed with the other half), and its width.
        i32 = _llvm_ir.IntType(32)
        width = a.type.count
        tokens = width // segment
        sources = [(0, j) for j in range(tokens)] + ([(width, j) for j in range(tokens)] if b is not a else [])
        half = segment // 2
        low = [base + j * segment + u for base, j in sources for u in range(half)]
        high = [x + half for x in low]
        mask = lambda lanes: _llvm_ir.Constant(_llvm_ir.VectorType(i32, len(lanes)), lanes)
        return builder.fadd(builder.shuffle_vector(a, b, mask(low)), builder.shuffle_vector(a, b, mask(high)),
                            flags=("reassoc", "contract"))

    @_intrinsic
    def _channel_key_scores(typingctx, scores, score_at, score_stride, codes, q_planes, q_rows, q_at, group_scale,
                            group_lo, group_at, norm, norm_at, bias, bias_at, n, d4, width, block,
                            rows):  # pragma: no cover
        # Key scores of one per-channel group for `rows` query rows (1 .. LANES) and n of its tokens (a multiple of
        # `block`), D = 4 d4 channels:
        #   scores[score_at + t * score_stride + r] = (sum_c q_r[c] group_scale[c] code_c(t) + q_r . group_lo)
        #                                             * norm[norm_at + t] + bias[bias_at + r]
        # with q_r = q_rows[q_at + r * D ..] (channel order; q_planes holds the same rows in the codes' plane order:
        # channel 4j + i at i * d4 + j) and the group's scales and offsets at group_at (channel order). Token t's codes
        # are its d4 bytes at codes[t * d4], unpacked in vector registers. The
        # products of a token's codes with q_r are summed across lanes for `block` tokens at once (folding pairs of
        # vectors: 3 operations per token instead of a horizontal sum's 2 log2(width)). LLVM vector IR: Numba's loops
        # do not vectorize with the token in a lane (it cannot prove the output and the codes apart).
        if not all(isinstance(x, _nb_types.IntegerLiteral) for x in (d4, width, block)) or \
                not isinstance(rows, _nb_types.Integer):
            return None
        nd4, w, bt = d4.literal_value, width.literal_value, block.literal_value

        def codegen(context, builder, sig, args):
            (sc_a, sc_at, sc_stride, codes_a, qp_a, qr_a, q_at, gs_a, gl_a, g_at, norm_a, norm_at, bias_a, bias_at,
             n) = args[:15]
            rows_v = args[18]
            i32, i64, f32 = _llvm_ir.IntType(32), _llvm_ir.IntType(64), _llvm_ir.FloatType()
            vf = _llvm_ir.VectorType(f32, w)
            k = lambda x: _llvm_ir.Constant(i64, x)
            undef = lambda ty: _llvm_ir.Constant(ty, _llvm_ir.Undefined)

            def data(index, value):
                return context.make_array(sig.args[index])(context, builder, value).data

            sc_p, codes_p, qp_p, qr_p, gs_p, gl_p, norm_p, bias_p = (
                data(0, sc_a), data(3, codes_a), data(4, qp_a), data(5, qr_a), data(7, gs_a), data(8, gl_a),
                data(10, norm_a), data(12, bias_a))

            def at(p, offset, ty):
                return _vector_at(builder, p, offset, ty)

            def splat(x, count):
                return _splat(builder, x, count)

            chunks, d = nd4 // w, 4 * nd4
            lanes_mask = lambda lanes_: _llvm_ir.Constant(_llvm_ir.VectorType(i32, len(lanes_)), lanes_)

            def load(p, offset):
                return builder.load(at(p, offset, vf), align=4)

            def scale_planes(m):  # the scales of bytes m * w .. in plane order: a stride-4 deinterleave of 4 vectors
                parts = [load(gs_p, builder.add(g_at, k(4 * m * w + u * w))) for u in range(4)]
                ab = builder.shuffle_vector(parts[0], parts[1], lanes_mask(list(range(2 * w))))
                cd = builder.shuffle_vector(parts[2], parts[3], lanes_mask(list(range(2 * w))))
                return [builder.shuffle_vector(ab, cd, lanes_mask([4 * lane + i for lane in range(w)]))
                        for i in range(4)]

            def row_offset(r, x):
                return builder.add(q_at, k(r * d + x))

            scales = [scale_planes(m) for m in range(chunks)]
            def emit(lanes):
                qv = [[[builder.fmul(load(qp_p, row_offset(r, i * nd4 + m * w)), scales[m][i], flags=("contract",))
                        for i in range(4)] for m in range(chunks)] for r in range(lanes)]
                lo = []
                for r in range(lanes):  # q_r . group_lo
                    dot = None
                    for c in range(d // w):
                        prod = builder.fmul(load(qr_p, row_offset(r, c * w)), load(gl_p, builder.add(g_at, k(c * w))),
                                            flags=("contract",))
                        dot = prod if dot is None else builder.fadd(dot, prod, flags=("reassoc", "contract"))
                    segment = w
                    while segment > 1:
                        dot, segment = _fold_pairs(builder, dot, dot, segment), segment // 2
                    lo.append(splat(builder.extract_element(dot, _llvm_ir.Constant(i32, 0)), bt))
                bias = [splat(builder.load(builder.gep(bias_p, [builder.add(bias_at, k(r))])), bt)
                        for r in range(lanes)]
                loop_ = _loop_start(builder, "scores", n)
                t = loop_[0]
                stacks = [[] for _ in range(lanes)]  # per row: (vector, its tokens, segment), folded as tokens come
                for tt in range(bt):
                    token = builder.add(t, k(tt))
                    sums = [None] * lanes
                    for m in range(chunks):
                        planes = _code_planes(builder, codes_p, builder.add(builder.mul(token, k(nd4)), k(m * w)), w)
                        for i, plane in enumerate(planes):
                            for r in range(lanes):
                                prod = builder.fmul(qv[r][m][i], plane, flags=("contract",))
                                sums[r] = prod if sums[r] is None else builder.fadd(sums[r], prod,
                                                                                    flags=("reassoc", "contract"))
                    for r in range(lanes):
                        stack = stacks[r]
                        stack.append((sums[r], [tt], w))
                        while len(stack) > 1 and len(stack[-1][1]) == len(stack[-2][1]) and stack[-1][2] > 1:
                            (b_vec, b_tok, seg), (a_vec, a_tok, _) = stack.pop(), stack.pop()
                            stack.append((_fold_pairs(builder, a_vec, b_vec, seg), a_tok + b_tok, seg // 2))
                norms = builder.load(at(norm_p, builder.add(norm_at, t), _llvm_ir.VectorType(f32, bt)), align=4)
                for r in range(lanes):
                    (vec, toks, seg), = stacks[r]
                    while seg > 1:  # fold within the vector until one lane per token
                        vec, seg = _fold_pairs(builder, vec, vec, seg), seg // 2
                    order = _llvm_ir.Constant(_llvm_ir.VectorType(i32, bt), [toks.index(j) for j in range(bt)])
                    vec = builder.shuffle_vector(vec, undef(vec.type), order)  # lane j: token t + j
                    vec = builder.fadd(builder.fmul(builder.fadd(vec, lo[r], flags=("contract",)), norms,
                                                    flags=("contract",)), bias[r], flags=("contract",))
                    for j in range(bt):
                        row = builder.add(sc_at, builder.add(builder.mul(builder.add(t, k(j)), sc_stride), k(r)))
                        builder.store(builder.extract_element(vec, _llvm_ir.Constant(i32, j)), builder.gep(sc_p, [row]))
                _loop_end(builder, loop_, bt)

            _per_row_count(builder, rows_v, emit)
            return context.get_dummy_value()

        return _nb_types.void(scores, score_at, score_stride, codes, q_planes, q_rows, q_at, group_scale, group_lo,
                              group_at, norm, norm_at, bias, bias_at, n, d4, width, block, rows), codegen

    _TWO_POW_112 = np.float32(2.0 ** 112)

    @numba.njit(cache=True, nogil=True)
    def _float32_from_half_bits_portable(x):  # pragma: no cover
        # The same without F16C (where LLVM would call a runtime helper for fpext): exponent and mantissa moved to
        # float32's positions, scaled by 2^112 (the exponent bias difference; exact, subnormals included), for
        # finite values (what the write path stores).
        h = np.int64(x) & 0xFFFF
        f = _float32_from_bits((h & 0x7FFF) << 13) * _TWO_POW_112
        return -f if h & 0x8000 else f

    # F16C on the CPU Numba compiles for (the host, unless NUMBA_CPU_NAME names another)
    _F16C = numba.config.CPU_NAME is None and "+f16c" in llvmlite_binding.get_host_cpu_features().flatten().split(",")
    _widen_half = _float32_from_half_bits if _F16C else _float32_from_half_bits_portable

    @numba.njit(cache=True, nogil=True)
    def _stored_value(x, kind):  # pragma: no cover
        # A stored scale, offset or norm as float32, exactly: x holds the bits of a float16 (kind 0) or bfloat16
        # (kind 1) value (int16), or the float32 value itself (kind 2).
        if kind == 2:
            return np.float32(x)
        if kind == 1:
            return _float32_from_bits((np.int32(x) & 0xFFFF) << 16)
        return _widen_half(x)


    @numba.njit(cache=True, nogil=True)
    def _stored_rows(scale, lo, t0, n, groups, kind):  # pragma: no cover
        # A split's per-token scales and offsets (rows t0 .. t0 + n of [tokens, groups]) as float32, once, so that
        # the loops that vectorize read float32 (not widened values per row chunk)
        # flat, from offset 0: indices that are provably non-negative (no wraparound per element), so it vectorizes
        scale_f = np.empty(n * groups, np.float32)
        lo_f = np.empty(n * groups, np.float32)
        scale_in = scale[t0:t0 + n].reshape(-1)
        lo_in = lo[t0:t0 + n].reshape(-1)
        for k in range(n * groups):
            scale_f[k] = _stored_value(scale_in[k], kind)
            lo_f[k] = _stored_value(lo_in[k], kind)
        return scale_f.reshape(n, groups), lo_f.reshape(n, groups)


    @numba.njit(cache=True, nogil=True)
    def _stored_norms(norm, t0, n, kind):  # pragma: no cover
        # A split's per-token norms (entries t0 .. t0 + n) as float32, once; flat from offset 0, as _stored_rows
        out = np.empty(n, np.float32)
        norm_in = norm[t0:t0 + n]
        for i in range(n):
            out[i] = _stored_value(norm_in[i], kind)
        return out


if _NUMBA:
    # Helpers of the kernel's layer-step variant. head_dim ``d`` is passed from the kernel, where it is a
    # compile-time constant: LLVM inlines them and the per-channel loops unroll and vectorize (~5x faster than a
    # runtime bound). Numba-level inline="always" is as fast and compiles 1.5x longer.
    @numba.njit(fastmath=_FASTMATH, cache=True, nogil=True)
    def _rotate_rows(d, x, rot, scaling, out):  # pragma: no cover
        # out[r] = scaling * (x[r] @ rot) for the rows of x (out may have more rows: left as they are)
        acc = np.empty(d, np.float32)
        for r in range(x.shape[0]):
            acc[:] = 0.0
            for j in range(d):
                xj = x[r, j]
                for c in range(d):
                    acc[c] += xj * rot[j, c]
            for c in range(d):
                out[r, c] = scaling * acc[c]

    @numba.njit(fastmath=_FASTMATH, cache=True, nogil=True)
    def _window_partial(d, q, scaling, mask, b, query_len, row0, col, k, v, best, total, acc):  # pragma: no cover
        # Attention of the query rows q [rows, D] (original space; rows row0, row0 + 1, ... of the head's) over a
        # full-precision window k/v [nt, D] whose mask columns start at col: per row the max score (best), the sum
        # of exp(score - best) (total) and the unnormalised sum of values (acc [rows, D]).
        rows, nt = q.shape[0], k.shape[0]
        neg_inf = np.float32(-np.inf)
        mask_rows = mask.shape[1]
        scores = np.empty(nt, np.float32)
        pow2 = np.empty(nt, np.int32)
        for r in range(rows):
            m = neg_inf
            for t in range(nt):
                s = np.float32(0.0)
                for c in range(d):
                    s += q[r, c] * k[t, c]
                s = scaling * s
                if mask_rows > 0:
                    s += mask[b, ((row0 + r) % query_len) if mask_rows > 1 else 0, col + t]
                scores[t] = s
                m = max(m, s)
            best[r] = m
            total[r] = 0.0
            acc[r, :] = 0.0
            if m == neg_inf:
                continue
            # the row's weights in one vectorized pass (the scalar libm exp per token cost ~1/3 of a window)
            for t in range(nt):
                scores[t] -= m
            _exp_nonpositive(scores, pow2)
            l = np.float32(0.0)
            for t in range(nt):
                p = scores[t]
                l += p
                for c in range(d):
                    acc[r, c] += p * v[t, c]
            total[r] = l

    @numba.njit(fastmath=_FASTMATH, cache=True, nogil=True)
    def _merge_windows(d, q, scaling, mask, b, query_len, row0, col1, wk0, wv0, wk1, wv1, rot_v, mean_v, h,
                      m_body, l_body, acc_body, out, lse):  # pragma: no cover
        # Query rows row0, row0 + 1, ... of one (batch row, KV head) of the layer step: the body's unnormalised
        # rotated partial (m_body, l_body, acc_body per query row) de-rotated (acc R_V^T + l mu_V), the windows'
        # partials, merged by log-sum-exp into out [rows, D] and lse [rows]; a row that attends nothing gets (0, -inf).
        rows = out.shape[0]
        neg_inf = np.float32(-np.inf)
        zero = np.float32(0.0)
        m0, l0, acc0 = np.empty(rows, np.float32), np.empty(rows, np.float32), np.empty((rows, d), np.float32)
        m1, l1, acc1 = np.empty(rows, np.float32), np.empty(rows, np.float32), np.empty((rows, d), np.float32)
        _window_partial(d, q, scaling, mask, b, query_len, row0, 0, wk0, wv0, m0, l0, acc0)
        _window_partial(d, q, scaling, mask, b, query_len, row0, col1, wk1, wv1, m1, l1, acc1)
        body = np.empty(d, np.float32)
        for r in range(rows):
            mb, lb = m_body[r], l_body[r]
            big = max(max(m0[r], m1[r]), mb)
            if big == neg_inf:
                out[r, :] = 0.0
                lse[r] = neg_inf
                continue
            e0 = np.float32(math.exp(m0[r] - big)) if l0[r] > 0 else zero
            e1 = np.float32(math.exp(m1[r] - big)) if l1[r] > 0 else zero
            eb = np.float32(math.exp(mb - big)) if lb > 0 else zero
            body[:] = 0.0
            if lb > 0:
                for c in range(d):
                    x = np.float32(0.0)
                    for j in range(d):
                        x += acc_body[r, j] * rot_v[c, j]
                    body[c] = x
                if mean_v.shape[0] > 0:
                    for c in range(d):
                        body[c] += lb * mean_v[h, c]
            den = e0 * l0[r] + e1 * l1[r] + eb * lb
            inv = np.float32(1.0) / den
            for c in range(d):
                out[r, c] = (e0 * acc0[r, c] + e1 * acc1[r, c] + eb * body[c]) * inv
            lse[r] = big + np.float32(math.log(den))


@functools.cache
def _make_kernel(d: int, k_token_axis: bool, k_group: int, v_token_axis: bool, v_group: int, whole: bool = False,
                 k_kind: int = 2, v_kind: int = 2):
    """The body kernel for one head_dim and pair of layouts: loop bounds are compile-time constants, so the
    per-token loops unroll and the four query rows of a pass vectorize (3x faster than runtime bounds).
    ``k_kind`` / ``v_kind``: how the streams' scales, offsets and norms are stored (``_SCALE_KINDS``: the bits of
    float16 / bfloat16, or float32), read as they are (no float32 copy of them per call).
    ``whole``: the layer-step variant (:func:`layer_step_attention`): it also rotates the query, attends the
    full-precision windows and merges them with the body in the original space."""
    d4 = d // 4
    k_groups, k_gbytes = (d // k_group, k_group // 4) if k_token_axis else (1, d4)
    v_groups, v_gbytes = (d // v_group, v_group // 4) if v_token_axis else (1, d4)
    lut_rows = d4 * 256 if k_token_axis else 0
    # per-token value groups: a row chunk's codes accumulated in vectors of v_width bytes' codes
    # (_accumulate_values), a vector within one group or spanning whole groups (0: none fits, a scalar loop)
    # per-channel key groups: a token's codes in vectors of k_width bytes' codes, k_width tokens' sums folded together
    # (_channel_key_scores; 0: head_dim not a multiple of 16, the Numba loop)
    k_width = 0 if k_token_axis else next((w for w in (16, 8, 4) if d4 % w == 0), 0)
    v_width = 0
    if v_token_axis and v_group % 4 == 0:
        v_width = next((w for w in (16, 8, 4) if d4 % w == 0 and (w % v_gbytes == 0 or v_gbytes % w == 0)), 0)
    codes_table = _CODES

    @numba.njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
    def kernel(q_in, bias_in, mask, col0, query_len, kc, ks, kl, kn, vc, vs, vl, vn, n, split, out, lse,
               scaling, rot_k, mean_k, rot_v, mean_v, wk0, wv0, wk1, wv1, n1):  # pragma: no cover
        # Body kernel (not whole): q_in [B, H, RP, D] rotated and scaled, RP a multiple of LANES (padding rows are
        # zeros; the caller drops them), bias_in [B, H, RP]. Body tokens [0, n) in splits of `split` tokens: one
        # parallel task per (row, head, split) writes an unnormalised partial; the splits are merged by
        # log-sum-exp per (row, head). The mask's columns of the body start at col0.
        # Whole: q_in [B, H, rows, D] in the original space, unscaled; the windows wk0/wv0 (before the body, mask
        # columns [0, n0)) and wk1/wv1 (after it, columns from col0 + n) are attended in the original space and
        # merged with the de-rotated body; out [B, H, rows, D] is the step's attention output. The window after the
        # body is the first n1 tokens of wk1/wv1 (a dynamic layer's recent-window buffer, read in place).
        b_size, h_size = q_in.shape[0], q_in.shape[1]
        rp = -(-q_in.shape[2] // LANES) * LANES
        nbh = b_size * h_size
        n_chunks = rp // LANES
        n_splits = max(1, -(-n // split))
        mask_rows = mask.shape[1]
        has_kn = kn.shape[1] > 0
        has_vn = vn.shape[1] > 0
        live_rows = q_in.shape[2] if whole else rp  # rows with a query (whole: the rest pad to RP)
        neg_inf = np.float32(-np.inf)
        one = np.float32(1.0)
        table = codes_table
        if whole:  # q' = scaling * (q R_K), padded to RP rows; bias = scaling * (q . mu_K); one item per query row
            q = np.zeros((b_size, h_size, rp, d), np.float32)
            bias = np.zeros((b_size, h_size, rp), np.float32)
            rows_in = q_in.shape[2]
            for item in numba.prange(nbh * rows_in):
                b = item // (h_size * rows_in)
                h = (item // rows_in) % h_size
                r = item % rows_in
                _rotate_rows(d, q_in[b, h, r:r + 1], rot_k, scaling, q[b, h, r:r + 1])
                if mean_k.shape[0] > 0:
                    acc = np.float32(0.0)
                    for c in range(d):
                        acc += q_in[b, h, r, c] * mean_k[h, c]
                    bias[b, h, r] = scaling * acc
        else:
            q = q_in
            bias = bias_in
        # ---- per (row, head): lut[rc, j * 256 + byte, lane] = q_r . (codes in byte j) for r = rc * LANES + lane
        # (chunk-major: the four lanes of a row chunk are one vector at a constant offset); q sums per key group
        # (one parallel item per (row, head, row chunk, byte position): at batch 1 there are only a few (row, head)
        # pairs, which would leave threads idle)
        lut = np.empty((nbh, n_chunks, lut_rows, LANES), np.float32)
        qsum = np.zeros((nbh, k_groups, rp), np.float32)
        if k_token_axis:
            for item in numba.prange(nbh * n_chunks * d4):
                bh = item // (n_chunks * d4)
                rc = (item // d4) % n_chunks
                j = item % d4
                qt = q[bh // h_size, bh % h_size]
                lt = lut[bh, rc].reshape(-1)  # flat (constant strides), as where it is read
                # a byte's entry = its low nibble's part (channels 4j, 4j+1) + its high nibble's (4j+2, 4j+3):
                # two 16-entry tables and one add per entry instead of four multiply-adds
                low = np.empty(16 * LANES, np.float32)
                high = np.empty(16 * LANES, np.float32)
                for nib in range(16):
                    c0, c1 = table[nib, 0], table[nib, 1]
                    for lane in range(LANES):
                        r = rc * LANES + lane
                        low[nib * LANES + lane] = qt[r, 4 * j] * c0 + qt[r, 4 * j + 1] * c1
                        high[nib * LANES + lane] = qt[r, 4 * j + 2] * c0 + qt[r, 4 * j + 3] * c1
                for hi in range(16):
                    for lo in range(16):
                        for lane in range(LANES):
                            at = (j * 256 + hi * 16 + lo) * LANES + lane
                            lt[at] = low[lo * LANES + lane] + high[hi * LANES + lane]
            for bh in range(nbh):
                qt = q[bh // h_size, bh % h_size]
                for r in range(rp):
                    for c in range(d):
                        qsum[bh, c // k_group, r] += qt[r, c]
        part_m = np.empty((nbh, n_splits, rp), np.float32)
        part_l = np.empty((nbh, n_splits, rp), np.float32)
        part_lo = np.zeros((nbh, n_splits, v_groups, rp), np.float32)
        part_acc = np.zeros((nbh, n_splits, rp * d), np.float32)  # per-token groups, v_width: _accumulate_values' order
        for task in numba.prange(nbh * n_splits):
            bh = task // n_splits
            s = task % n_splits
            b = bh // h_size
            h = bh % h_size
            t0 = s * split
            t1 = min(n, t0 + split)
            ns = max(t1 - t0, 0)
            qt = q[b, h]
            scores = np.empty((ns, rp), np.float32)  # [token, query row]
            x = np.empty(d, np.float32)
            kct, kst, klt = kc[b, h], ks[b, h], kl[b, h]
            # the split's token norms as float32, once (not per row chunk inside the loops that vectorize)
            k_norm = _stored_norms(kn[b], t0, ns if has_kn else 0, k_kind)
            v_norm = _stored_norms(vn[b], t0, ns if has_vn else 0, v_kind)
            # ---- scores
            if k_token_axis:
                qs = qsum[bh]
                k_scale_t, k_lo_t = _stored_rows(kst, klt, t0, ns, k_groups, k_kind)
                for rc in range(n_chunks):  # four query rows in registers; codes re-read per chunk of rows
                    r0 = rc * LANES
                    # flat: an entry's offset is (j * 256 + byte) * LANES, a constant stride (indexing the 2-D table
                    # multiplied by its runtime row stride per lookup; 1.03x faster keys)
                    lt = lut[bh, rc].reshape(-1)
                    b0, b1, b2, b3 = bias[b, h, r0], bias[b, h, r0 + 1], bias[b, h, r0 + 2], bias[b, h, r0 + 3]
                    m0 = m1 = m2 = m3 = neg_inf  # the rows' max score, here where the scores are in registers
                    k_split = kct[t0:t1]  # indexed from 0 (provably non-negative: no wraparound per token)
                    for i in range(ns):
                        s0 = s1 = s2 = s3 = np.float32(0.0)
                        for gi in range(k_groups):
                            a0 = a1 = a2 = a3 = np.float32(0.0)
                            for jj in range(k_gbytes):
                                j = gi * k_gbytes + jj
                                at = (j * 256 + np.int64(k_split[i, j])) * LANES
                                a0 += lt[at]
                                a1 += lt[at + 1]
                                a2 += lt[at + 2]
                                a3 += lt[at + 3]
                            sc = k_scale_t[i, gi]
                            off = k_lo_t[i, gi]
                            s0 += sc * a0 + off * qs[gi, r0]
                            s1 += sc * a1 + off * qs[gi, r0 + 1]
                            s2 += sc * a2 + off * qs[gi, r0 + 2]
                            s3 += sc * a3 + off * qs[gi, r0 + 3]
                        norm = k_norm[i] if has_kn else one
                        s0, s1, s2, s3 = s0 * norm + b0, s1 * norm + b1, s2 * norm + b2, s3 * norm + b3
                        scores[i, r0], scores[i, r0 + 1], scores[i, r0 + 2], scores[i, r0 + 3] = s0, s1, s2, s3
                        m0, m1, m2, m3 = max(m0, s0), max(m1, s1), max(m2, s2), max(m3, s3)
                    pm = part_m[bh, s]
                    pm[r0], pm[r0 + 1], pm[r0 + 2], pm[r0 + 3] = m0, m1, m2, m3
            else:
                # Per-channel groups: q . (code * scale + lo) = (q * scale) . code + q . lo. Per group of k_group
                # tokens (splits start on a group): q * scale and q . lo once, with q * scale in the codes' plane order
                # (channel 4j + i at i * d4 + j: plane i holds bits 2i, 2i+1 of every byte). _channel_key_scores does
                # it all in registers (codes unpacked there, k_width tokens' sums folded together: a 1.2x faster
                # kernel than the loops below, which serve head_dims it does not: the group's codes unpacked in one
                # flat loop that vectorizes, and a dot per token and row).
                # the query rows in plane order once per task: per group only a product and a dot, both contiguous
                q_planes = np.empty((rp, d), np.float32)
                for r in range(rp):
                    for i in range(4):
                        for j in range(d4):
                            q_planes[r, i * d4 + j] = qt[r, 4 * j + i]
                q_perm = np.empty((rp, d), np.float32)
                q_planes_flat, q_rows_flat, scores_flat, bias_bh = q_planes.reshape(-1), qt.reshape(-1), \
                    scores.reshape(-1), bias[b, h]
                k_norm_or_one = k_norm if has_kn else np.ones(ns, np.float32)
                q_lo = np.empty(rp, np.float32)
                planes = np.empty((4, k_group * d4), np.float32)
                k_scale = np.empty(d, np.float32)  # the group's scales in plane order
                # the split's groups' scales and offsets as float32, in one loop that vectorizes
                row0 = t0 // k_group
                k_scale_all, k_lo_all = _stored_rows(kst, klt, row0, -(-ns // k_group), d, k_kind)
                k_scale_flat, k_lo_flat = k_scale_all.reshape(-1), k_lo_all.reshape(-1)
                for g0 in range(t0, t1, k_group):
                    g1 = min(t1, g0 + k_group)
                    group_codes = kct[g0:g1].reshape(-1)
                    if k_width > 0:
                        full = (g1 - g0) // k_width * k_width
                        g_at = (g0 // k_group - row0) * d
                        rest_codes = group_codes[full * d4:]
                        for rc in range(n_chunks):
                            r0 = rc * LANES
                            live = min(LANES, live_rows - r0)
                            at0, at1 = (g0 - t0) * rp + r0, (g0 - t0 + full) * rp + r0
                            _channel_key_scores(scores_flat, at0, rp, group_codes, q_planes_flat, q_rows_flat, r0 * d,
                                                k_scale_flat, k_lo_flat, g_at, k_norm_or_one, g0 - t0, bias_bh, r0,
                                                full, d4, k_width, k_width, live)
                            _channel_key_scores(scores_flat, at1, rp, rest_codes, q_planes_flat, q_rows_flat, r0 * d,
                                                k_scale_flat, k_lo_flat, g_at, k_norm_or_one, g0 - t0 + full, bias_bh,
                                                r0, g1 - g0 - full, d4, k_width, 1, live)
                        for t in range(g0 - t0, g1 - t0):
                            for r in range(live_rows, rp):  # padding rows: their scores are never read
                                scores[t, r] = neg_inf
                        continue
                    k_scale_in, k_lo = k_scale_all[g0 // k_group - row0], k_lo_all[g0 // k_group - row0]
                    for i in range(4):
                        for j in range(d4):
                            k_scale[i * d4 + j] = k_scale_in[4 * j + i]
                    for r in range(live_rows):
                        acc = np.float32(0.0)
                        for c in range(d):
                            q_perm[r, c] = q_planes[r, c] * k_scale[c]
                            acc += qt[r, c] * k_lo[c]
                        q_lo[r] = acc
                    for k in range((g1 - g0) * d4):
                        v = group_codes[k]
                        planes[0, k] = _two_bit_code(v, 0)
                        planes[1, k] = _two_bit_code(v, 2)
                        planes[2, k] = _two_bit_code(v, 4)
                        planes[3, k] = _two_bit_code(v, 6)
                    for t in range(g0, g1):
                        norm = k_norm[t - t0] if has_kn else one
                        base = (t - g0) * d4
                        for rc in range(n_chunks):
                            for lane in range(LANES):  # a constant trip count, unrolled (1.1x faster key scores)
                                r = rc * LANES + lane
                                if r < live_rows:  # (padding rows: their scores are never read)
                                    acc = np.float32(0.0)
                                    for i in range(4):
                                        for j in range(d4):
                                            acc += q_perm[r, i * d4 + j] * planes[i, base + j]
                                    scores[t - t0, r] = (acc + q_lo[r]) * norm + bias[b, h, r]
                                else:
                                    scores[t - t0, r] = neg_inf
            if mask_rows > 0:
                for t in range(t0, t1):
                    for r in range(rp):
                        scores[t - t0, r] += mask[b, (r % query_len) if mask_rows > 1 else 0, col0 + t]
            # ---- softmax of the split (unnormalised weights in place), four rows at a time in registers: per-row
            # arrays would carry each max and sum through memory from token to token (1.2-1.5x slower body)
            for rc in range(n_chunks):
                r0 = rc * LANES
                if k_token_axis and mask_rows == 0:  # taken in the key loop
                    pm = part_m[bh, s]
                    m0, m1, m2, m3 = pm[r0], pm[r0 + 1], pm[r0 + 2], pm[r0 + 3]
                else:
                    m0 = m1 = m2 = m3 = neg_inf
                    for i in range(ns):
                        m0 = max(m0, scores[i, r0])
                        m1 = max(m1, scores[i, r0 + 1])
                        m2 = max(m2, scores[i, r0 + 2])
                        m3 = max(m3, scores[i, r0 + 3])
                    pm = part_m[bh, s]
                    pm[r0], pm[r0 + 1], pm[r0 + 2], pm[r0 + 3] = m0, m1, m2, m3
                # a row that attends nothing here (all -inf) keeps its scores: exp gives 0 weights
                f0 = m0 if m0 != neg_inf else np.float32(0.0)
                f1 = m1 if m1 != neg_inf else np.float32(0.0)
                f2 = m2 if m2 != neg_inf else np.float32(0.0)
                f3 = m3 if m3 != neg_inf else np.float32(0.0)
                for i in range(ns):
                    scores[i, r0] -= f0
                    scores[i, r0 + 1] -= f1
                    scores[i, r0 + 2] -= f2
                    scores[i, r0 + 3] -= f3
            _exp_nonpositive(scores.reshape(-1), np.empty(ns * rp, np.int32))
            for rc in range(0 if v_token_axis else n_chunks):  # (per-token value groups: in the value loop)
                r0 = rc * LANES
                l0 = l1 = l2 = l3 = np.float32(0.0)
                for i in range(ns):
                    l0 += scores[i, r0]
                    l1 += scores[i, r0 + 1]
                    l2 += scores[i, r0 + 2]
                    l3 += scores[i, r0 + 3]
                part_l[bh, s, r0], part_l[bh, s, r0 + 1], part_l[bh, s, r0 + 2], part_l[bh, s, r0 + 3] = l0, l1, l2, l3
            # ---- values, rotated space
            vct, vst, vlt = vc[b, h], vs[b, h], vl[b, h]
            if v_token_axis:
                # sum of weight x (code x scale + offset) x norm: the codes times weight x scale x norm, and the
                # offsets times weight x norm summed per group
                lo_acc = part_lo[bh, s]
                acc_v = part_acc[bh, s]
                v_scale_t, v_lo_t = _stored_rows(vst, vlt, t0, ns, v_groups, v_kind)
                if has_vn:
                    for i in range(ns):
                        for gi in range(v_groups):
                            v_scale_t[i, gi] *= v_norm[i]
                            v_lo_t[i, gi] *= v_norm[i]
                if v_width > 0:
                    codes_flat, weights = vct[t0:t1].reshape(-1), scores.reshape(-1)
                    scales, offsets = v_scale_t.reshape(-1), v_lo_t.reshape(-1)
                    sums = np.zeros(rp * (v_groups + 1), np.float32)  # per row: sum of weights, then per group
                    for rc in range(n_chunks):
                        r0 = rc * LANES
                        live = min(LANES, live_rows - r0)
                        _accumulate_values(acc_v, r0 * d, codes_flat, weights, r0, rp, scales, offsets, sums,
                                           r0 * (v_groups + 1), ns, d4, v_width, v_gbytes, live)
                    for r in range(rp):
                        part_l[bh, s, r] = sums[r * (v_groups + 1)]
                        for gi in range(v_groups):
                            lo_acc[gi, r] = sums[r * (v_groups + 1) + 1 + gi]
                else:  # channel order, code by code
                    part_l[bh, s, :] = 0.0
                    for t in range(t0, t1):
                        for r in range(rp):
                            w = scores[t - t0, r]
                            part_l[bh, s, r] += w
                            for gi in range(v_groups):
                                lo_acc[gi, r] += w * v_lo_t[t - t0, gi]
                            for j in range(d4):
                                byte = vct[t, j]
                                for i in range(4):
                                    c = 4 * j + i
                                    acc_v[r * d + c] += w * v_scale_t[t - t0, c // v_group] * table[byte, i]
            else:
                acc_v = part_acc[bh, s]
                v_scale, v_lo = np.empty(d, np.float32), np.empty(d, np.float32)  # the group's, as float32
                v_row = -1
                for t in range(t0, t1):
                    row = t // v_group
                    if row != v_row:
                        for c in range(d):
                            v_scale[c] = _stored_value(vst[row, c], v_kind)
                            v_lo[c] = _stored_value(vlt[row, c], v_kind)
                        v_row = row
                    norm = v_norm[t - t0] if has_vn else one
                    for j in range(d4):
                        byte = vct[t, j]
                        for i in range(4):
                            c = 4 * j + i
                            x[c] = (table[byte, i] * v_scale[c] + v_lo[c]) * norm
                    for r in range(rp):
                        w = scores[t - t0, r]
                        for c in range(d):
                            acc_v[r * d + c] += w * x[c]
        # ---- merge the splits by log-sum-exp, then (whole) the windows or (body) the normalisation: one parallel
        # item per (head, query row), in one parallel region (at batch 1 each region's fork and join costs about as
        # much as a row's merge, and per head there would be only 3 items for 2 threads)
        rows_out = out.shape[2]
        merged_m = np.empty((nbh, rows_out), np.float32)
        merged_l = np.empty((nbh, rows_out), np.float32)
        merged_acc = np.zeros((nbh, rows_out, d), np.float32)
        for item in numba.prange(nbh * rows_out):
            bh = item // rows_out
            r = item % rows_out
            b = bh // h_size
            h = bh % h_size
            m = neg_inf
            for s in range(n_splits):
                m = max(m, part_m[bh, s, r])
            total = np.float32(0.0)
            acc = merged_acc[bh, r]
            for s in range(n_splits):
                if part_m[bh, s, r] == neg_inf:
                    continue
                ws = np.float32(math.exp(part_m[bh, s, r] - m))
                total += ws * part_l[bh, s, r]
                if v_token_axis:
                    pa = part_acc[bh, s]
                    for c in range(d):
                        acc[c] += ws * part_lo[bh, s, c // v_group, r]
                    if v_width > 0:  # from (row chunk, byte chunk, row, code i, byte) order
                        for mc in range(d4 // v_width):
                            at = ((r // LANES * (d4 // v_width) + mc) * LANES + r % LANES) * 4 * v_width
                            for i in range(4):
                                for lane in range(v_width):
                                    acc[4 * (mc * v_width + lane) + i] += ws * pa[at + i * v_width + lane]
                    else:
                        for c in range(d):
                            acc[c] += ws * pa[r * d + c]
                else:
                    for c in range(d):
                        acc[c] += ws * part_acc[bh, s, r * d + c]
            merged_m[bh, r] = m
            merged_l[bh, r] = total
            if whole:
                _merge_windows(d, q_in[b, h, r:r + 1], scaling, mask, b, query_len, r, col0 + n, wk0[b, h],
                               wv0[b, h], wk1[b, h, :n1], wv1[b, h, :n1], rot_v, mean_v, h, merged_m[bh, r:r + 1],
                               merged_l[bh, r:r + 1], merged_acc[bh, r:r + 1], out[b, h, r:r + 1], lse[b, h, r:r + 1])
            elif total > 0.0:
                inv = one / total
                for c in range(d):
                    out[b, h, r, c] = acc[c] * inv
                lse[b, h, r] = m + np.float32(math.log(total))
            else:
                for c in range(d):
                    out[b, h, r, c] = 0.0
                lse[b, h, r] = neg_inf

    return kernel


def _body_arrays(body, batch: int):
    """``((codes [B, H, cap, D/4] uint8, scale, lo [B, H, >= rows, X], norm [B, >= n] or [B, 0]) as numpy, kind)``:
    scale, lo and norm as stored (int16 bits of float16 / bfloat16, or float32: ``kind``, see ``_SCALE_KINDS``),
    the buffers themselves with their spare capacity (the kernel reads the rows in use); float32 copies if their
    dtypes differ."""
    scale, lo, norm = body.scale, body.lo, body.norm
    dtype = scale.dtype
    kind = _SCALE_KINDS.get(dtype, 2)
    buffers = body.buffers
    if buffers is not None and buffers[0].data is body.codes and lo.dtype == dtype and \
            (norm is None or norm.dtype == dtype):
        # the buffers of a dynamic stream, unchanged since the read: their numpy views, made once per buffer
        return (buffers[0].array(), buffers[1].array(), buffers[2].array(),
                buffers[3].array() if norm is not None else _no_norm(batch, kind)), kind
    stored = (scale, lo) if norm is None else (scale, lo, norm)
    if kind == 2 or any(t.dtype != dtype for t in stored):
        kind, arrays = 2, [_float32_array(t) for t in stored]
    else:  # the bits of the 16-bit values
        arrays = [_contiguous_array(t.view(torch.int16)) for t in stored]
    norm = arrays[2] if body.norm is not None else _no_norm(batch, kind)
    return (_contiguous_array(body.codes), arrays[0], arrays[1], norm), kind


_CODEC_ARRAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _codec_arrays(codec, none: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rotation, mean or ``none``) of a :class:`~hf_kvint2.stream.StreamCodec` as numpy arrays, made once per codec
    (a codec never changes; a decode step would otherwise convert them for every layer)."""
    arrays = _CODEC_ARRAYS.get(codec)
    if arrays is None:
        arrays = (_contiguous_array(codec.rotation), none if codec.mean is None else _contiguous_array(codec.mean))
        _CODEC_ARRAYS[codec] = arrays
    return arrays


# id(tensor) -> (weak reference to it, its numpy view, offset, strides, shape); by id because a tensor's == is
# elementwise (a WeakKeyDictionary compares its keys with it); an entry leaves with its tensor
_HELD_ARRAYS: dict[int, tuple] = {}


def _forget_held(key: int, ref) -> None:
    entry = _HELD_ARRAYS.get(key)
    if entry is not None and entry[0] is ref:
        del _HELD_ARRAYS[key]


def _window_array(x: torch.Tensor, whole: bool = False) -> np.ndarray:
    """A full-precision window [B, H, n, D] for the kernel as a float32 array: the buffer x is the first n tokens
    of, where it is one (a dynamic layer's recent window, appended in place: no copy of it per step; the kernel reads
    its first n tokens), else x as a C-contiguous float32 array. ``whole``: x itself, never a longer buffer (the
    sink, whose every token the kernel reads). The numpy view of a tensor that stays (a buffer, the sink) is made
    once and kept while the tensor lives: a decode step reads the same 4 windows in every layer, and the checks of a
    kept view take half the time of making it again."""
    held = x if x._base is None or whole else x._base
    known = _HELD_ARRAYS.get(id(held))
    if known is None or known[0]() is not held:
        if not (held.dtype == torch.float32 and held.dim() == 4 and held.is_contiguous() and not held.requires_grad):
            return _float32_array(x)
        key = id(held)
        ref = weakref.ref(held, lambda r, key=key: _forget_held(key, r))
        known = _HELD_ARRAYS[key] = (ref, held.numpy(), held.storage_offset(), held.stride(), held.shape)
    _, array, offset, stride, shape = known
    # x is the held tensor (whole) or its first tokens: same start, strides, batch, heads and head_dim
    if x.storage_offset() == offset and x.stride() == stride and not x.requires_grad and \
            (x.shape == shape if whole else x.shape[:2] == shape[:2] and x.shape[3] == shape[3]):
        return array
    return _float32_array(x)


def _contiguous_array(x: torch.Tensor) -> np.ndarray:
    return (x if x.is_contiguous() else x.contiguous()).numpy()


def _float32_array(x: torch.Tensor) -> np.ndarray:
    """x as a C-contiguous float32 array (the tensor's own memory when it is one already)."""
    if x.requires_grad:
        x = x.detach()
    return (x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()).numpy()


@functools.cache
def _no_norm(batch: int, kind: int) -> np.ndarray:
    return np.zeros((batch, 0), np.int16 if kind != 2 else np.float32)


def _notice_compile(spec: tuple, seconds: float) -> None:
    if seconds > JIT_NOTICE_S:
        where = numba.config.CACHE_DIR or "__pycache__ next to hf_kvint2/cpu_kernels.py"
        warnings.warn(f"hf_kvint2: the first fused CPU step took {seconds:.0f} s: Numba compiled the body kernel for "
                      f"head_dim={spec[0]} and this cache's layouts. It is cached on disk ({where}), so later "
                      "processes load it; `python -m hf_kvint2.backends` compiles the default layouts ahead.",
                      UserWarning, stacklevel=4)


@functools.lru_cache(maxsize=4096)  # a pure function of its integers, asked once per layer and step
def split_tokens(n: int, rows: int, tasks: int, align: int, threads: int) -> int:
    """Body tokens per parallel task (split-K) for a kernel running on ``threads`` threads, ``tasks`` = batch x KV
    heads: the number of splits per task that makes the step shortest, by a cost model of the body on the threads
    (rounds of parallel tasks, each its tokens plus a split's fixed ``SPLIT_COST_TOKENS``, and the merge's expansion
    of each split). One thread: no split; 3 KV heads on 2 threads: 2 splits (6 tasks, 3 per thread; 3 splits would
    leave one thread 5 of 9 tasks). None under ``SPLIT_MIN_TOKENS`` tokens, a multiple of ``align`` (the per-channel
    groups); no split for many query rows (a long chunk: its partials would be large). The split sets the summation
    order, so results depend on the thread count in the last bits, as PyTorch's own reductions do."""
    tasks = max(tasks, 1)
    most = min(n // SPLIT_MIN_TOKENS, 2 * -(-threads // tasks))
    if rows > SPLIT_MAX_ROWS or most <= 1:
        return max(n, 1)

    def cost(s: int) -> float:  # in body tokens
        return -(-tasks * s // threads) * (n / s + SPLIT_COST_TOKENS) + -(-tasks // threads) * s * SPLIT_COST_TOKENS

    splits = min(range(1, most + 1), key=cost)
    per_split = -(-n // splits)
    return -(-per_split // align) * align


def kernel_threads() -> int:
    """The threads the kernel runs with: torch's intra-op thread count, at most Numba's pool."""
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)) if _NUMBA else 1


def _require_numba() -> None:
    if not _NUMBA:
        raise ImportError("The Numba CPU kernel needs numba: pip install 'numba>=0.59' (the clone's '.[cpu]' extra).")


def _call_shapes(q, key_body, value_body, split: int | None, threads: int) -> tuple:
    """``(b, hq, lq, d, body tokens, kv heads, query rows per KV head, split)`` of a kernel call; ``split`` checked
    (a positive multiple of the per-channel group sizes) or chosen by :func:`split_tokens` for ``threads``."""
    _require_numba()
    b, hq, lq, d = q.shape
    hkv = key_body.codes.shape[1]
    rows = (hq // hkv) * lq
    align = 1
    for body in (key_body, value_body):
        if body.layout.axis == "channel":
            align = math.lcm(align, body.group)
    if split is None:
        split = split_tokens(key_body.tokens, rows, b * hkv, align, threads)
    elif split <= 0 or split % align:
        raise ValueError(f"split={split} must be a positive multiple of the per-channel group size {align}.")
    return b, hq, lq, d, key_body.tokens, hkv, rows, split


_NO_MASK = torch.zeros(0, 0, 1)  # the kernel's "no mask" (zero mask rows; read only)


def _mask_rows(mask, b: int, cols: int) -> torch.Tensor:
    """bool/additive mask broadcastable to [B, 1, Lq, cols] -> fp32 additive [B, Lq or 1, cols] ([0, 0, 1]: none)."""
    if mask is None:
        return _NO_MASK
    add = mask_to_additive(mask.detach())
    if add is None:
        return _NO_MASK
    if add.dim() != 4 or add.shape[1] != 1:
        raise ValueError(f"The body mask must broadcast to [batch, 1, query_len, tokens], got {tuple(add.shape)}.")
    return add.expand(b, 1, add.shape[2], cols).reshape(b, -1, cols).contiguous()


def _run_kernel(key_body, value_body, whole: bool, kinds: tuple[int, int], threads: int, *args) -> None:
    """The kernel for these layouts and stored dtypes (compiled or loaded on first use) on ``threads`` threads
    (:func:`kernel_threads`)."""
    spec = (key_body.codes.shape[-1] * 4, key_body.layout.axis == "token", key_body.group,
            value_body.layout.axis == "token", value_body.group, whole, *kinds)
    kernel = _make_kernel(*spec)
    torch_threads = torch.get_num_threads()
    # Numba's thread count is per Python thread. Asking Numba for it costs ~10 us a call, so the count this
    # thread last set is remembered instead.
    if getattr(_numba_threads, "count", None) != threads:
        numba.set_num_threads(threads)
        _numba_threads.count = threads
    first = spec not in _called
    t0 = time.perf_counter()
    _superword_vectorized(kernel, *args)
    if first:
        _called.add(spec)
        _notice_compile(spec, time.perf_counter() - t0)
    if torch.get_num_threads() != torch_threads:  # both may use the OpenMP runtime: keep torch's setting
        torch.set_num_threads(torch_threads)


_NONE = {}  # zero-size stand-ins for the layer step's inputs in the body kernel, per head_dim


def _unused(d: int) -> tuple:
    if d not in _NONE:
        _NONE[d] = (np.zeros((0, 0), np.float32), np.zeros((0, d), np.float32), np.zeros((1, 1, 0, d), np.float32),
                    np.zeros((0, 0, 0), np.float32))
    return _NONE[d]


def body_attention(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None, split=None):
    """Numba body partial over :class:`~hf_kvint2.stream.QuantizedBody` tokens: ``(out_rot [B, Hq, Lq, D] fp32,
    lse [B, Hq, Lq] fp32)``, see the module docstring. ``split``: body tokens per task (default
    :func:`split_tokens`; a multiple of the per-channel group sizes)."""
    threads = kernel_threads()
    b, hq, lq, d, n, hkv, rows, split = _call_shapes(q_rot, key_body, value_body, split, threads)
    padded = -(-rows // LANES) * LANES
    q = (q_rot.detach().float() * scaling).reshape(b, hkv, rows, d)
    if padded != rows:
        q = torch.cat([q, q.new_zeros(b, hkv, padded - rows, d)], dim=2)
    q = q.contiguous()
    bias = torch.zeros(b, hkv, padded)
    if key_mean_logits is not None:
        bias[:, :, :rows] = (scaling * key_mean_logits.detach().float()).reshape(b, hkv, rows)
    add = _mask_rows(mask, b, n)
    (kc, ks, kl, kn), k_kind = _body_arrays(key_body, b)
    (vc, vs, vl, vn), v_kind = _body_arrays(value_body, b)
    out = np.empty((b, hkv, padded, d), np.float32)
    lse = np.empty((b, hkv, padded), np.float32)
    rot, mean, window, _ = _unused(d)
    _run_kernel(key_body, value_body, False, (k_kind, v_kind), threads, q.numpy(), bias.numpy(), add.numpy(), 0, lq, kc, ks, kl, kn, vc, vs,
                vl, vn, n, split, out, lse, np.float32(scaling), rot, mean, rot, mean, window, window, window, window, 0)
    out_t, lse_t = torch.from_numpy(out), torch.from_numpy(lse)
    if padded != rows:
        out_t, lse_t = out_t[:, :, :rows], lse_t[:, :, :rows]
    return out_t.reshape(b, hq, lq, d), lse_t.reshape(b, hq, lq)


def layer_step_attention(query, before, key_body, value_body, after, *, scaling, mask=None, split=None):
    """A whole attention step of a dynamic layer in one compiled call: ``query`` [B, Hq, Lq, D] (original space)
    over the full-precision window ``before`` = ``(k, v)`` [B, Hkv, n0, D] (the sink), the body's tokens and the
    window ``after`` (recent tokens and the current chunk), in that order; ``mask`` bool/additive over all of their
    tokens, broadcastable to [B, 1, Lq, n0 + body + n1], or None. The same arithmetic as
    :func:`hf_kvint2.read_path.attend_segments` with :func:`body_attention` (fp32; another summation order): the
    query is rotated, the windows attended and everything merged inside the kernel, where the pipeline's ~20 small
    PyTorch ops per layer cost more than the body itself at batch 1 (benchmarks/results/profile_decode_*).
    Returns [B, Hq, Lq, D] in the query's dtype. For decode steps and short chunks (see :func:`serves_layer_step`).
    """
    threads = kernel_threads()
    b, hq, lq, d, n, hkv, rows, split = _call_shapes(query, key_body, value_body, split, threads)
    (k0, v0), (k1, v1) = before, after
    n0 = k0.shape[2]
    q = _float32_array(query).reshape(b, hkv, rows, d)  # a copy only where the query is not contiguous
    add = _mask_rows(mask, b, n0 + n + k1.shape[2])
    (kc, ks, kl, kn), k_kind = _body_arrays(key_body, b)
    (vc, vs, vl, vn), v_kind = _body_arrays(value_body, b)
    _, none, _, no_bias = _unused(d)
    rot_k, mean_k = _codec_arrays(key_body.codec, none)
    rot_v, mean_v = _codec_arrays(value_body.codec, none)
    out = np.empty((b, hkv, rows, d), np.float32)
    lse = np.empty((b, hkv, rows), np.float32)
    n1 = k1.shape[2]
    _run_kernel(key_body, value_body, True, (k_kind, v_kind), threads, q, no_bias, add.numpy(), n0, lq, kc, ks, kl, kn,
                vc, vs, vl, vn, n, split, out, lse, np.float32(scaling), rot_k, mean_k, rot_v, mean_v,
                _window_array(k0, whole=True), _window_array(v0, whole=True), _window_array(k1), _window_array(v1),
                n1)
    out = torch.from_numpy(out.reshape(b, hq, lq, d))
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def serves_layer_step(query, key_body) -> bool:
    """Whether :func:`layer_step_attention` serves this query: CPU, eager, no gradient, at most
    ``SPLIT_MAX_ROWS`` query rows per KV head (decode steps and short chunks; a long chunk's window is the chunk
    itself, which SDPA's flash kernel attends faster)."""
    rows = query.shape[1] // key_body.codes.shape[1] * query.shape[2]
    return (_NUMBA and query.device.type == "cpu" and rows <= SPLIT_MAX_ROWS and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and query.requires_grad))


# ---------------------------------------------------------------------------------------------------- write path
# The write path's clip + INT2 quantization of per-token groups (hf_kvint2.transforms.clip_rows followed by
# hf_kvint2.quant.quantize_int2) as one compiled call: a decode step demotes one token per layer and stream, where
# the ~25 small PyTorch ops of the reference cost ~0.25 ms per call. Same IEEE float32 operations in the same order
# (no fast-math), so codes, scales and offsets are bit-identical to the PyTorch path (tests/test_quant.py).
_SCALE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def quantizer_serves_layout(layout) -> bool:
    """Whether the compiled quantizer (:class:`TokenGroupQuantizer`) can write this layout: per-token groups without
    omni-token scaling, with Numba installed."""
    return _NUMBA and layout.axis == "token" and not layout.token_scaling


def quantizer_supports(layout, x: torch.Tensor) -> bool:
    """Whether :func:`quantize_token_groups` serves this layout and input (:func:`quantizer_serves_layout`, CPU,
    eager)."""
    return quantizer_serves_layout(layout) and x.device.type == "cpu" and not torch.compiler.is_compiling()


if _NUMBA:
    @numba.njit(cache=True, nogil=True)
    def _f32_bits(buf, ubuf, x):  # pragma: no cover
        buf[0] = x
        return ubuf[0]

    @numba.njit(cache=True, nogil=True)
    def _signed16(h):  # pragma: no cover
        bits = np.int32(h)
        return np.int32(bits - 65536 if bits >= 32768 else bits)

    @numba.njit(cache=True, nogil=True)
    def _round_scale(buf, ubuf, x, scale_kind):  # pragma: no cover
        # x rounded to the scale dtype (round to nearest, ties to even, as torch's .to()): (stored bits, value)
        if scale_kind == 2:
            return np.int32(0), x
        u = np.uint32(_f32_bits(buf, ubuf, x))
        if scale_kind == 1:  # bfloat16
            if np.isnan(x):
                h = np.uint32(0x7FC0)
            else:
                h = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            ubuf[0] = h << np.uint32(16)
            return _signed16(h), buf[0]
        sign = (u >> np.uint32(16)) & np.uint32(0x8000)
        a = u & np.uint32(0x7FFFFFFF)
        if a > np.uint32(0x7F800000):  # NaN
            h = np.uint32(0x7E00)
        elif a >= np.uint32(0x477FF000):  # rounds past 65504: inf
            h = np.uint32(0x7C00)
        elif a >= np.uint32(0x38800000):  # normal half
            h = (a - np.uint32(0x38000000) + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        else:  # subnormal half (or zero): m * 2^-24
            e = np.int64(a >> np.uint32(23))
            shift = 126 - e
            if shift > 24:
                h = np.uint32(0)
            else:
                mant = np.uint32((a & np.uint32(0x7FFFFF)) | np.uint32(0x800000))
                q = mant >> np.uint32(shift)
                rem = mant & ((np.uint32(1) << np.uint32(shift)) - np.uint32(1))
                half = np.uint32(1) << np.uint32(shift - 1)
                if rem > half or (rem == half and (q & np.uint32(1)) == np.uint32(1)):
                    q += np.uint32(1)
                h = q
        h = h | sign
        # back to float32
        hs = (h >> np.uint32(15)) & np.uint32(1)
        he = (h >> np.uint32(10)) & np.uint32(0x1F)
        hm = h & np.uint32(0x3FF)
        if he == np.uint32(0):
            val = np.float32(hm) * np.float32(5.960464477539063e-08)  # exact: m * 2^-24
        elif he == np.uint32(0x1F):
            val = np.float32(np.inf) if hm == np.uint32(0) else np.float32(np.nan)
        else:
            ubuf[0] = ((he + np.uint32(112)) << np.uint32(23)) | (hm << np.uint32(13))
            val = buf[0]
        if hs == np.uint32(1):
            val = -val
        return _signed16(h), val


@functools.cache
def _make_quantizer(d: int, group: int, scale_kind: int, clip: bool, top: int = 0):
    # top > 0: the clip quantile's two order statistics of |x| are among the `top` largest (top = d - i0), which
    # are kept in a small sorted array in one pass over the row (an insertion for the few that enter it) instead of
    # sorting the row (the sort was ~80% of a demotion's quantization); the same values, so the same codes
    groups = d // group

    @numba.njit(cache=True, nogil=True)
    def quantize(x, i0, i1, w0, w1, codes, scale_out, lo_out, row0):  # pragma: no cover
        # x: [B, H, N, D] float32 tokens (clipped in place); codes [B, H, >= row0 + N, D/4] uint8; scale_out /
        # lo_out [B, H, >= row0 + N, D/G] (int16 bits of a 16-bit scale dtype, or float32): token t goes to row
        # row0 + t (the outputs may be a cache's whole buffers). Returns the largest |lo| or 3 * scale (the range
        # check).
        heads, n = x.shape[1], x.shape[2]
        buf = np.empty(1, np.float32)
        ubuf = buf.view(np.uint32)
        a = np.empty(d, np.float32)
        largest = np.empty(max(top, 1), np.float32)
        three = np.float32(3.0)
        biggest_lo = np.float32(0.0)
        biggest_scale = np.float32(0.0)
        finite = True
        for row in range(x.shape[0] * heads * n):
            bb, hh, t = row // (heads * n), (row // n) % heads, row % n
            xt = x[bb, hh, t]
            if clip:
                amax = np.float32(0.0)
                if top > 0:
                    # largest[k] = the k-th largest |x| (k from 0); sorted ascending, a[i] is largest[d - 1 - i]
                    for k in range(top):
                        largest[k] = np.float32(-1.0)  # below every |x|
                    for c in range(d):
                        v = abs(xt[c])
                        amax = max(amax, v)
                        if v > largest[top - 1]:
                            k = top - 1
                            while k > 0 and largest[k - 1] < v:
                                largest[k] = largest[k - 1]
                                k -= 1
                            largest[k] = v
                    tau = largest[d - 1 - i0] * w0 + largest[d - 1 - i1] * w1
                else:
                    for c in range(d):
                        a[c] = abs(xt[c])
                        amax = max(amax, a[c])
                    a.sort()
                    tau = a[i0] * w0 + a[i1] * w1
                floor_ = np.float32(0.5) * amax
                tau = max(tau, floor_)
                for c in range(d):
                    v = xt[c]
                    v = max(v, -tau)
                    v = min(v, tau)
                    xt[c] = v
            for gi in range(groups):
                lo = xt[gi * group]
                hi = lo
                for c in range(gi * group, (gi + 1) * group):
                    if not np.isfinite(xt[c]):
                        finite = False
                    lo = min(lo, xt[c])
                    hi = max(hi, xt[c])
                scale = (hi - lo) / three
                biggest_lo = max(biggest_lo, abs(lo))
                biggest_scale = max(biggest_scale, scale)
                lo_bits, lo_s = _round_scale(buf, ubuf, lo, scale_kind)
                sc_bits, sf = _round_scale(buf, ubuf, scale, scale_kind)
                if scale_kind == 2:
                    scale_out[bb, hh, row0 + t, gi] = scale
                    lo_out[bb, hh, row0 + t, gi] = lo
                else:
                    scale_out[bb, hh, row0 + t, gi] = sc_bits
                    lo_out[bb, hh, row0 + t, gi] = lo_bits
                for j in range(gi * group // 4, (gi + 1) * group // 4):
                    byte = 0
                    for i in range(4):
                        code = np.float32(0.0)
                        if sf > 0:
                            y = (xt[4 * j + i] - lo_s) / sf
                            r = np.floor(y)
                            frac = y - r
                            if frac > 0.5 or (frac == 0.5 and r % 2 != 0):
                                r += 1
                            code = min(max(r, np.float32(0.0)), three)
                        byte |= np.int64(code) << (2 * i)
                    codes[bb, hh, row0 + t, j] = byte
        if not finite:  # NaN/Inf in a group (with check_finite off): the caller refuses it, as quantize_int2 does
            return np.float32(np.inf)
        return max(biggest_lo, biggest_scale * three)

    return quantize


class TokenGroupQuantizer:
    """:func:`~hf_kvint2.transforms.clip_rows` then :func:`~hf_kvint2.quant.quantize_int2` (``"token"`` groups) of
    rotated float32 tokens [B, H, n, D] in one compiled call, for one head_dim, group, clip ratio and scale dtype:
    codes, scales and offsets bit-identical to those ops (same errors for values too large for the scale dtype).
    Built once per layout (:func:`token_group_quantizer`); a decode step's demotion then costs the compiled call and
    little else."""

    def __init__(self, d: int, group: int, clip_ratio: float | None, scale_dtype: torch.dtype):
        _require_numba()
        if d % group or d % 4:
            raise ValueError(f"head_dim ({d}) must be a multiple of the group size ({group}) and of 4.")
        self.d, self.group, self.scale_dtype = d, group, scale_dtype
        self.kind = _SCALE_KINDS[scale_dtype]
        clip = clip_ratio is not None and clip_ratio < 1.0
        pos = (clip_ratio * (d - 1)) if clip else 0.0
        i0 = math.floor(pos)
        frac = pos - i0
        # the row's `d - i0` largest |x| hold both order statistics: kept apart where that is a few (clip ratios
        # near 1, the recipes' 0.92-0.96), else the sorted row
        top = d - i0 if clip and d - i0 <= QUANTIZER_TOP_MAX else 0
        self._fn = _make_quantizer(d, group, self.kind, clip, top)
        self._args = (i0, min(i0 + 1, d - 1), np.float32(1 - frac), np.float32(frac))
        self._limit = torch.finfo(scale_dtype).max

    def bits(self, t: torch.Tensor) -> np.ndarray:
        """A scale / offset tensor (or buffer) as the array the compiled call writes: int16 bits of 16-bit floats."""
        return (t.view(torch.int16) if self.kind != 2 else t).numpy()

    def write(self, x: np.ndarray, codes: np.ndarray, scale: np.ndarray, lo: np.ndarray, row0: int = 0) -> None:
        """Quantize float32 ``x`` [B, H, n, D] (clipped in place) into rows ``row0 .. row0 + n - 1`` of ``codes``
        [B, H, >= row0 + n, D/4] and ``scale`` / ``lo`` (from :meth:`bits`); the rows are undefined if it raises."""
        biggest = _superword_vectorized(self._fn, x, *self._args, codes, scale, lo, row0)
        if x.size and not biggest <= self._limit:
            raise scale_range_error(float(biggest), self.scale_dtype)

    def __call__(self, xr: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """:class:`~hf_kvint2.quant.QuantizedGroups` of ``xr`` [B, H, n, D] (which may be overwritten); ``out``:
        (codes, scale, lo) tensors [B, H, n, X] to write into instead."""
        b, h, n, d = xr.shape
        if d != self.d:
            raise ValueError(f"this quantizer is for head_dim {self.d}, got tokens of head_dim {d}.")
        # clipped in place: callers pass a temporary; detached: quantization has no gradient (a forward with grad on)
        x = _float32_array(xr)
        if out is None:
            codes = torch.empty(b, h, n, d // 4, dtype=torch.uint8)
            scale = torch.empty(b, h, n, d // self.group, dtype=self.scale_dtype)
            lo = torch.empty_like(scale)
        else:
            codes, scale, lo = out
        self.write(x, codes.numpy(), self.bits(scale), self.bits(lo))
        return QuantizedGroups(codes, scale, lo)


@functools.lru_cache(maxsize=256)
def token_group_quantizer(d: int, group: int, clip_ratio: float | None, scale_dtype: torch.dtype) -> TokenGroupQuantizer:
    """The :class:`TokenGroupQuantizer` for this layout (one per layout and process)."""
    return TokenGroupQuantizer(d, group, clip_ratio, scale_dtype)


def quantize_token_groups(xr: torch.Tensor, clip_ratio: float | None, group: int, scale_dtype: torch.dtype,
                          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """:func:`~hf_kvint2.transforms.clip_rows` then :func:`~hf_kvint2.quant.quantize_int2` (``"token"`` groups)
    of rotated float32 ``xr`` [B, H, n, D] in one compiled call: a :class:`~hf_kvint2.quant.QuantizedGroups`
    bit-identical to theirs (same errors for values too large for the scale dtype). ``xr`` may be overwritten.
    ``out``: (codes, scale, lo) tensors [B, H, n, X] to write into instead; their contents are undefined if it
    raises."""
    return token_group_quantizer(xr.shape[-1], group, clip_ratio, scale_dtype)(xr, out)


# ------------------------------------------------------------------------------------------------- input checks
# Every update's NaN/Inf check (hf_kvint2.layers.validate_kv) on CPU: one compiled pass over the new K and V,
# reading the float bits (an all-ones exponent is NaN or Inf), instead of the ~5 PyTorch ops and host sync of the
# reduction (~100 us per layer inside a decode step, where the model's weights have evicted them from the caches).
_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.float16: (torch.int16, 0x7C00),
                  torch.bfloat16: (torch.int16, 0x7F80)}

if _NUMBA:
    @numba.njit(cache=True, nogil=True)
    def _count_nonfinite_in(x, exponent):  # pragma: no cover
        # x: a rank-4 integer view of floats (any strides): elements whose exponent bits are all set (NaN, Inf)
        bad = 0
        for a in range(x.shape[0]):
            for b in range(x.shape[1]):
                for c in range(x.shape[2]):
                    for e in range(x.shape[3]):
                        bad += (x[a, b, c, e] & exponent) == exponent
        return bad

    @numba.njit(cache=True, nogil=True)
    def _count_nonfinite(k_bits, v_bits, exponent):  # pragma: no cover
        return _count_nonfinite_in(k_bits, exponent) + _count_nonfinite_in(v_bits, exponent)

    @numba.njit(cache=True, nogil=True)
    def _count_nonfinite_floats_in(x):  # pragma: no cover
        # x: rank-4 float32 (any strides); no fast-math here, so isfinite sees NaN and Inf
        bad = 0
        for a in range(x.shape[0]):
            for b in range(x.shape[1]):
                for c in range(x.shape[2]):
                    for e in range(x.shape[3]):
                        bad += not np.isfinite(x[a, b, c, e])
        return bad

    @numba.njit(cache=True, nogil=True)
    def _count_nonfinite_floats(k, v):  # pragma: no cover
        return _count_nonfinite_floats_in(k) + _count_nonfinite_floats_in(v)


def finite_check_supports(x: torch.Tensor) -> bool:
    """Whether :func:`all_finite` serves ``x``: rank-4 float32/float16/bfloat16 on CPU, eager."""
    return (_NUMBA and x.device.type == "cpu" and x.dim() == 4 and x.dtype in _EXPONENT_BITS
            and not torch.compiler.is_compiling())


def all_finite(k: torch.Tensor, v: torch.Tensor) -> bool:
    """No NaN/Inf in ``k`` or ``v`` (of one dtype, each served by :func:`finite_check_supports`): float32 read as
    floats, 16-bit floats (which numpy lacks or Numba cannot check) by their exponent bits."""
    k, v = (k.detach() if k.requires_grad else k), (v.detach() if v.requires_grad else v)
    if k.dtype == torch.float32:  # no bit views: each tensor op costs microseconds inside a model's step
        return not _count_nonfinite_floats(k.numpy(), v.numpy())
    view, exponent = _EXPONENT_BITS[k.dtype]
    return not _count_nonfinite(k.view(view).numpy(), v.view(view).numpy(), exponent)
