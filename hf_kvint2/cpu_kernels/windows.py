"""The layer step's parts outside the body: the query rotated into the keys' space, the full-precision windows'
partial attention, and the merge of the body with the windows in the original space.

These are :func:`hf_kvint2.read_path.attend_segments`' steps for one (batch row, KV head, query row): ``q' =
scaling * (q R_K)`` with bias ``scaling * (q . mu_K)``; each window's ``(max, sum of weights, unnormalised value
sum)``; the body's rotated value sum brought back (``acc R_V^T + l mu_V``) and everything merged by log-sum-exp.
"""

from __future__ import annotations

import math

import numpy as np

from .jit import NUMBA

if NUMBA:
    import numba

    from .bits import fma
    from .jit import njit
    from .lanes import dot
    from .softmax import exp_nonpositive

    _NEG_INF = np.float32(-np.inf)

    @njit
    def rotate_query(q, rot, mean, h, scaling, out, d, width):
        """One query row into the keys' rotated space: ``out[c] = scaling * sum_j q[j] rot[j, c]`` (j in order) and
        returns ``scaling * (q . mean[h])`` (0 without a mean: ``mean`` [0, D]). ``d`` (head_dim) and ``width``
        (the dot's lanes) are literals: the channel loops unroll."""
        numba.literally(d)
        numba.literally(width)
        acc = np.zeros(d, np.float32)
        for j in range(d):
            qj = q[j]
            for c in range(d):
                acc[c] = fma(qj, rot[j, c], acc[c])
        for c in range(d):
            out[c] = scaling * acc[c]
        if mean.shape[0] == 0:
            return np.float32(0.0)
        return scaling * dot(q, 0, mean[h], 0, d, width)

    @njit
    def window_partial(q, k, v, n, scaling, mask, b, row, col, acc, d, width):
        """Attention of the query row ``q`` [D] (original space) over the first ``n`` tokens of the window ``k`` /
        ``v`` [>= n, D], whose mask columns start at ``col`` (query position ``row`` of ``mask [B, Lq or 1, cols]``;
        zero rows: no mask). Returns (max score, sum of exp(score - max)) and sets ``acc`` [D] to the unnormalised
        value sum; (-inf, 0) and zeros when the row attends nothing here. ``d`` and ``width`` are literals."""
        numba.literally(d)
        numba.literally(width)
        mask_rows = mask.shape[1]
        scores = np.empty(n, np.float32)
        m = _NEG_INF
        for t in range(n):
            s = scaling * dot(q, 0, k[t], 0, d, width)
            if mask_rows > 0:
                s += mask[b, row if mask_rows > 1 else 0, col + t]
            scores[t] = s
            m = max(m, s)
        acc[:] = 0.0
        if m == _NEG_INF:
            return m, np.float32(0.0)
        for t in range(n):
            scores[t] -= m
        exp_nonpositive(scores, np.empty(n, np.int32))
        total = np.float32(0.0)
        for t in range(n):
            p = scores[t]
            total += p
            for c in range(d):
                acc[c] = fma(p, v[t, c], acc[c])
        return m, total

    @njit
    def merge_step(parts_m, parts_l, parts_acc, body_acc, rot_v_t, mean_v, h, out, d):
        """The layer step's output for one query row. ``parts_*``: (max, weight sum, value sum [3, D]) of the window
        before the body, the window after it and the body (index 2, whose value sum ``body_acc`` is in the values'
        rotated space: brought back as ``sum_j body_acc[j] rot_v_t[j]`` + weight sum x ``mean_v[h]``). Merged by
        log-sum-exp into ``out`` [D]; returns the log-sum-exp (-inf, and zeros, for a row that attends nothing).
        ``d`` is a literal."""
        numba.literally(d)
        big = max(max(parts_m[0], parts_m[1]), parts_m[2])
        if big == _NEG_INF:
            out[:] = 0.0
            return _NEG_INF
        body = parts_acc[2]
        body[:] = 0.0
        if parts_l[2] > 0:
            for j in range(d):
                a = body_acc[j]
                for c in range(d):
                    body[c] = fma(a, rot_v_t[j, c], body[c])
            if mean_v.shape[0] > 0:
                for c in range(d):
                    body[c] = fma(parts_l[2], mean_v[h, c], body[c])
        den = np.float32(0.0)
        e = np.zeros(3, np.float32)
        for i in range(3):
            if parts_l[i] > 0:
                e[i] = np.float32(math.exp(parts_m[i] - big))
                den = fma(e[i], parts_l[i], den)
        inv = np.float32(1.0) / den
        for c in range(d):
            out[c] = fma(e[2], body[c], fma(e[1], parts_acc[1, c], e[0] * parts_acc[0, c])) * inv
        return big + np.float32(math.log(den))
