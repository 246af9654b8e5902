"""The write path's clip + INT2 quantization of per-token groups in one compiled call.

:func:`hf_kvint2.transforms.clip_rows` followed by :func:`hf_kvint2.quant.quantize_int2` (``"token"`` groups): a
decode step demotes a token per layer and stream, where the ~25 small PyTorch ops of that path cost ~0.25 ms a call.
Same IEEE float32 operations in the same order, scales rounded to their dtype in bits as torch rounds them, so codes,
scales and offsets are bit-identical to the PyTorch path (tests/test_quant.py). One compiled function serves every
head_dim, group, clip ratio and 16-bit scale dtype (another for float32 scales): they are run-time arguments.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..quant import QuantizedGroups, scale_range_error
from .jit import NUMBA, require_numba

# The clip quantile is taken from the row's largest |x| kept apart when at most this many (else from the sorted row)
QUANTIZER_TOP_MAX = 16
_SCALE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


def quantizer_serves_layout(layout) -> bool:
    """Whether the compiled quantizer (:class:`TokenGroupQuantizer`) can write this layout: per-token groups without
    omni-token scaling, with Numba installed."""
    return NUMBA and layout.axis == "token" and not layout.token_scaling


def quantizer_supports(layout, x: torch.Tensor) -> bool:
    """Whether :func:`quantize_token_groups` serves this layout and input (:func:`quantizer_serves_layout`, CPU,
    eager)."""
    return quantizer_serves_layout(layout) and x.device.type == "cpu" and not torch.compiler.is_compiling()


if NUMBA:
    from .bits import float32_bits, float32_from_bits
    from .jit import njit

    @njit
    def _signed16(h):
        bits = np.int32(h)
        return np.int32(bits - 65536 if bits >= 32768 else bits)

    @njit
    def _half_bits(x):
        # float32 -> float16 bits, round to nearest, ties to even (as torch's .to()); inf past 65504, NaN kept
        u = float32_bits(x)
        sign = (u >> np.uint32(16)) & np.uint32(0x8000)
        a = u & np.uint32(0x7FFFFFFF)
        if a > np.uint32(0x7F800000):  # NaN
            return np.uint32(0x7E00) | sign
        if a >= np.uint32(0x477FF000):  # rounds past 65504: inf
            return np.uint32(0x7C00) | sign
        if a >= np.uint32(0x38800000):  # normal half
            return ((a - np.uint32(0x38000000) + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1)))
                    >> np.uint32(13)) | sign
        # subnormal half (or zero): m * 2^-24
        shift = 126 - np.int64(a >> np.uint32(23))
        if shift > 24:
            return sign
        mant = np.uint32((a & np.uint32(0x7FFFFF)) | np.uint32(0x800000))
        q = mant >> np.uint32(shift)
        rem = mant & ((np.uint32(1) << np.uint32(shift)) - np.uint32(1))
        half = np.uint32(1) << np.uint32(shift - 1)
        if rem > half or (rem == half and (q & np.uint32(1)) == np.uint32(1)):
            q += np.uint32(1)
        return q | sign

    @njit
    def _half_value(h):
        # float16 bits -> float32 value (exact)
        he = (h >> np.uint32(10)) & np.uint32(0x1F)
        hm = h & np.uint32(0x3FF)
        if he == np.uint32(0):
            val = np.float32(hm) * np.float32(5.960464477539063e-08)  # exact: m * 2^-24
        elif he == np.uint32(0x1F):
            val = np.float32(np.inf) if hm == np.uint32(0) else np.float32(np.nan)
        else:
            val = float32_from_bits(((he + np.uint32(112)) << np.uint32(23)) | (hm << np.uint32(13)))
        return -val if (h >> np.uint32(15)) & np.uint32(1) else val

    @njit
    def round_to_scale(x, kind):
        """x rounded to the scale dtype (``kind``: float16 0, bfloat16 1, float32 2) as torch's ``.to()`` rounds:
        (its stored int16 bits, its value as float32); float32: (0, x)."""
        if kind == 2:
            return np.int32(0), x
        if kind == 1:  # bfloat16
            u = float32_bits(x)
            h = np.uint32(0x7FC0) if np.isnan(x) else \
                (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            return _signed16(h), float32_from_bits(h << np.uint32(16))
        h = _half_bits(x)
        return _signed16(h), _half_value(h)

    @njit
    def clip_threshold(xt, i0, i1, w0, w1, top, largest, a):
        """:func:`~hf_kvint2.transforms.clip_rows`' threshold of one row: the clip quantile of |x| (order statistics
        i0, i1 weighted w0, w1), at least half the row's max and at least its max minus its second largest |x| (a
        coordinate that carries the row alone is no outlier). ``top`` > 0: both order statistics are among the row's
        ``top`` largest |x|, kept in ``largest`` (sorted descending) in one pass instead of sorting the row (the
        same values); else ``a`` (scratch of the row's size) is sorted."""
        d = xt.shape[0]
        amax = np.float32(0.0)
        if top > 0:
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
            tau = largest[d - 1 - i0] * w0 + largest[d - 1 - i1] * w1  # ascending a[i] is largest[d - 1 - i]
        else:
            for c in range(d):
                a[c] = abs(xt[c])
                amax = max(amax, a[c])
            a.sort()
            tau = a[i0] * w0 + a[i1] * w1
        second = largest[1] if top > 0 else a[d - 2]  # (top >= 2 for a clip ratio below 1)
        return max(tau, np.float32(0.5) * amax, amax - second)

    @njit
    def quantize_group(xt, c0, c1, kind, row_codes):
        """INT2 codes of channels c0 .. c1 of the row ``xt`` into ``row_codes`` (one per channel; round half to
        even, as torch.round): returns (lo, scale, their stored bits, whether the group is finite)."""
        lo = xt[c0]
        hi = lo
        finite = True
        for c in range(c0, c1):
            if not np.isfinite(xt[c]):
                finite = False
            lo = min(lo, xt[c])
            hi = max(hi, xt[c])
        scale = (hi - lo) / np.float32(3.0)
        lo_bits, lo_s = round_to_scale(lo, kind)
        sc_bits, sf = round_to_scale(scale, kind)
        for c in range(c0, c1):
            code = np.float32(0.0)
            if sf > 0:
                y = (xt[c] - lo_s) / sf
                r = np.floor(y)
                frac = y - r
                if frac > 0.5 or (frac == 0.5 and r % 2 != 0):
                    r += 1
                code = min(max(r, np.float32(0.0)), np.float32(3.0))
            row_codes[c] = np.uint8(code)
        return lo, scale, lo_bits, sc_bits, finite

    @njit
    def quantize_rows(x, i0, i1, w0, w1, top, clip, group, kind, codes, scale_out, lo_out, row0):
        """x: [B, H, N, D] float32 tokens (clipped in place if ``clip``); codes [B, H, >= row0 + N, D/4] uint8;
        scale_out / lo_out [B, H, >= row0 + N, D/G] (int16 bits of a 16-bit scale dtype, or float32): token t goes
        to row row0 + t (the outputs may be a cache's whole buffers). Returns the largest |lo| or 3 * scale (the
        range check), inf when a group holds NaN/Inf."""
        heads, n, d = x.shape[1], x.shape[2], x.shape[3]
        a = np.empty(d, np.float32)
        row_codes = np.empty(d, np.uint8)
        largest = np.empty(max(top, 1), np.float32)
        biggest_lo = biggest_scale = np.float32(0.0)
        finite = True
        for row in range(x.shape[0] * heads * n):
            bb, hh, t = row // (heads * n), (row // n) % heads, row % n
            xt = x[bb, hh, t]
            if clip:
                tau = clip_threshold(xt, i0, i1, w0, w1, top, largest, a)
                for c in range(d):
                    xt[c] = min(max(xt[c], -tau), tau)
            for gi in range(d // group):
                lo, scale, lo_bits, sc_bits, group_finite = quantize_group(xt, gi * group, (gi + 1) * group, kind,
                                                                           row_codes)
                finite = finite and group_finite
                biggest_lo = max(biggest_lo, abs(lo))
                biggest_scale = max(biggest_scale, scale)
                if kind == 2:
                    scale_out[bb, hh, row0 + t, gi] = scale
                    lo_out[bb, hh, row0 + t, gi] = lo
                else:
                    scale_out[bb, hh, row0 + t, gi] = sc_bits
                    lo_out[bb, hh, row0 + t, gi] = lo_bits
            for j in range(d // 4):
                codes[bb, hh, row0 + t, j] = row_codes[4 * j] | (row_codes[4 * j + 1] << 2) | \
                    (row_codes[4 * j + 2] << 4) | (row_codes[4 * j + 3] << 6)
        if not finite:  # NaN/Inf in a group (with check_finite off): the caller refuses it, as quantize_int2 does
            return np.float32(np.inf)
        return max(biggest_lo, biggest_scale * np.float32(3.0))


class TokenGroupQuantizer:
    """:func:`~hf_kvint2.transforms.clip_rows` then :func:`~hf_kvint2.quant.quantize_int2` (``"token"`` groups) of
    rotated float32 tokens [B, H, n, D] in one compiled call, for one head_dim, group, clip ratio and scale dtype:
    codes, scales and offsets bit-identical to those ops (same errors for values too large for the scale dtype).
    Built once per layout (:func:`token_group_quantizer`); a decode step's demotion then costs the compiled call and
    little else."""

    def __init__(self, d: int, group: int, clip_ratio: float | None, scale_dtype: torch.dtype):
        require_numba()
        if d % group or d % 4:
            raise ValueError(f"head_dim ({d}) must be a multiple of the group size ({group}) and of 4.")
        self.d, self.group, self.scale_dtype = d, group, scale_dtype
        self.kind = _SCALE_KINDS[scale_dtype]
        clip = clip_ratio is not None and clip_ratio < 1.0
        pos = (clip_ratio * (d - 1)) if clip else 0.0
        i0 = math.floor(pos)
        frac = pos - i0
        # the row's `d - i0` largest |x| hold both order statistics: kept apart where that is a few (clip ratios
        # near 1, the recipes' 0.86-0.96), else the sorted row
        top = d - i0 if clip and d - i0 <= QUANTIZER_TOP_MAX else 0
        self._args = (i0, min(i0 + 1, d - 1), np.float32(1 - frac), np.float32(frac), top, clip, group, self.kind)
        self._limit = torch.finfo(scale_dtype).max

    def bits(self, t: torch.Tensor) -> np.ndarray:
        """A scale / offset tensor (or buffer) as the array the compiled call writes: int16 bits of 16-bit floats."""
        return (t.view(torch.int16) if self.kind != 2 else t).numpy()

    def write(self, x: np.ndarray, codes: np.ndarray, scale: np.ndarray, lo: np.ndarray, row0: int = 0) -> None:
        """Quantize float32 ``x`` [B, H, n, D] (clipped in place) into rows ``row0 .. row0 + n - 1`` of ``codes``
        [B, H, >= row0 + n, D/4] and ``scale`` / ``lo`` (from :meth:`bits`); the rows are undefined if it raises."""
        biggest = quantize_rows(x, *self._args, codes, scale, lo, row0)
        if x.size and not biggest <= self._limit:
            raise scale_range_error(float(biggest), self.scale_dtype)

    def __call__(self, xr: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """:class:`~hf_kvint2.quant.QuantizedGroups` of ``xr`` [B, H, n, D] (which may be overwritten); ``out``:
        (codes, scale, lo) tensors [B, H, n, X] to write into instead."""
        b, h, n, d = xr.shape
        if d != self.d:
            raise ValueError(f"this quantizer is for head_dim {self.d}, got tokens of head_dim {d}.")
        # clipped in place: callers pass a temporary; detached: quantization has no gradient (a forward with grad on)
        x = (xr.detach() if xr.requires_grad else xr)
        x = (x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()).numpy()
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
