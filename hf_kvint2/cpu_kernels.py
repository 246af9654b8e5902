"""Numba CPU kernel for the INT2 body partial attention (optional: ``pip install '.[cpu]'`` in a clone).

Same contract as :func:`hf_kvint2.read_path.body_partial_blocked` (its PyTorch fallback; registered in
:mod:`hf_kvint2.backends`). One
parallel task per (batch row, KV head): each token's codes are read and dequantized once (in the rotated space)
for all query rows of its GQA group (``groups * query_len`` rows), scores go to a per-task buffer of
``rows x tokens`` floats, then a second pass accumulates the softmax-weighted values, still in the rotated space.
Nothing of the size of a layer's full-precision K/V history is allocated.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import torch

from .read_path import mask_to_additive

_NUMBA = importlib.util.find_spec("numba") is not None


def available() -> bool:
    """True when Numba is installed (the kernel compiles on first use, then is cached on disk)."""
    return _NUMBA


if _NUMBA:
    import numba

    # No 'nnan'/'ninf' fast-math flags: masked scores are -inf.
    _FASTMATH = {"reassoc", "contract", "arcp", "nsz"}
    LANES = 4  # query rows are padded to a multiple of this so the inner loops vectorize

    @numba.njit(inline="always", fastmath=_FASTMATH)
    def _code(byte, i):  # pragma: no cover - compiled
        return np.float32((byte >> (2 * i)) & 3)

    @numba.njit(parallel=True, fastmath=_FASTMATH, cache=True, nogil=True)
    def _body_attention_kernel(q, bias, mask, query_len, kc, ks, kl, kn, k_token_axis, k_group,
                               vc, vs, vl, vn, v_token_axis, v_group, n, out, lse):  # pragma: no cover - compiled
        # q: [B, H, RP, D] with RP a multiple of LANES (padding rows are zeros and are discarded by the caller).
        b_size, h_size, rp, d = q.shape
        d4 = d // 4
        n_chunks = rp // LANES
        has_mask = mask.shape[1] > 0
        mask_rows = mask.shape[1]
        has_kn = kn.shape[1] > 0
        has_vn = vn.shape[1] > 0
        neg_inf = np.float32(-np.inf)
        for task in numba.prange(b_size * h_size):
            b = task // h_size
            h = task % h_size
            qt = q[b, h]
            scores = np.empty((n, rp), np.float32)  # [token, query row]
            x = np.empty(d, np.float32)
            # ---- scores
            if k_token_axis:
                # lut[j * 256 + byte, r] = q_r . (codes in byte j): a token's dot product is d/4 lookups per group.
                lut = np.empty((d4 * 256, rp), np.float32)
                for j in range(d4):
                    for byte in range(256):
                        for r in range(rp):
                            lut[j * 256 + byte, r] = (qt[r, 4 * j] * _code(byte, 0) + qt[r, 4 * j + 1] * _code(byte, 1)
                                                      + qt[r, 4 * j + 2] * _code(byte, 2)
                                                      + qt[r, 4 * j + 3] * _code(byte, 3))
                n_groups = d // k_group
                gbytes = k_group // 4
                qsum = np.zeros((n_groups, rp), np.float32)
                for r in range(rp):
                    for c in range(d):
                        qsum[c // k_group, r] += qt[r, c]
                kct, kst, klt = kc[b, h], ks[b, h], kl[b, h]
                for rc in range(n_chunks):  # four query rows in registers; codes re-read per chunk of rows
                    r0 = rc * LANES
                    for t in range(n):
                        s0 = s1 = s2 = s3 = np.float32(0.0)
                        for gi in range(n_groups):
                            a0 = a1 = a2 = a3 = np.float32(0.0)
                            for j in range(gi * gbytes, (gi + 1) * gbytes):
                                row = j * 256 + kct[t, j]
                                a0 += lut[row, r0]
                                a1 += lut[row, r0 + 1]
                                a2 += lut[row, r0 + 2]
                                a3 += lut[row, r0 + 3]
                            sc = kst[t, gi]
                            off = klt[t, gi]
                            s0 += sc * a0 + off * qsum[gi, r0]
                            s1 += sc * a1 + off * qsum[gi, r0 + 1]
                            s2 += sc * a2 + off * qsum[gi, r0 + 2]
                            s3 += sc * a3 + off * qsum[gi, r0 + 3]
                        norm = kn[b, t] if has_kn else np.float32(1.0)
                        scores[t, r0] = s0 * norm + bias[b, h, r0]
                        scores[t, r0 + 1] = s1 * norm + bias[b, h, r0 + 1]
                        scores[t, r0 + 2] = s2 * norm + bias[b, h, r0 + 2]
                        scores[t, r0 + 3] = s3 * norm + bias[b, h, r0 + 3]
            else:
                # Per-channel groups: dequantize each token once (rotated space), dot with every query row.
                for t in range(n):
                    row = t // k_group
                    for j in range(d4):
                        byte = kc[b, h, t, j]
                        for i in range(4):
                            c = 4 * j + i
                            x[c] = _code(byte, i) * ks[b, h, row, c] + kl[b, h, row, c]
                    norm = kn[b, t] if has_kn else np.float32(1.0)
                    for r in range(rp):
                        acc = np.float32(0.0)
                        for c in range(d):
                            acc += qt[r, c] * x[c]
                        scores[t, r] = acc * norm + bias[b, h, r]
            if has_mask:
                for t in range(n):
                    for r in range(rp):
                        scores[t, r] += mask[b, (r % query_len) if mask_rows > 1 else 0, t]
            # ---- softmax (unnormalised weights in place)
            row_max = np.full(rp, neg_inf, np.float32)
            row_sum = np.zeros(rp, np.float32)
            for t in range(n):
                for r in range(rp):
                    row_max[r] = max(row_max[r], scores[t, r])
            ref = np.zeros(rp, np.float32)
            for r in range(rp):
                if row_max[r] != neg_inf:
                    ref[r] = row_max[r]
            for t in range(n):
                for r in range(rp):
                    p = np.float32(math.exp(scores[t, r] - ref[r]))
                    scores[t, r] = p
                    row_sum[r] += p
            # ---- values, rotated space
            acc_v = np.zeros((rp, d), np.float32)
            if v_token_axis:
                # bucket[j * 256 + byte, r] sums the weights of tokens whose byte j is `byte`; expanded at the end.
                bucket = np.zeros((d4 * 256, rp), np.float32)
                n_groups = d // v_group
                gbytes = v_group // 4
                lo_acc = np.zeros((n_groups, rp), np.float32)
                vct, vst, vlt = vc[b, h], vs[b, h], vl[b, h]
                for rc in range(n_chunks):
                    r0 = rc * LANES
                    for t in range(n):
                        norm = vn[b, t] if has_vn else np.float32(1.0)
                        p0, p1, p2, p3 = scores[t, r0], scores[t, r0 + 1], scores[t, r0 + 2], scores[t, r0 + 3]
                        for gi in range(n_groups):
                            sc = vst[t, gi] * norm
                            off = vlt[t, gi] * norm
                            lo_acc[gi, r0] += p0 * off
                            lo_acc[gi, r0 + 1] += p1 * off
                            lo_acc[gi, r0 + 2] += p2 * off
                            lo_acc[gi, r0 + 3] += p3 * off
                            w0, w1, w2, w3 = p0 * sc, p1 * sc, p2 * sc, p3 * sc
                            for j in range(gi * gbytes, (gi + 1) * gbytes):
                                row = j * 256 + vct[t, j]
                                bucket[row, r0] += w0
                                bucket[row, r0 + 1] += w1
                                bucket[row, r0 + 2] += w2
                                bucket[row, r0 + 3] += w3
                for j in range(d4):
                    for byte in range(256):
                        for r in range(rp):
                            w = bucket[j * 256 + byte, r]
                            for i in range(4):
                                acc_v[r, 4 * j + i] += w * _code(byte, i)
                for r in range(rp):
                    for c in range(d):
                        acc_v[r, c] += lo_acc[c // v_group, r]
            else:
                for t in range(n):
                    row = t // v_group
                    norm = vn[b, t] if has_vn else np.float32(1.0)
                    for j in range(d4):
                        byte = vc[b, h, t, j]
                        for i in range(4):
                            c = 4 * j + i
                            x[c] = (_code(byte, i) * vs[b, h, row, c] + vl[b, h, row, c]) * norm
                    for r in range(rp):
                        w = scores[t, r]
                        for c in range(d):
                            acc_v[r, c] += w * x[c]
            for r in range(rp):
                if row_sum[r] > 0.0:
                    inv = np.float32(1.0) / row_sum[r]
                    for c in range(d):
                        out[b, h, r, c] = acc_v[r, c] * inv
                    lse[b, h, r] = row_max[r] + np.float32(math.log(row_sum[r]))
                else:
                    for c in range(d):
                        out[b, h, r, c] = 0.0
                    lse[b, h, r] = neg_inf


def _body_arrays(body, batch: int):
    """(codes [B, H, cap, D/4] uint8, scale, lo as fp32 [B, H, rows, X], norm fp32 [B, n] or [B, 0]) as numpy."""
    n = body.tokens
    codes = body.codes if body.codes.is_contiguous() else body.codes.contiguous()
    rows = body.rows_for(n)
    scale = body.scale[:, :, :rows].float().contiguous()
    lo = body.lo[:, :, :rows].float().contiguous()
    norm = body.norm[:, :n].float().contiguous() if body.norm is not None else torch.zeros(batch, 0)
    return codes.numpy(), scale.numpy(), lo.numpy(), norm.numpy()


def body_attention(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None):
    """Numba body partial over :class:`~hf_kvint2.stream.QuantizedBody` tokens: ``(out_rot [B, Hq, Lq, D] fp32,
    lse [B, Hq, Lq] fp32)``, see the module docstring."""
    if not _NUMBA:
        raise ImportError("The Numba CPU kernel needs numba: pip install 'numba>=0.59' (the clone's '.[cpu]' extra).")
    b, hq, lq, d = q_rot.shape
    n = key_body.tokens
    hkv = key_body.codes.shape[1]
    rows = (hq // hkv) * lq
    padded = -(-rows // LANES) * LANES
    q = torch.zeros(b, hkv, padded, d)
    q[:, :, :rows] = (q_rot.detach().float() * scaling).reshape(b, hkv, rows, d)
    bias = torch.zeros(b, hkv, padded)
    if key_mean_logits is not None:
        bias[:, :, :rows] = (scaling * key_mean_logits.detach().float()).reshape(b, hkv, rows)
    add = mask_to_additive(mask.detach() if mask is not None else None)
    if add is None:
        add = torch.zeros(b, 0, 1)
    else:
        if add.dim() != 4 or add.shape[1] != 1:
            raise ValueError(f"The body mask must broadcast to [batch, 1, query_len, tokens], got {tuple(add.shape)}.")
        add = add.expand(b, 1, add.shape[2], n).reshape(b, -1, n).contiguous()
    kc, ks, kl, kn = _body_arrays(key_body, b)
    vc, vs, vl, vn = _body_arrays(value_body, b)
    out = torch.empty(b, hkv, padded, d)
    lse = torch.empty(b, hkv, padded)
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS)))
    _body_attention_kernel(q.numpy(), bias.numpy(), add.numpy(), lq, kc, ks, kl, kn,
                           key_body.layout.axis == "token", key_body.group,
                           vc, vs, vl, vn, value_body.layout.axis == "token", value_body.group, n,
                           out.numpy(), lse.numpy())
    torch.set_num_threads(torch_threads)  # both use the OpenMP runtime: keep torch's setting
    return out[:, :, :rows].reshape(b, hq, lq, d), lse[:, :, :rows].reshape(b, hq, lq)
