"""A split's value partial: ``acc[r] = sum_t w[t, r] * v_t`` in the values' rotated space, and the weights' sum
``l[r] = sum_t w[t, r]``, from the split's unnormalised softmax weights ``w [ns, RP]`` and its INT2 values
(``v_t = norm_t * (code_t * scale + offset)``, per-token groups of channels or per-channel groups of tokens).
"""

from __future__ import annotations

import numpy as np

from .ir import LANES
from .jit import NUMBA

if NUMBA:
    import numba

    from .bits import fma, widen
    from .jit import njit
    from .keys import CODES
    from .softmax import row_sums
    from .value_sums import accumulate_values

    @njit
    def token_value_sums(weights, codes, scale, lo, norm, live_rows, acc, l_out, d4, group_bytes, width):
        """Per-token value groups, summed by :func:`accumulate_values` (vectors of ``width`` bytes' codes):
        ``codes [ns, d4]``, float32 ``scale`` / ``lo [ns, G]`` (overwritten: the token norms are folded into them),
        ``norm [ns]`` or empty; writes ``acc [RP, D]`` (channel order) and ``l_out [RP]``. ``d4``, ``group_bytes``
        and ``width`` are literals; rows from ``live_rows`` on are padding (zero weights: skipped)."""
        numba.literally(d4)
        numba.literally(group_bytes)
        numba.literally(width)
        ns, rp = weights.shape
        groups = d4 // group_bytes
        if norm.shape[0] > 0:
            for i in range(ns):
                for g in range(groups):
                    scale[i, g] *= norm[i]
                    lo[i, g] *= norm[i]
        d, chunks = 4 * d4, d4 // width
        sums = np.zeros(rp * (groups + 1), np.float32)  # per row: the weights' sum, then per group of offsets
        lanes_acc = np.zeros(rp * d, np.float32)  # (row chunk, byte chunk, row, code i, byte) order
        codes_flat, weights_flat, scale_flat, lo_flat = codes.reshape(-1), weights.reshape(-1), scale.reshape(-1), \
            lo.reshape(-1)
        for r0 in range(0, rp, LANES):
            live = min(LANES, live_rows - r0)
            if live <= 0:
                break
            accumulate_values(lanes_acc, r0 * d, codes_flat, weights_flat, r0, rp, scale_flat, lo_flat, sums,
                              r0 * (groups + 1), ns, d4, width, group_bytes, live)
        acc[:] = 0.0
        for r in range(live_rows):
            l_out[r] = sums[r * (groups + 1)]
            at = (r // LANES * chunks * LANES + r % LANES) * 4 * width
            for m in range(chunks):
                for i in range(4):
                    for lane in range(width):
                        c = 4 * (m * width + lane) + i
                        acc[r, c] = lanes_acc[at + (m * LANES * 4 + i) * width + lane] + \
                            sums[r * (groups + 1) + 1 + c // (4 * group_bytes)]
        for r in range(live_rows, rp):
            l_out[r] = 0.0

    @njit
    def token_value_sums_any(weights, codes, scale, lo, norm, group, acc, l_out):
        """Per-token value groups of any size (also groups that split a byte): token by token, code by code."""
        ns, rp = weights.shape
        d4 = codes.shape[1]
        has_norm = norm.shape[0] > 0
        acc[:] = 0.0
        l_out[:] = 0.0
        for t in range(ns):
            nt = norm[t] if has_norm else np.float32(1.0)
            for r in range(rp):
                w = weights[t, r]
                l_out[r] += w
                wn = w * nt
                for j in range(d4):
                    byte = codes[t, j]
                    for i in range(4):
                        c = 4 * j + i
                        g = c // group
                        acc[r, c] = fma(wn, fma(CODES[byte, i], scale[t, g], lo[t, g]), acc[r, c])

    @njit
    def channel_value_sums(weights, codes, scale, lo, norm, group, t0, kind, live_rows, acc, l_out, d4, width):
        """Per-channel value groups for a split's tokens t0 .. (a group boundary; ``codes [ns, d4]``, the stream's
        stored ``scale`` / ``lo [rows, D]`` of ``kind``, ``norm [ns]`` or empty). A group's tokens share their
        scales and offsets, so per group and query row only the codes are summed, weighted (by
        :func:`accumulate_values`, in vector registers: ``sum_t w_t n_t code_t``, ``sum_t w_t n_t``), and the
        group's scales and offsets are applied once: ``acc += scale * codes' sum + lo * weights' sum``. Rows from
        ``live_rows`` on are padding (zero weights: skipped). ``d4`` and ``width`` (4, 8 or 16, dividing d4; 0: the
        plain loop) are literals."""
        numba.literally(d4)
        numba.literally(width)
        if width == 0:
            channel_value_sums_plain(weights, codes, scale, lo, norm, group, t0, kind, live_rows, acc, l_out)
            return
        ns, rp = weights.shape
        d, chunks = 4 * d4, d4 // width
        token_norms = norm if norm.shape[0] > 0 else np.ones(ns, np.float32)
        lanes_acc = np.empty(rp * d, np.float32)  # (row chunk, byte chunk, row, code i, byte) order
        sums = np.empty(rp * 2, np.float32)  # per row: the weights' sum, the norm-weighted sum (the offsets')
        v_scale, v_lo = np.empty(d, np.float32), np.empty(d, np.float32)  # the group's, widened once
        codes_flat, weights_flat = codes.reshape(-1), weights.reshape(-1)
        acc[:] = 0.0
        l_out[:] = 0.0
        for g0 in range(0, ns, group):
            g1 = min(ns, g0 + group)
            row = (t0 + g0) // group
            widen(scale[row], v_scale, kind)
            widen(lo[row], v_lo, kind)
            lanes_acc[:] = 0.0
            sums[:] = 0.0
            group_norms = token_norms[g0:g1]
            for r0 in range(0, rp, LANES):
                live = min(LANES, live_rows - r0)
                if live <= 0:
                    break
                accumulate_values(lanes_acc, r0 * d, codes_flat[g0 * d4:g1 * d4], weights_flat, g0 * rp + r0, rp,
                                  group_norms, group_norms, sums, r0 * 2, g1 - g0, d4, width, d4, live)
            for r in range(live_rows):
                l_out[r] += sums[2 * r]
                weighted = sums[2 * r + 1]
                at = (r // LANES * chunks * LANES + r % LANES) * 4 * width
                for m in range(chunks):
                    for i in range(4):
                        for lane in range(width):
                            c = 4 * (m * width + lane) + i
                            acc[r, c] = fma(v_scale[c], lanes_acc[at + (m * LANES * 4 + i) * width + lane],
                                            fma(v_lo[c], weighted, acc[r, c]))

    @njit
    def channel_value_sums_plain(weights, codes, scale, lo, norm, group, t0, kind, live_rows, acc, l_out):
        """:func:`channel_value_sums` for head_dims no vector width serves: each token dequantized once, then added
        to the sum of every row below ``live_rows``; the weights' sums four rows at a time."""
        ns, rp = weights.shape
        d4 = codes.shape[1]
        d = 4 * d4
        has_norm = norm.shape[0] > 0
        v_scale, v_lo, x = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(d, np.float32)
        acc[:] = 0.0
        row, next_row = t0 // group - 1, t0  # next_row: the split's token where the next group's row starts
        for t in range(ns):
            if t0 + t == next_row:
                row, next_row = row + 1, next_row + group
                widen(scale[row], v_scale, kind)
                widen(lo[row], v_lo, kind)
            nt = norm[t] if has_norm else np.float32(1.0)
            for j in range(d4):
                byte = codes[t, j]
                for i in range(4):
                    c = 4 * j + i
                    x[c] = fma(CODES[byte, i], v_scale[c], v_lo[c]) * nt
            for r in range(live_rows):
                w = weights[t, r]
                for c in range(d):
                    acc[r, c] = fma(w, x[c], acc[r, c])
        for r0 in range(0, rp, LANES):
            l_out[r0], l_out[r0 + 1], l_out[r0 + 2], l_out[r0 + 3] = row_sums(weights, r0)
