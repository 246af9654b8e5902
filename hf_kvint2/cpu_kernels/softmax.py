"""The softmax pieces of the kernels: an exp that vectorizes, a split's unnormalised weights, and the log-sum-exp
merge of the splits of one query row.

Scores are ``[token, row]`` with the query rows padded to a multiple of LANES: the loops over tokens carry the
running max or sum of four rows side by side, one vector for LLVM's superword vectorizer.
"""

from __future__ import annotations

import math

import numpy as np

from .ir import LANES
from .jit import NUMBA

if NUMBA:
    from .bits import fma
    from .jit import njit

    _LOG2E = np.float32(1.4426950408889634)
    _LN2_HI = np.float32(0.693359375)  # ln 2 in two parts (Cody-Waite): x - n ln 2 without cancellation
    _LN2_LO = np.float32(-2.12194440e-4)
    _EXP_MIN = np.float32(-87.0)  # below it exp(x) underflows float32's normal range: the weight is 0
    _NEG_INF = np.float32(-np.inf)

    @njit
    def exp_nonpositive(x, pow2):
        """x[k] = exp(x[k]) in place for x <= 0 (scores minus their row's max; -inf gives 0): range reduction
        x = n ln 2 + r, a degree-6 polynomial for exp(r), 2^n from its float32 bits (pow2: int32 scratch of x's
        size). One loop LLVM vectorizes, unlike the scalar libm exp: 8x faster, within 2 ulp."""
        for k in range(x.shape[0]):
            v = x[k]
            vc = max(v, _EXP_MIN)
            n = np.int32(vc * _LOG2E - np.float32(0.5))  # round to nearest for vc <= 0 (truncation toward 0)
            nf = np.float32(n)
            r = fma(-nf, _LN2_LO, vc - nf * _LN2_HI)  # nf * _LN2_HI is exact (few bits in _LN2_HI)
            p = np.float32(1.9875691500e-4)
            p = fma(p, r, np.float32(1.3981999507e-3))
            p = fma(p, r, np.float32(8.3334519073e-3))
            p = fma(p, r, np.float32(4.1665795894e-2))
            p = fma(p, r, np.float32(1.6666665459e-1))
            p = fma(p, r, np.float32(5.0000001201e-1))
            p = fma(p, r * r, r) + np.float32(1.0)
            x[k] = p if v >= _EXP_MIN else np.float32(0.0)
            pow2[k] = (n + np.int32(127)) << 23
        two_n = pow2.view(np.float32)
        for k in range(x.shape[0]):
            x[k] = x[k] * two_n[k]

    @njit
    def add_mask(scores, mask, b, query_len, col):
        """scores[t, r] += the additive mask of query row r (``mask [B, Lq or 1, cols]``; row r is query position
        r % query_len) at column col + t. A zero-row mask adds nothing."""
        mask_rows = mask.shape[1]
        if mask_rows == 0:
            return
        rows = np.empty(scores.shape[1], np.int64)
        for r in range(scores.shape[1]):
            rows[r] = r % query_len if mask_rows > 1 else 0
        for t in range(scores.shape[0]):
            for r in range(scores.shape[1]):
                scores[t, r] += mask[b, rows[r], col + t]

    @njit
    def row_max(scores, r0):
        """The max over tokens of the scores of rows r0 .. r0 + 3 (-inf for none)."""
        m0 = m1 = m2 = m3 = _NEG_INF
        for i in range(scores.shape[0]):
            m0 = max(m0, scores[i, r0])
            m1 = max(m1, scores[i, r0 + 1])
            m2 = max(m2, scores[i, r0 + 2])
            m3 = max(m3, scores[i, r0 + 3])
        return m0, m1, m2, m3

    @njit
    def row_sums(scores, r0):
        """The sums over tokens of the weights of rows r0 .. r0 + 3: even and odd tokens in two running sums (two
        dependent chains of adds instead of one), added at the end."""
        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
        n = scores.shape[0]
        for i in range(0, n - 1, 2):
            a0 += scores[i, r0]
            a1 += scores[i, r0 + 1]
            a2 += scores[i, r0 + 2]
            a3 += scores[i, r0 + 3]
            b0 += scores[i + 1, r0]
            b1 += scores[i + 1, r0 + 1]
            b2 += scores[i + 1, r0 + 2]
            b3 += scores[i + 1, r0 + 3]
        if n % 2:
            a0 += scores[n - 1, r0]
            a1 += scores[n - 1, r0 + 1]
            a2 += scores[n - 1, r0 + 2]
            a3 += scores[n - 1, r0 + 3]
        return a0 + b0, a1 + b1, a2 + b2, a3 + b3

    @njit
    def split_weights(scores, part_m, max_taken):
        """A split's scores [ns, RP] -> unnormalised softmax weights exp(score - row max), in place; the rows' max
        goes to ``part_m`` [RP] (or is read from it: ``max_taken``, the key loop took it). A row that attends
        nothing here (all -inf) keeps its scores: exp gives it 0 weights."""
        for r0 in range(0, scores.shape[1], LANES):
            if max_taken:
                m0, m1, m2, m3 = part_m[r0], part_m[r0 + 1], part_m[r0 + 2], part_m[r0 + 3]
            else:
                m0, m1, m2, m3 = row_max(scores, r0)
                part_m[r0], part_m[r0 + 1], part_m[r0 + 2], part_m[r0 + 3] = m0, m1, m2, m3
            f0 = m0 if m0 != _NEG_INF else np.float32(0.0)
            f1 = m1 if m1 != _NEG_INF else np.float32(0.0)
            f2 = m2 if m2 != _NEG_INF else np.float32(0.0)
            f3 = m3 if m3 != _NEG_INF else np.float32(0.0)
            for i in range(scores.shape[0]):
                scores[i, r0] -= f0
                scores[i, r0 + 1] -= f1
                scores[i, r0 + 2] -= f2
                scores[i, r0 + 3] -= f3
        flat = scores.reshape(-1)
        exp_nonpositive(flat, np.empty(flat.shape[0], np.int32))

    @njit
    def merge_splits(part_m, part_l, part_acc, r, acc):
        """Query row r's partials of every split (max ``part_m [S, RP]``, weight sum ``part_l``, unnormalised value
        sum ``part_acc [S, RP, D]``) merged by log-sum-exp: returns (max, weight sum) and sets ``acc [D]`` to the
        value sum, all relative to that max. A split that attends nothing is skipped."""
        m = _NEG_INF
        for s in range(part_m.shape[0]):
            m = max(m, part_m[s, r])
        total = np.float32(0.0)
        acc[:] = 0.0
        for s in range(part_m.shape[0]):
            if part_m[s, r] == _NEG_INF:
                continue
            ws = np.float32(math.exp(part_m[s, r] - m))
            total = fma(ws, part_l[s, r], total)
            pa = part_acc[s, r]
            for c in range(acc.shape[0]):
                acc[c] = fma(ws, pa[c], acc[c])
        return m, total
