"""A split's key scores, ``q'_r . k_t + bias_r`` for its tokens t and the padded query rows r (``scores [ns, RP]``).

Per-token key groups (OSCAR): ``k_t = norm_t * (code_t * scale_tg + offset_tg)`` per group g of channels, so the
score is a sum over groups of ``scale_tg * (q'_r . code_tg) + offset_tg * sum_g(q'_r)``. ``q'_r . code`` comes from a
table per (batch row, KV head) of ``q'_r . codes(byte)`` for every byte position and value (:func:`key_table`, one
lookup per 4 channels), four query rows to a table entry. Per-channel key groups (OScaR): a group of tokens shares
its scales and offsets, :func:`hf_kvint2.cpu_kernels.key_scores.channel_key_scores` unpacks the codes in registers.
"""

from __future__ import annotations

import numpy as np

from .ir import LANES
from .jit import NUMBA

# byte -> its four 2-bit codes (channels 4j .. 4j + 3 of byte j), as float32
CODES = np.array([[(byte >> (2 * i)) & 3 for i in range(4)] for byte in range(256)], np.float32)

if NUMBA:
    import numba

    from .bits import fma, two_bit_code
    from .jit import njit
    from .key_scores import channel_key_scores

    _NEG_INF = np.float32(-np.inf)

    @njit
    def key_table(q, rc, j, table):
        """Entries of byte position j for query rows rc * LANES .. + 3 of ``q`` [RP, D]: ``table[(j * 256 + byte) *
        LANES + lane] = q[rc * LANES + lane] . codes of byte`` (channels 4j .. 4j + 3). A byte's entry is its low
        nibble's part (channels 4j, 4j + 1) plus its high nibble's (two 16-entry tables, one add per entry)."""
        low = np.empty(16 * LANES, np.float32)
        high = np.empty(16 * LANES, np.float32)
        for nib in range(16):
            c0, c1 = CODES[nib, 0], CODES[nib, 1]
            for lane in range(LANES):
                r = rc * LANES + lane
                low[nib * LANES + lane] = fma(q[r, 4 * j + 1], c1, q[r, 4 * j] * c0)
                high[nib * LANES + lane] = fma(q[r, 4 * j + 3], c1, q[r, 4 * j + 2] * c0)
        for hi in range(16):
            for lo in range(16):
                for lane in range(LANES):
                    table[(j * 256 + hi * 16 + lo) * LANES + lane] = low[lo * LANES + lane] + high[hi * LANES + lane]

    @njit
    def group_sums(q, group, out):
        """out[g, r] = sum of q[r] over channels g * group .. (g + 1) * group - 1, in channel order."""
        for r in range(q.shape[0]):
            for g in range(out.shape[0]):
                acc = np.float32(0.0)
                for c in range(g * group, (g + 1) * group):
                    acc += q[r, c]
                out[g, r] = acc

    @njit
    def token_key_scores(scores, part_m, tables, qsum, codes, scale, lo, norm, bias, d4, group_bytes):
        """Scores of per-token key groups from the query tables (``tables [RP / LANES, d4 * 256 * LANES]``, ``qsum
        [G, RP]``) for a split's tokens: ``codes [ns, d4]``, float32 ``scale`` / ``lo [ns, G]``, ``norm [ns]`` or
        empty (no token norms), ``bias [RP]``; the rows' max score goes to ``part_m [RP]``. ``d4`` and
        ``group_bytes`` (4 bytes per group or more, a multiple of 4) are literals: the byte loops unroll, their
        lookups summed in four running sums (bytes j mod 4) that are added at the end of each group."""
        numba.literally(d4)
        numba.literally(group_bytes)
        groups = d4 // group_bytes
        has_norm = norm.shape[0] > 0
        for rc in range(tables.shape[0]):
            r0 = rc * LANES
            lt = tables[rc]
            b0, b1, b2, b3 = bias[r0], bias[r0 + 1], bias[r0 + 2], bias[r0 + 3]
            m0 = m1 = m2 = m3 = _NEG_INF
            for i in range(codes.shape[0]):
                s0 = s1 = s2 = s3 = np.float32(0.0)
                for g in range(groups):
                    a0 = a1 = a2 = a3 = e0 = e1 = e2 = e3 = np.float32(0.0)
                    u0 = u1 = u2 = u3 = v0 = v1 = v2 = v3 = np.float32(0.0)
                    for jj in range(0, group_bytes, 4):
                        j = g * group_bytes + jj
                        at = (j * 256 + np.int64(codes[i, j])) * LANES
                        a0, a1, a2, a3 = a0 + lt[at], a1 + lt[at + 1], a2 + lt[at + 2], a3 + lt[at + 3]
                        at = ((j + 1) * 256 + np.int64(codes[i, j + 1])) * LANES
                        e0, e1, e2, e3 = e0 + lt[at], e1 + lt[at + 1], e2 + lt[at + 2], e3 + lt[at + 3]
                        at = ((j + 2) * 256 + np.int64(codes[i, j + 2])) * LANES
                        u0, u1, u2, u3 = u0 + lt[at], u1 + lt[at + 1], u2 + lt[at + 2], u3 + lt[at + 3]
                        at = ((j + 3) * 256 + np.int64(codes[i, j + 3])) * LANES
                        v0, v1, v2, v3 = v0 + lt[at], v1 + lt[at + 1], v2 + lt[at + 2], v3 + lt[at + 3]
                    sc, off = scale[i, g], lo[i, g]
                    s0 = fma(sc, (a0 + e0) + (u0 + v0), fma(off, qsum[g, r0], s0))
                    s1 = fma(sc, (a1 + e1) + (u1 + v1), fma(off, qsum[g, r0 + 1], s1))
                    s2 = fma(sc, (a2 + e2) + (u2 + v2), fma(off, qsum[g, r0 + 2], s2))
                    s3 = fma(sc, (a3 + e3) + (u3 + v3), fma(off, qsum[g, r0 + 3], s3))
                if has_norm:
                    nt = norm[i]
                    s0, s1, s2, s3 = fma(s0, nt, b0), fma(s1, nt, b1), fma(s2, nt, b2), fma(s3, nt, b3)
                else:
                    s0, s1, s2, s3 = s0 + b0, s1 + b1, s2 + b2, s3 + b3
                scores[i, r0], scores[i, r0 + 1], scores[i, r0 + 2], scores[i, r0 + 3] = s0, s1, s2, s3
                m0, m1, m2, m3 = max(m0, s0), max(m1, s1), max(m2, s2), max(m3, s3)
            part_m[r0], part_m[r0 + 1], part_m[r0 + 2], part_m[r0 + 3] = m0, m1, m2, m3

    @njit
    def token_key_scores_any(scores, part_m, tables, qsum, codes, scale, lo, norm, bias, group_bytes):
        """:func:`token_key_scores` for any group of whole bytes (a runtime ``group_bytes``): byte by byte, one
        running sum per group."""
        d4 = codes.shape[1]
        has_norm = norm.shape[0] > 0
        for rc in range(tables.shape[0]):
            r0 = rc * LANES
            lt = tables[rc]
            for i in range(codes.shape[0]):
                for lane in range(LANES):
                    s = np.float32(0.0)
                    for g in range(d4 // group_bytes):
                        a = np.float32(0.0)
                        for j in range(g * group_bytes, (g + 1) * group_bytes):
                            a += lt[(j * 256 + np.int64(codes[i, j])) * LANES + lane]
                        s = fma(scale[i, g], a, fma(lo[i, g], qsum[g, r0 + lane], s))
                    s = fma(s, norm[i], bias[r0 + lane]) if has_norm else s + bias[r0 + lane]
                    scores[i, r0 + lane] = s
            for lane in range(LANES):
                m = _NEG_INF
                for i in range(codes.shape[0]):
                    m = max(m, scores[i, r0 + lane])
                part_m[r0 + lane] = m

    @njit
    def token_key_scores_plain(scores, part_m, q, codes, scale, lo, norm, bias, group):
        """:func:`token_key_scores` for groups of fewer channels than a byte holds (no tables): each token
        dequantized, then a dot per query row."""
        ns, d4 = codes.shape
        x = np.empty(4 * d4, np.float32)
        for i in range(ns):
            nt = norm[i] if norm.shape[0] > 0 else np.float32(1.0)
            for j in range(d4):
                for k in range(4):
                    c = 4 * j + k
                    x[c] = fma(CODES[codes[i, j], k], scale[i, c // group], lo[i, c // group]) * nt
            for r in range(scores.shape[1]):
                s = np.float32(0.0)
                for c in range(4 * d4):
                    s = fma(q[r, c], x[c], s)
                scores[i, r] = s + bias[r]
        for r in range(scores.shape[1]):
            m = _NEG_INF
            for i in range(ns):
                m = max(m, scores[i, r])
            part_m[r] = m

    @njit
    def channel_key_scores_split(scores, q, bias, codes, scale, lo, norm, group, live_rows, d4, width):
        """Scores of per-channel key groups for a split's tokens (``codes [ns, d4]``, whole groups of ``group``
        tokens from the first, float32 ``scale`` / ``lo [groups, D]`` of those groups, ``norm [ns]`` or ones),
        query rows ``q [RP, D]`` with ``bias [RP]``; rows from ``live_rows`` on are padding (-inf). ``d4`` and
        ``width`` (4, 8 or 16, dividing d4: :func:`channel_key_scores`' vectors; 0: none does, the plain loops)
        are literals."""
        numba.literally(d4)
        numba.literally(width)
        ns, rp, d = scores.shape[0], scores.shape[1], 4 * d4
        q_planes = np.empty((rp, d), np.float32)  # channel 4j + i at i * d4 + j: the codes' plane order
        for r in range(rp):
            for i in range(4):
                for j in range(d4):
                    q_planes[r, i * d4 + j] = q[r, 4 * j + i]
        if width > 0:
            scores_flat, q_planes_flat, q_flat = scores.reshape(-1), q_planes.reshape(-1), q.reshape(-1)
            scale_flat, lo_flat = scale.reshape(-1), lo.reshape(-1)
            for g0 in range(0, ns, group):
                g1 = min(ns, g0 + group)
                group_codes = codes[g0:g1].reshape(-1)
                full = (g1 - g0) // width * width
                for r0 in range(0, rp, LANES):
                    live = min(LANES, live_rows - r0)
                    if live <= 0:
                        break
                    channel_key_scores(scores_flat, g0 * rp + r0, rp, group_codes, q_planes_flat, q_flat, r0 * d,
                                       scale_flat, lo_flat, g0 // group * d, norm, g0, bias, r0, full, d4, width,
                                       width, live)
                    channel_key_scores(scores_flat, (g0 + full) * rp + r0, rp, group_codes[full * d4:],
                                       q_planes_flat, q_flat, r0 * d, scale_flat, lo_flat, g0 // group * d, norm,
                                       g0 + full, bias, r0, g1 - g0 - full, d4, width, 1, live)
        else:
            channel_key_scores_plain(scores, q, q_planes, bias, codes, scale, lo, norm, group, live_rows)
        for t in range(ns):
            for r in range(live_rows, rp):  # padding rows: their scores are never read
                scores[t, r] = _NEG_INF

    @njit
    def channel_key_scores_plain(scores, q, q_planes, bias, codes, scale, lo, norm, group, live_rows):
        """:func:`channel_key_scores_split` for head_dims no vector width serves: per group, the rows times the
        scales (plane order) and the rows' offset dots once, the group's codes unpacked in one loop, then a dot per
        token and row."""
        ns, d4 = codes.shape
        d = 4 * d4
        q_scaled = np.empty((live_rows, d), np.float32)
        q_lo = np.empty(live_rows, np.float32)
        planes = np.empty((4, group * d4), np.float32)
        for g0 in range(0, ns, group):
            g1 = min(ns, g0 + group)
            g = g0 // group
            for r in range(live_rows):
                acc = np.float32(0.0)
                for i in range(4):
                    for j in range(d4):
                        q_scaled[r, i * d4 + j] = q_planes[r, i * d4 + j] * scale[g, 4 * j + i]
                for c in range(d):
                    acc = fma(q[r, c], lo[g, c], acc)
                q_lo[r] = acc
            group_codes = codes[g0:g1].reshape(-1)
            for k in range((g1 - g0) * d4):
                v = group_codes[k]
                planes[0, k] = two_bit_code(v, 0)
                planes[1, k] = two_bit_code(v, 2)
                planes[2, k] = two_bit_code(v, 4)
                planes[3, k] = two_bit_code(v, 6)
            for t in range(g0, g1):
                base = (t - g0) * d4
                for r in range(live_rows):
                    acc = np.float32(0.0)
                    for i in range(4):
                        for j in range(d4):
                            acc = fma(q_scaled[r, i * d4 + j], planes[i, base + j], acc)
                    scores[t, r] = fma(acc + q_lo[r], norm[t], bias[r])
