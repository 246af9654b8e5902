"""Fused transform + INT2 quantize + pack of new tokens (what ``QuantizedStream.append`` stores).

One program owns a tile of tokens of one batch row and loops over the KV heads, so the omni-token norm (over all
heads and channels of a token) needs no second kernel: pass 1 sums squares over heads and stores the norms, pass 2
recomputes the cheap rotation and quantizes (reading the norms back). Per-channel groups span ``group_size``
tokens, so then a tile is exactly one group; it is transformed ``SUB_T`` tokens at a time (about 4096 fp32 values),
once for each channel's min / max and once more for the codes, so that a 128-token group never sits in registers
whole (compiled for sm_80 / sm_90 it spilled; ``benchmarks/triton_aot.py``).

Matching :func:`hf_kvint2.quant.quantize_int2` bit for bit where it matters: the rotation runs in IEEE fp32,
``scale``/``lo`` are rounded to the scale dtype before the codes are chosen, codes round half to even like
``torch.round``, and the row clip uses the same linear-interpolated quantile as ``transforms.row_quantile``
(exact order statistics of the row's ``|x|`` by bisection on their bit patterns).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hf_kvint2.quant import SCALE_DTYPES, QuantizedGroups, range_clip_divisor
from hf_kvint2.transforms import CLIP_FLOOR

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _rotate(x_ptr, sxt, mean_ptr, rot_ptr, tok, tok_ok, cols, col_ok, D: tl.constexpr, BLOCK_T: tl.constexpr,
            BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, HAS_MEAN: tl.constexpr):
    """(x[tok] - mean) @ R for one head: [BLOCK_T, BLOCK_D] fp32, accumulated over CHUNK-wide slices of D."""
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for c0 in range(0, BLOCK_D, CHUNK):  # a loop, not unrolled: at head_dim 256 unrolled compiles took minutes
        kc = c0 + tl.arange(0, CHUNK)
        k_ok = kc < D
        x = tl.load(x_ptr + tok[:, None] * sxt + kc[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + kc, mask=k_ok, other=0.0)[None, :]
            x = tl.where(tok_ok[:, None] & k_ok[None, :], x, 0.0)
        r = tl.load(rot_ptr + kc[:, None] * D + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(x, r, input_precision="ieee")
    return acc


@triton.jit
def _to_scale_dtype(x, SCALE_DTYPE: tl.constexpr):
    """fp32 -> the nearest value of the scale dtype (round half to even), kept in fp32. bf16 is rounded by hand
    because the Triton interpreter truncates fp32 -> bf16 casts (compiled code rounds to nearest even)."""
    if SCALE_DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(SCALE_DTYPE).to(tl.float32)


@triton.jit
def _kth_smallest(a_bits, k, BLOCK_T: tl.constexpr):
    """Per row, the k-th smallest (0-based) of non-negative floats given as int32 bit patterns (their order is the
    float order): bisection on the bit pattern, 31 steps, exact."""
    lo = tl.zeros((BLOCK_T,), dtype=tl.int32)
    hi = tl.full((BLOCK_T,), 0x7F800000, dtype=tl.int32)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        enough = tl.sum((a_bits <= mid[:, None]).to(tl.int32), axis=1) >= k + 1
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    return hi


@triton.jit
def _round_half_even(y):
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))


@triton.jit
def _transformed(x_ptr, sxt, mean_ptr, rot_ptr, tok, tok_ok, cols, col_ok, norm_ptr, clip_frac, clip_floor,
                 D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                 HAS_MEAN: tl.constexpr, TOKEN_SCALING: tl.constexpr, CLIP: tl.constexpr, CLIP_I0: tl.constexpr,
                 CLIP_I1: tl.constexpr):
    """``ROWS`` tokens of one head as they are quantized: centred, rotated, divided by the token norm (read back
    from ``norm_ptr``, where this program stored it in the scale dtype), clipped."""
    xr = _rotate(x_ptr, sxt, mean_ptr, rot_ptr, tok, tok_ok, cols, col_ok, D, ROWS, BLOCK_D, CHUNK, HAS_MEAN)
    if TOKEN_SCALING:
        norm = tl.load(norm_ptr + tok, mask=tok_ok, other=1.0).to(tl.float32)
        norm = tl.where(norm > 0.0, norm, 1.0)  # a zero norm is stored (the row reads back as zeros), divides by 1
        xr = tl.div_rn(xr, norm[:, None])
    if CLIP:
        # The linear-interpolated quantile of |row| (transforms.row_quantile): order statistics CLIP_I0 and
        # CLIP_I1 = CLIP_I0 + 1 (or the same); padded columns count as +inf so they sort last.
        a_bits = tl.where(col_ok[None, :], tl.abs(xr), float("inf")).to(tl.int32, bitcast=True)
        b0 = _kth_smallest(a_bits, CLIP_I0, ROWS)
        if CLIP_I1 == CLIP_I0:
            b1 = b0
        else:  # the next order statistic: b0 again if it repeats, else the smallest value above it
            repeats = tl.sum((a_bits <= b0[:, None]).to(tl.int32), axis=1) >= CLIP_I1 + 1
            b1 = tl.where(repeats, b0, tl.min(tl.where(a_bits > b0[:, None], a_bits, 0x7F800000), axis=1))
        q0 = b0.to(tl.float32, bitcast=True)
        q1 = b1.to(tl.float32, bitcast=True)
        tau = (q0 * (1.0 - clip_frac) + q1 * clip_frac)[:, None]
        # transforms.clip_rows: never below CLIP_FLOOR of the row's largest |x| (no row is erased), nor below the
        # largest minus the second largest (a coordinate that carries the row alone is not clipped away)
        a = tl.where(col_ok[None, :], tl.abs(xr), 0.0)
        row_max = tl.max(a, axis=1)
        tied = tl.sum((a == row_max[:, None]).to(tl.int32), axis=1) > 1
        second = tl.where(tied, row_max, tl.max(tl.where(a < row_max[:, None], a, 0.0), axis=1))
        tau = tl.maximum(tl.maximum(tau, clip_floor * row_max[:, None]), (row_max - second)[:, None])
        xr = tl.minimum(tl.maximum(xr, -tau), tau)
    return xr


@triton.jit
def _store_codes(codes_ptr, sct, xr, lo_c, scale_c, tok, tok_ok, D: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Codes of ``xr`` [ROWS, BLOCK_D] for (lo, scale) broadcast to it, packed four per byte and stored."""
    safe = tl.where(scale_c > 0.0, scale_c, 1.0)
    code = tl.where(scale_c > 0.0, _round_half_even(tl.div_rn(xr - lo_c, safe)), 0.0)
    code = tl.minimum(tl.maximum(code, 0.0), 3.0).to(tl.int32)
    # Pack channel 4j+i into bits 2i of byte j (the order of hf_kvint2.quant.pack_int2).
    quads = tl.reshape(code, (ROWS, BLOCK_D // 4, 4))
    shifts = (tl.arange(0, 4) * 2)[None, None, :]
    packed = tl.sum(quads << shifts, axis=2).to(tl.uint8)
    bcols = tl.arange(0, BLOCK_D // 4)
    tl.store(codes_ptr + tok[:, None] * sct + bcols[None, :], packed,
             mask=tok_ok[:, None] & (bcols < D // 4)[None, :])


# n_tokens is 1 for a decode step's demotion and larger for a prefill (and so are the batch/head strides), H is 1 for
# some models: not specialised on "== 1" / "% 16" (each would be another JIT compile; the kernel gains nothing).
# r_zero is always 0: R's address in the loops without a store (the token norms' pass, the per-channel min/max pass)
# moves by r_zero * (loop index), so that the compiler does not hoist R's loads out of them - hoisted, all of R sat in
# shared memory (64 KiB at head_dim 128; 261 KiB at 256, over sm_90's 227 KiB: it could not launch).
@triton.jit(do_not_specialize=["sxb", "sxh", "scb", "sch", "ssb", "ssh", "snb", "H", "n_tokens", "r_zero"])
def _quantize_pack_kernel(
    x_ptr, sxb, sxh, sxt,
    mean_ptr, rot_ptr,
    codes_ptr, scb, sch, sct,
    scale_ptr, lo_ptr, ssb, ssh, sst,
    norm_ptr, snb,
    H, n_tokens, clip_frac, clip_floor, range_divisor, r_zero,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, SUB_T: tl.constexpr, CHUNK: tl.constexpr,
    AXIS_CHANNEL: tl.constexpr, GROUP: tl.constexpr, HAS_MEAN: tl.constexpr, TOKEN_SCALING: tl.constexpr,
    CLIP: tl.constexpr, CLIP_I0: tl.constexpr, CLIP_I1: tl.constexpr, SCALE_DTYPE: tl.constexpr,
    RANGE_CLIP: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    if AXIS_CHANNEL:  # one tile = one group of GROUP tokens
        tok = tile * GROUP + rows
        tok_ok = (rows < GROUP) & (tok < n_tokens)
    else:
        tok = tile * BLOCK_T + rows
        tok_ok = tok < n_tokens
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D

    norm_b = norm_ptr + b * snb
    if TOKEN_SCALING:
        # The omni-token norms, SUB_T tokens at a time: sum of squares over heads in fp64 like
        # QuantizedStream.transform (which must agree with its tensor-parallel form), stored in the scale dtype;
        # the passes below read them back.
        for s0 in range(0, BLOCK_T, SUB_T):
            sub = s0 + tl.arange(0, SUB_T)
            if AXIS_CHANNEL:
                tok_s = tile * GROUP + sub
                ok_s = (sub < GROUP) & (tok_s < n_tokens)
            else:
                tok_s = tile * BLOCK_T + sub
                ok_s = tok_s < n_tokens
            sumsq = tl.zeros((SUB_T,), dtype=tl.float64)
            for h in range(H):
                xr = _rotate(x_ptr + b * sxb + h * sxh, sxt, mean_ptr + h * D, rot_ptr + h * r_zero, tok_s, ok_s,
                             cols, col_ok, D, SUB_T, BLOCK_D, CHUNK, HAS_MEAN).to(tl.float64)
                sumsq += tl.sum(xr * xr, axis=1)
            norm = _to_scale_dtype(tl.sqrt(sumsq).to(tl.float32), SCALE_DTYPE)
            tl.store(norm_b + tok_s, norm.to(SCALE_DTYPE), mask=ok_s)
        tl.debug_barrier()  # the norms are read back by other threads of the program

    for h in range(H):
        x_h = x_ptr + b * sxb + h * sxh
        codes_h = codes_ptr + b * scb + h * sch
        if AXIS_CHANNEL:
            # One (lo, scale) per channel over the group's tokens, taken SUB_T tokens at a time (a whole 128-token
            # group in registers spilled), then the codes of the same sub-tiles, transformed again.
            lo = tl.full((BLOCK_D,), float("inf"), dtype=tl.float32)
            hi = tl.full((BLOCK_D,), float("-inf"), dtype=tl.float32)
            group_end = tl.minimum(n_tokens - tile * GROUP, GROUP)
            for s0 in range(0, group_end, SUB_T):
                sub = s0 + tl.arange(0, SUB_T)
                tok_s = tile * GROUP + sub
                ok_s = (sub < GROUP) & (tok_s < n_tokens)
                xr = _transformed(x_h, sxt, mean_ptr + h * D, rot_ptr + (h + s0) * r_zero, tok_s, ok_s, cols,
                                  col_ok, norm_b, clip_frac, clip_floor, D, SUB_T, BLOCK_D, CHUNK, HAS_MEAN,
                                  TOKEN_SCALING, CLIP, CLIP_I0, CLIP_I1)
                valid = ok_s[:, None] & col_ok[None, :]
                lo = tl.minimum(lo, tl.min(tl.where(valid, xr, float("inf")), axis=0))
                hi = tl.maximum(hi, tl.max(tl.where(valid, xr, float("-inf")), axis=0))
            if RANGE_CLIP:  # quant.quantize_int2's narrowed range: each end moves in by width / range_divisor
                shrink = tl.div_rn(hi - lo, range_divisor)
                lo = lo + shrink
                hi = hi - shrink
            lo_s = _to_scale_dtype(lo, SCALE_DTYPE)
            scale_s = _to_scale_dtype(tl.div_rn(hi - lo, 3.0), SCALE_DTYPE)
            soff = b * ssb + h * ssh + tile * sst + cols
            tl.store(scale_ptr + soff, scale_s.to(SCALE_DTYPE), mask=col_ok)
            tl.store(lo_ptr + soff, lo_s.to(SCALE_DTYPE), mask=col_ok)
            for s0 in range(0, group_end, SUB_T):
                sub = s0 + tl.arange(0, SUB_T)
                tok_s = tile * GROUP + sub
                ok_s = (sub < GROUP) & (tok_s < n_tokens)
                xr = _transformed(x_h, sxt, mean_ptr + h * D, rot_ptr, tok_s, ok_s, cols, col_ok, norm_b, clip_frac,
                                  clip_floor, D, SUB_T, BLOCK_D, CHUNK, HAS_MEAN, TOKEN_SCALING, CLIP, CLIP_I0,
                                  CLIP_I1)
                _store_codes(codes_h, sct, xr, lo_s[None, :], scale_s[None, :], tok_s, ok_s, D, SUB_T, BLOCK_D)
        else:
            xr = _transformed(x_h, sxt, mean_ptr + h * D, rot_ptr, tok, tok_ok, cols, col_ok, norm_b, clip_frac,
                              clip_floor, D, BLOCK_T, BLOCK_D, CHUNK, HAS_MEAN, TOKEN_SCALING, CLIP, CLIP_I0, CLIP_I1)
            lo_c = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            scale_c = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for g in tl.static_range(D // GROUP):
                in_g = (cols >= g * GROUP) & (cols < (g + 1) * GROUP)
                lo = tl.min(tl.where(in_g[None, :], xr, float("inf")), axis=1)
                hi = tl.max(tl.where(in_g[None, :], xr, float("-inf")), axis=1)
                lo_s = _to_scale_dtype(lo, SCALE_DTYPE)
                scale_s = _to_scale_dtype(tl.div_rn(hi - lo, 3.0), SCALE_DTYPE)
                soff = b * ssb + h * ssh + tok * sst + g
                tl.store(scale_ptr + soff, scale_s.to(SCALE_DTYPE), mask=tok_ok)
                tl.store(lo_ptr + soff, lo_s.to(SCALE_DTYPE), mask=tok_ok)
                lo_c = tl.where(in_g[None, :], lo_s[:, None], lo_c)
                scale_c = tl.where(in_g[None, :], scale_s[:, None], scale_c)
            _store_codes(codes_h, sct, xr, lo_c, scale_c, tok, tok_ok, D, BLOCK_T, BLOCK_D)


def quantize_tokens(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None, *, axis: str,
                    group_size: int, clip: float | None, token_scaling: bool, scale_dtype: torch.dtype,
                    range_clip: float | None = None):
    """See :func:`hf_kvint2.kernels.quantize_tokens`."""
    if x.dim() != 4:
        raise ValueError(f"quantize_tokens expects x of shape [batch, kv_heads, tokens, head_dim], got {tuple(x.shape)}.")
    b, h, n, d = x.shape
    if d % 4:
        raise ValueError(f"head_dim ({d}) must be a multiple of 4 to pack four INT2 codes per byte.")
    if axis not in ("token", "channel"):
        raise ValueError(f"Unknown group axis {axis!r}; use 'token' or 'channel'.")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}.")
    divisor = range_clip_divisor(range_clip)
    if divisor is not None and axis != "channel":
        raise ValueError("range_clip applies to 'channel' groups only (per-token groups clip rows instead).")
    extent = d if axis == "token" else n
    if group_size <= 0 or extent % group_size:
        what = "head_dim" if axis == "token" else "token count"
        raise ValueError(f"The {what} ({extent}) is not a multiple of the group size ({group_size}) for '{axis}' groups.")
    if tuple(rotation.shape) != (d, d):
        raise ValueError(f"rotation must be [{d}, {d}] for head_dim {d}, got {tuple(rotation.shape)}.")
    if mean is not None and tuple(mean.shape) != (h, d):
        raise ValueError(f"mean must be [kv_heads={h}, head_dim={d}], got {tuple(mean.shape)}.")

    x = x if x.stride(-1) == 1 else x.contiguous()
    rot = rotation.to(device=x.device, dtype=torch.float32).contiguous()
    mean_t = rot if mean is None else mean.to(device=x.device, dtype=torch.float32).contiguous()
    codes = torch.empty(b, h, n, d // 4, dtype=torch.uint8, device=x.device)
    srows, scols = (n, d // group_size) if axis == "token" else (n // group_size, d)
    scale = torch.empty(b, h, srows, scols, dtype=scale_dtype, device=x.device)
    lo = torch.empty_like(scale)
    norm = torch.empty(b, n, dtype=scale_dtype, device=x.device) if token_scaling else None
    if n == 0:
        return QuantizedGroups(codes, scale, lo), norm

    block_d = max(16, triton.next_power_of_2(d))
    clip_on = clip is not None and clip < 1.0
    pos = clip * (d - 1) if clip_on else 0.0
    i0 = math.floor(pos)
    launch = {}
    if axis == "channel":
        block_t, tiles = max(16, triton.next_power_of_2(group_size)), n // group_size
        # A tile is a whole token group, transformed SUB_T tokens at a time: [SUB_T, head_dim] fp32 of about 4096
        # values (32 tokens at head_dim 128). Whole 128-token groups at head_dim 128 spilled 1.5-1.9 KiB on sm_90
        # (255 registers, 8 warps) and 21 KiB on sm_80; groups of 32 with 8 warps fit (benchmarks/triton_aot.py).
        # No pipelining over heads (with 3 stages a 128-token tile needed 210 KiB of shared memory at head_dim 128).
        sub_t = min(block_t, max(16, 4096 // block_d))
        launch = {"num_stages": 1, "num_warps": max(4, min(16, sub_t * block_d // 512))}
    else:
        block_t = sub_t = 16
        tiles = triton.cdiv(n, block_t)
        # 8 warps at head_dim 256: with 4 the clipped layouts spilled 32 B on sm_90 (254 registers), with 8 they
        # take 107 and do not; 4 up to head_dim 128.
        launch = {"num_warps": max(4, min(16, block_t * block_d // 512))}
    _quantize_pack_kernel[(b, tiles)](
        x, x.stride(0), x.stride(1), x.stride(2),
        mean_t, rot,
        codes, codes.stride(0), codes.stride(1), codes.stride(2),
        scale, lo, scale.stride(0), scale.stride(1), scale.stride(2),
        norm if norm is not None else scale, norm.stride(0) if norm is not None else 0,
        h, n, pos - i0, CLIP_FLOOR, 1.0 if divisor is None else divisor, 0,
        D=d, BLOCK_D=block_d, BLOCK_T=block_t, SUB_T=sub_t, CHUNK=min(32, block_d),
        AXIS_CHANNEL=axis == "channel", GROUP=group_size, HAS_MEAN=mean is not None, TOKEN_SCALING=token_scaling,
        CLIP=clip_on, CLIP_I0=i0, CLIP_I1=min(i0 + 1, d - 1), SCALE_DTYPE=_TL_DTYPE[scale_dtype],
        RANGE_CLIP=divisor is not None, **launch,
    )
    if scale_dtype is torch.float16 and not (torch.isfinite(scale).all() and torch.isfinite(lo).all()):
        raise ValueError("Transformed K/V values do not fit fp16 scales; pass scale_dtype=torch.bfloat16 or "
                         "torch.float32 to the cache.")
    return QuantizedGroups(codes, scale, lo), norm
