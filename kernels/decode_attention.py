"""Split-K decode attention over a layer's packed INT2 body, and a whole-layer decode step around it.

Grid: (batch x KV head, query-row block, token split). A program takes the rows of one KV head - all its query
heads times the query positions (GQA by index: each code byte is read once for all of them) - and one contiguous
range of body tokens. It dequantizes tiles of ``BLOCK_N`` tokens in registers, ``k = (code * scale + lo) * norm``,
for any layout (per-token groups of channels, per-channel groups of tokens, optional token norms), and runs an
online softmax. Each byte holds channels ``4j .. 4j+3``; the kernel keeps four column-interleaved sub-tiles
(channel ``4j + i`` for i = 0..3), so unpacking needs no reshuffle: ``q.k = sum_i q[:, 4j+i] . k_i``. Splits write
``(out, lse)``; a second kernel merges them by log-sum-exp.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hf_kvint2.read_path import BodyBackend, attend_segments, step_mask

# Launch settings of the decode kernel (benchmarks/bench_gpu.py sweeps them): tokens per tile ("block_n" for 16-bit
# dots up to head_dim 128, "block_n_small" at larger head_dims and for IEEE fp32 dots), warps per program, and how
# many programs per SM the split-K grid aims at. Compiled for sm_80/sm_90 (benchmarks/triton_aot.py): at head_dim
# 256 tiles of 64 tokens spilled 4-292 B per thread (255 registers), of 32 still 20 B in one layout on sm_90, of 16
# none (128-132 registers). IEEE fp32 dots (FMA loops, no tensor cores) at 64 tokens spilled 0.1-10 KiB at head_dim
# 128 and took minutes to compile; at 16 they take 168 registers and spill nothing.
TUNING = {"block_n": 64, "block_n_small": 16, "num_warps": 4, "programs_per_sm": 4}
# Dot operands: IEEE fp32 for fp32 queries; the model's 16-bit dtype otherwise (as flash attention does).
_TL_DOT_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _dequant_subtile(bytes_tile, sub: tl.constexpr, scale_ptr, lo_ptr, sst, norm_ptr, tok, tok_ok, j, j_ok,
                     CHANNEL: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Channels 4j+sub of a [BLOCK_N, BLOCK_D4] byte tile, dequantized to fp32 (zero where out of range)."""
    code = ((bytes_tile >> (2 * sub)) & 3).to(tl.float32)
    ok = tok_ok[:, None] & j_ok[None, :]
    ch = 4 * j + sub
    if CHANNEL:  # one scale per channel per GROUP tokens: [T // GROUP, D]
        off = (tok // GROUP)[:, None] * sst + ch[None, :]
    else:  # D // GROUP groups per token: [T, D // GROUP] (one group per token takes the factored path instead)
        off = tok[:, None] * sst + (ch // GROUP)[None, :]
    x = code * tl.load(scale_ptr + off, mask=ok, other=0.0).to(tl.float32) + \
        tl.load(lo_ptr + off, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        x = x * tl.load(norm_ptr + tok, mask=tok_ok, other=0.0).to(tl.float32)[:, None]
    return tl.where(ok, x, 0.0)


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b with fp32 accumulation: IEEE fp32 for fp32 models, else in the model's 16-bit dtype (tensor cores)."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), out_dtype=tl.float32)


@triton.jit
def _codes(bytes_tile, sub: tl.constexpr, DTYPE: tl.constexpr):
    """Channels 4j+sub of a byte tile as codes 0..3 in the dot operand dtype (exact in any float dtype)."""
    return ((bytes_tile >> (2 * sub)) & 3).to(DTYPE)


@triton.jit
def _token_scale_lo(s_ptr, l_ptr, st, n_ptr, tok, tok_ok, HAS_NORM: tl.constexpr):
    """Per-token (scale, lo) of a one-group-per-token layout, with the token norm folded in."""
    sc = tl.load(s_ptr + tok * st, mask=tok_ok, other=0.0).to(tl.float32)
    lo = tl.load(l_ptr + tok * st, mask=tok_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        nrm = tl.load(n_ptr + tok, mask=tok_ok, other=0.0).to(tl.float32)
        sc *= nrm
        lo *= nrm
    return sc, lo


@triton.jit
def _key_scores(q0, q1, q2, q3, q_sum, kb, ks_ptr, kl_ptr, kst, kn_ptr, tok, tok_ok, j, j_ok,
                CHANNEL: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    """q . k for a tile of tokens: [BLOCK_M, BLOCK_N]."""
    if not CHANNEL and GROUP >= D:
        # One (scale, lo) per token: q.k = scale * (q . code) + lo * sum(q); the codes enter the product as they are.
        qk = _mm(q0, tl.trans(_codes(kb, 0, DOT_DTYPE)), DOT_DTYPE)
        qk += _mm(q1, tl.trans(_codes(kb, 1, DOT_DTYPE)), DOT_DTYPE)
        qk += _mm(q2, tl.trans(_codes(kb, 2, DOT_DTYPE)), DOT_DTYPE)
        qk += _mm(q3, tl.trans(_codes(kb, 3, DOT_DTYPE)), DOT_DTYPE)
        sc, lo = _token_scale_lo(ks_ptr, kl_ptr, kst, kn_ptr, tok, tok_ok, HAS_NORM)
        return qk * sc[None, :] + q_sum[:, None] * lo[None, :]
    else:
        qk = _mm(q0, tl.trans(_dequant_subtile(kb, 0, ks_ptr, kl_ptr, kst, kn_ptr, tok, tok_ok, j, j_ok,
                                               CHANNEL, GROUP, D, HAS_NORM)), DOT_DTYPE)
        qk += _mm(q1, tl.trans(_dequant_subtile(kb, 1, ks_ptr, kl_ptr, kst, kn_ptr, tok, tok_ok, j, j_ok,
                                                CHANNEL, GROUP, D, HAS_NORM)), DOT_DTYPE)
        qk += _mm(q2, tl.trans(_dequant_subtile(kb, 2, ks_ptr, kl_ptr, kst, kn_ptr, tok, tok_ok, j, j_ok,
                                                CHANNEL, GROUP, D, HAS_NORM)), DOT_DTYPE)
        qk += _mm(q3, tl.trans(_dequant_subtile(kb, 3, ks_ptr, kl_ptr, kst, kn_ptr, tok, tok_ok, j, j_ok,
                                                CHANNEL, GROUP, D, HAS_NORM)), DOT_DTYPE)
        return qk


@triton.jit
def _value_sums(p, vb, sub: tl.constexpr, vs_ptr, vl_ptr, vst, vn_ptr, tok, tok_ok, j, j_ok,
                CHANNEL: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    """p @ v for channels 4j+sub: [BLOCK_M, BLOCK_D4]."""
    if not CHANNEL and GROUP >= D:
        # One (scale, lo) per token: p @ v = (p * scale) @ code + sum_t p * lo.
        sc, lo = _token_scale_lo(vs_ptr, vl_ptr, vst, vn_ptr, tok, tok_ok, HAS_NORM)
        return _mm(p * sc[None, :], _codes(vb, sub, DOT_DTYPE), DOT_DTYPE) + tl.sum(p * lo[None, :], axis=1)[:, None]
    else:
        return _mm(p, _dequant_subtile(vb, sub, vs_ptr, vl_ptr, vst, vn_ptr, tok, tok_ok, j, j_ok, CHANNEL, GROUP, D,
                                       HAS_NORM), DOT_DTYPE)


# Integer arguments that vary from step to step (n_tokens) or with the model/batch (Lq, n_rep, num_splits) are not
# specialised on "== 1" / "% 16": each value class would be another JIT compile (seconds, on a GPU mid-decode).
@triton.jit(do_not_specialize=["Lq", "n_rep", "n_tokens", "num_splits"])
def _body_attention_kernel(
    q_ptr, sqb, sqh, sql, qmu_ptr,
    kc_ptr, kcb, kch, kct, ks_ptr, kl_ptr, ksb, ksh, kst, kn_ptr, knb,
    vc_ptr, vcb, vch, vct, vs_ptr, vl_ptr, vsb, vsh, vst, vn_ptr, vnb,
    mask_ptr, mkb, mkl, mkt,
    out_ptr, lse_ptr,
    Hkv, Lq, n_rep, n_tokens, tokens_per_split, num_splits, scaling,
    D: tl.constexpr, BLOCK_D4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_CHANNEL: tl.constexpr, K_GROUP: tl.constexpr, K_NORM: tl.constexpr,
    V_CHANNEL: tl.constexpr, V_GROUP: tl.constexpr, V_NORM: tl.constexpr,
    HAS_QMU: tl.constexpr, MASK_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // Hkv
    h = bh % Hkv
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rep * Lq
    hq = h * n_rep + rows // Lq
    pos = rows % Lq
    split = tl.program_id(2)
    t_begin = split * tokens_per_split
    t_end = tl.minimum(t_begin + tokens_per_split, n_tokens)

    j = tl.arange(0, BLOCK_D4)
    j_ok = j < D // 4
    q_rows = q_ptr + b * sqb + hq * sqh + pos * sql
    q_ok = row_ok[:, None] & j_ok[None, :]
    q0 = tl.load(q_rows[:, None] + (4 * j)[None, :], mask=q_ok, other=0.0)
    q1 = tl.load(q_rows[:, None] + (4 * j + 1)[None, :], mask=q_ok, other=0.0)
    q2 = tl.load(q_rows[:, None] + (4 * j + 2)[None, :], mask=q_ok, other=0.0)
    q3 = tl.load(q_rows[:, None] + (4 * j + 3)[None, :], mask=q_ok, other=0.0)
    q_sum = tl.sum(q0, axis=1) + tl.sum(q1, axis=1) + tl.sum(q2, axis=1) + tl.sum(q3, axis=1)
    q0, q1, q2, q3 = q0.to(DOT_DTYPE), q1.to(DOT_DTYPE), q2.to(DOT_DTYPE), q3.to(DOT_DTYPE)
    if HAS_QMU:
        qmu = tl.load(qmu_ptr + (b * Hkv * n_rep + hq) * Lq + pos, mask=row_ok, other=0.0)

    kc_ptr += b * kcb + h * kch
    ks_ptr += b * ksb + h * ksh
    kl_ptr += b * ksb + h * ksh
    kn_ptr += b * knb
    vc_ptr += b * vcb + h * vch
    vs_ptr += b * vsb + h * vsh
    vl_ptr += b * vsb + h * vsh
    vn_ptr += b * vnb

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc0 = tl.zeros((BLOCK_M, BLOCK_D4), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_D4), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_D4), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_D4), dtype=tl.float32)
    for start in range(t_begin, t_end, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_ok = tok < t_end
        ok = tok_ok[:, None] & j_ok[None, :]
        kb = tl.load(kc_ptr + tok[:, None] * kct + j[None, :], mask=ok, other=0)
        qk = _key_scores(q0, q1, q2, q3, q_sum, kb, ks_ptr, kl_ptr, kst, kn_ptr, tok, tok_ok, j, j_ok,
                         K_CHANNEL, K_GROUP, D, K_NORM, DOT_DTYPE)
        if HAS_QMU:
            qk += qmu[:, None]
        s = qk * scaling
        if MASK_KIND == 1:  # bool, True attends
            keep = tl.load(mask_ptr + b * mkb + pos[:, None] * mkl + tok[None, :] * mkt,
                           mask=row_ok[:, None] & tok_ok[None, :], other=0)
            s = tl.where(keep != 0, s, float("-inf"))
        elif MASK_KIND == 2:  # additive
            s += tl.load(mask_ptr + b * mkb + pos[:, None] * mkl + tok[None, :] * mkt,
                         mask=row_ok[:, None] & tok_ok[None, :], other=0.0).to(tl.float32)
        s = tl.where(tok_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that attends nothing yet stays at 0
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        vb = tl.load(vc_ptr + tok[:, None] * vct + j[None, :], mask=ok, other=0)
        acc0 = acc0 * alpha[:, None] + _value_sums(p, vb, 0, vs_ptr, vl_ptr, vst, vn_ptr, tok, tok_ok, j, j_ok,
                                                   V_CHANNEL, V_GROUP, D, V_NORM, DOT_DTYPE)
        acc1 = acc1 * alpha[:, None] + _value_sums(p, vb, 1, vs_ptr, vl_ptr, vst, vn_ptr, tok, tok_ok, j, j_ok,
                                                   V_CHANNEL, V_GROUP, D, V_NORM, DOT_DTYPE)
        acc2 = acc2 * alpha[:, None] + _value_sums(p, vb, 2, vs_ptr, vl_ptr, vst, vn_ptr, tok, tok_ok, j, j_ok,
                                                   V_CHANNEL, V_GROUP, D, V_NORM, DOT_DTYPE)
        acc3 = acc3 * alpha[:, None] + _value_sums(p, vb, 3, vs_ptr, vl_ptr, vst, vn_ptr, tok, tok_ok, j, j_ok,
                                                   V_CHANNEL, V_GROUP, D, V_NORM, DOT_DTYPE)

    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    row_base = ((b * Hkv * n_rep + hq) * Lq + pos) * num_splits + split
    tl.store(lse_ptr + row_base, lse, mask=row_ok)
    out_rows = out_ptr + row_base[:, None] * D + 4 * j[None, :]
    tl.store(out_rows, acc0 * inv[:, None], mask=q_ok)
    tl.store(out_rows + 1, acc1 * inv[:, None], mask=q_ok)
    tl.store(out_rows + 2, acc2 * inv[:, None], mask=q_ok)
    tl.store(out_rows + 3, acc3 * inv[:, None], mask=q_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(out_ptr, lse_ptr, merged_ptr, merged_lse_ptr, num_splits,
                         D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One query row: combine its splits' (out, lse) by log-sum-exp, CHUNK_S splits at a time."""
    row = tl.program_id(0)
    sp = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + row * num_splits + sp, mask=sp < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - m_ref), axis=0)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        sc = s0 + tl.arange(0, CHUNK_S)
        sc_ok = sc < num_splits
        w = tl.exp(tl.load(lse_ptr + row * num_splits + sc, mask=sc_ok, other=float("-inf")) - m_ref)
        parts = tl.load(out_ptr + (row * num_splits + sc)[:, None] * D + cols[None, :],
                        mask=sc_ok[:, None] & (cols < D)[None, :], other=0.0)
        acc += tl.sum(parts * w[:, None], axis=0)
    has = total > 0.0
    tl.store(merged_ptr + row * D + cols, acc / tl.where(has, total, 1.0), mask=cols < D)
    tl.store(merged_lse_ptr + row, tl.where(has, m_ref + tl.log(tl.where(has, total, 1.0)), float("-inf")))


def _body_tensors(body):
    """(codes, scale, lo, norm) of a QuantizedBody with a unit last stride."""
    def unit(t):
        return t if t is None or t.stride(-1) == 1 else t.contiguous()
    return unit(body.codes), unit(body.scale), unit(body.lo), unit(body.norm)


def _num_warps(head_dim: int, key_body) -> int:
    """Warps per program. OScaR's per-channel keys (groups shorter than the head) at head_dim <= 64 take 8: compiled
    for sm_90 with 4 they spilled (128 registers, 16 B of stack), with 8 they fit in 135. Not the other layouts:
    with 8 warps the per-token and calibration's per-channel layouts spilled 16-32 B on sm_90, with 4 they do not.
    Per-token keys with token norms at head_dim 128 (bf16, centred) sat at 128 registers with 4 warps and spilled
    4 B on sm_90 in one build; with 8 they take 127 and do not (benchmarks/triton_aot.py,
    benchmarks/results/triton_aot.json)."""
    small_channel_groups = key_body.layout.axis == "channel" and key_body.group < head_dim
    token_norm_per_token = key_body.layout.axis == "token" and key_body.layout.token_scaling
    if (head_dim <= 64 and small_channel_groups) or (head_dim == 128 and token_norm_per_token):
        return max(8, TUNING["num_warps"])
    return TUNING["num_warps"]


def _interpreting() -> bool:
    """Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, the CPU test setting)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def body_attention(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None, num_splits=None,
                   dot_dtype=None, block_n=None):
    """See :func:`hf_kvint2.kernels.body_attention`."""
    if q_rot.dim() != 4:
        raise ValueError(f"q_rot must be [batch, q_heads, q_len, head_dim], got {tuple(q_rot.shape)}.")
    b, hq, lq, d = q_rot.shape
    n, held = key_body.tokens, key_body.codes.shape[2]
    if not 0 <= n <= held:
        raise ValueError(f"tokens={n} is outside the body's {held} stored tokens.")
    out = torch.zeros(b, hq, lq, d, dtype=torch.float32, device=q_rot.device)
    lse = torch.full((b, hq, lq), float("-inf"), dtype=torch.float32, device=q_rot.device)
    if n == 0:
        return out, lse
    kc, ks, kl, kn = _body_tensors(key_body)
    vc, vs, vl, vn = _body_tensors(value_body)
    hkv = kc.shape[1]
    if kc.shape[0] != b or kc.shape[-1] * 4 != d or hq % hkv:
        raise ValueError(f"Queries {tuple(q_rot.shape)} do not fit the body's codes {tuple(kc.shape)} (batch, "
                         "head_dim, and q_heads a multiple of kv_heads must match).")
    n_rep = hq // hkv
    q = q_rot.float()
    q = q if q.stride(-1) == 1 else q.contiguous()
    qmu = None
    if key_mean_logits is not None:
        qmu = key_mean_logits.float().expand(b, hq, lq).contiguous()
    mask_kind, mk = 0, None
    if mask is not None:
        mk = mask if mask.dim() == 4 else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mk.shape[1] != 1:
            raise ValueError(f"The body mask must have a head dimension of 1, got {tuple(mask.shape)}.")
        mk = mk[..., :n].expand(b, 1, lq, n)
        mask_kind = 1 if mk.dtype == torch.bool else 2

    requested_dot = q_rot.dtype if dot_dtype is None else dot_dtype  # the tile follows it, also in the interpreter
    block_n = block_n or TUNING["block_n" if d <= 128 and requested_dot != torch.float32 else "block_n_small"]
    block_m = max(16, min(64, triton.next_power_of_2(n_rep * lq)))
    row_blocks = triton.cdiv(n_rep * lq, block_m)
    if num_splits is None:  # enough programs to fill the GPU a few times over, each with at least 4 tiles
        want = triton.cdiv(TUNING["programs_per_sm"] * _sm_count(q.device), b * hkv * row_blocks)
        num_splits = max(1, min(want, triton.cdiv(n, 4 * block_n), 512))
    tokens_per_split = triton.cdiv(triton.cdiv(n, num_splits), block_n) * block_n
    num_splits = triton.cdiv(n, tokens_per_split)
    part = out if num_splits == 1 else torch.empty(b, hq, lq, num_splits, d, dtype=torch.float32, device=q.device)
    part_lse = lse if num_splits == 1 else torch.empty(b, hq, lq, num_splits, dtype=torch.float32, device=q.device)

    k_lay, v_lay = key_body.layout, value_body.layout
    dot_dtype = _TL_DOT_DTYPE[q_rot.dtype if dot_dtype is None else dot_dtype]
    if dot_dtype == tl.bfloat16 and _interpreting():  # the interpreter keeps bf16 as raw uint16: its dots are wrong
        dot_dtype = tl.float32
    dummy = q
    _body_attention_kernel[(b * hkv, row_blocks, num_splits)](
        q, q.stride(0), q.stride(1), q.stride(2), qmu if qmu is not None else dummy,
        kc, kc.stride(0), kc.stride(1), kc.stride(2), ks, kl, ks.stride(0), ks.stride(1), ks.stride(2),
        kn if kn is not None else dummy, kn.stride(0) if kn is not None else 0,
        vc, vc.stride(0), vc.stride(1), vc.stride(2), vs, vl, vs.stride(0), vs.stride(1), vs.stride(2),
        vn if vn is not None else dummy, vn.stride(0) if vn is not None else 0,
        mk if mk is not None else dummy, *(mk.stride(0), mk.stride(2), mk.stride(3)) if mk is not None else (0, 0, 0),
        part, part_lse,
        hkv, lq, n_rep, n, tokens_per_split, num_splits, float(scaling),
        D=d, BLOCK_D4=max(16, triton.next_power_of_2(d // 4)), BLOCK_M=block_m, BLOCK_N=block_n,
        K_CHANNEL=k_lay.axis == "channel", K_GROUP=key_body.group, K_NORM=kn is not None,
        V_CHANNEL=v_lay.axis == "channel", V_GROUP=value_body.group, V_NORM=vn is not None,
        HAS_QMU=qmu is not None, MASK_KIND=mask_kind, DOT_DTYPE=dot_dtype,
        num_warps=_num_warps(d, key_body),
    )
    if num_splits > 1:
        _merge_splits_kernel[(b * hq * lq,)](part, part_lse, out, lse, num_splits, D=d,
                                             BLOCK_S=triton.next_power_of_2(num_splits), CHUNK_S=8,
                                             BLOCK_D=triton.next_power_of_2(d))
    return out, lse


def layer_decode_attention(query, layer, *, scaling, attention_mask=None, num_splits=None, block_n=None):
    """See :func:`hf_kvint2.kernels.layer_decode_attention`: the shared read pipeline with this body kernel."""
    lq = query.shape[2]
    n_sink, n_body, n_recent = layer.sink_k.shape[2], layer.body_len, layer.recent_k.shape[2]
    if n_body and lq > n_recent:
        raise ValueError(f"{lq} query tokens but only {n_recent} keys in the recent window: part of this chunk was "
                         "already quantized, so it cannot be attended at full precision by a decode step. Attend "
                         "fresh chunks with SDPA (prefill) instead.")
    total = n_sink + n_body + n_recent
    mask = step_mask(attention_mask, range(total - lq, total), range(total), query.device)
    return attend_segments(query, [(layer.sink_k, layer.sink_v)], layer.key_body.read(n_body),
                           layer.value_body.read(n_body), [(layer.recent_k, layer.recent_v)], scaling, TRITON_BODY, mask,
                           num_splits=num_splits, dot_dtype=query.dtype, block_n=block_n)


# This kernel as a read-path backend (hf_kvint2.backends registers it through hf_kvint2.kernels.body_attention, which
# imports this module only when called: Triton is optional). The layer step passes the model's dtype itself.
TRITON_BODY = BodyBackend("triton", "cuda", lambda: True, body_attention)
