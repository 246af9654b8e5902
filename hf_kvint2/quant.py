"""Asymmetric INT2 quantization: group statistics, quantize/dequantize, and 4-codes-per-byte packing.

Tensors are laid out as transformers caches them, ``[batch, kv_heads, tokens, head_dim]``. Two group axes:

* ``"token"``   - one group per token over ``group_size`` consecutive channels (scales ``[B, H, T, D // G]``);
* ``"channel"`` - one group per channel over ``group_size`` consecutive tokens (scales ``[B, H, T // G, D]``).

Codes are always packed along the channel axis: byte ``j`` of a token holds channels ``4j .. 4j+3`` as
``c0 | c1 << 2 | c2 << 4 | c3 << 6`` (channel ``4j`` in the two least significant bits). The kernels and the
exported graphs rely on this order.

The same functions run eagerly and under ``torch.compile`` / ``torch.export`` (the static caches' export path).
Where a tracer needs another formulation of the same arithmetic, :func:`tracing` picks it here, once, so there is
a single quantizer; ``tests/test_export.py`` checks the traced results bit for bit against eager.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

AXES = ("token", "channel")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SHIFTS = (0, 2, 4, 6)
_BYTE_WEIGHTS = (1, 4, 16, 64)  # 1 << shift: the packing as arithmetic


def tracing() -> bool:
    """True under ``torch.compile`` and ``torch.export`` (which the dynamo ONNX exporter runs)."""
    return torch.compiler.is_compiling()


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)  # torch >= 2.6
    return bool(is_exporting and is_exporting())


def as_stored(x: torch.Tensor) -> torch.Tensor:
    """``x.float()`` for a value just rounded to fp16/bf16, such that the rounding is kept under inductor too.

    Inductor elides a float32 -> 16-bit -> float32 cast pair inside a fused kernel
    (``torch._inductor.config.emulate_precision_casts`` is off by default) and would then choose INT2 codes from
    the unrounded scale (logits off by ~4e-2 on SmolLM2). A double xor on the integer bits is an identity it cannot
    see through. ``torch.export`` and ONNX keep casts as written (and ONNX has no bitcast), so only under
    ``torch.compile`` proper.
    """
    if x.dtype in (torch.float16, torch.bfloat16) and tracing() and not _exporting():
        bits = torch.bitwise_xor(torch.bitwise_xor(x.view(torch.int16), 0x5555), 0x5555)
        return bits.view(x.dtype).float()
    return x.float()


def to_model_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 reconstruction in the model's dtype; values past its largest finite value (the quantization error
    of a value near the fp16 maximum) saturate instead of becoming inf."""
    if dtype in (torch.float16, torch.bfloat16):
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


class QuantizedGroups(NamedTuple):
    """Packed INT2 codes ``[B, H, T, D // 4]`` with the ``scale`` and ``lo`` of every group."""

    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """Pack integer codes in ``[0, 3]`` four per byte along the last dimension (which must be a multiple of 4)."""
    if codes.shape[-1] % 4:
        raise ValueError(f"pack_int2 needs a last dimension divisible by 4, got {codes.shape[-1]}.")
    if tracing():
        # The ONNX exporter types ``uint8 << int`` as int8, which ONNX Runtime rejects in the ``|``; the weighted
        # sum c0 + 4 c1 + 16 c2 + 64 c3 is the same byte. (Eagerly it is ~10x slower than the shifts.)
        c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
        weights = torch.tensor(_BYTE_WEIGHTS, dtype=torch.int32, device=codes.device)
        return (c * weights).sum(dim=-1).to(torch.uint8)
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int2`: ``[..., n]`` bytes to ``[..., 4n]`` codes in ``[0, 3]`` (uint8; int32 when
    traced, where integer division replaces ``>>``/``&`` on uint8, which the ONNX exporter types inconsistently)."""
    if tracing():
        p = packed.to(torch.int32).unsqueeze(-1)
        weights = torch.tensor(_BYTE_WEIGHTS, dtype=torch.int32, device=packed.device)
        codes = torch.remainder(torch.div(p, weights, rounding_mode="floor"), 4)
        return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 4)
    parts = [(packed >> s) & 3 for s in _SHIFTS]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def _grouped(x: torch.Tensor, axis: str, group_size: int) -> tuple[torch.Tensor, int]:
    """View ``x`` [B, H, T, D] with one group per reduction over the returned dim."""
    b, h, t, d = x.shape
    if axis == "token":
        return x.reshape(b, h, t, d // group_size, group_size), -1
    return x.reshape(b, h, t // group_size, group_size, d), -2


def _check_group_shape(shape: torch.Size, axis: str, group_size: int) -> None:
    if axis not in AXES:
        raise ValueError(f"Unknown group axis {axis!r}; use one of {AXES}.")
    extent = shape[-1] if axis == "token" else shape[-2]
    what = "head_dim" if axis == "token" else "token count"
    if group_size <= 0 or extent % group_size:
        raise ValueError(f"The {what} ({extent}) is not a multiple of the group size ({group_size}) for '{axis}' groups.")
    if shape[-1] % 4:
        raise ValueError(f"head_dim ({shape[-1]}) must be a multiple of 4 to pack four INT2 codes per byte.")


def scale_range_error(biggest: float, scale_dtype: torch.dtype) -> ValueError:
    """The error for group ranges or offsets (up to ``biggest``) that do not fit ``scale_dtype``."""
    fix = ("pass scale_dtype=torch.bfloat16 or torch.float32 to the cache" if scale_dtype is torch.float16
           else "the values are too large for any scale dtype; check the model's activations")
    short = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[scale_dtype]
    return ValueError(f"Values up to {biggest:.4g} do not fit {short} scales; {fix}.")


def range_clip_divisor(range_clip: float | None) -> float | None:
    """The divisor ``2 / (1 - range_clip)`` of a group's width that gives what each end moves in (None: no
    narrowing). A division, not a product, so that the Triton kernel's ``lo + width / divisor`` cannot be
    contracted into a fused multiply-add and rounds as PyTorch does."""
    if range_clip is None or range_clip >= 1.0:
        return None
    return 2.0 / (1.0 - range_clip)


def quantize_int2(
    x: torch.Tensor, axis: str, group_size: int, scale_dtype: torch.dtype = torch.float16,
    range_clip: float | None = None,
) -> QuantizedGroups:
    """Asymmetric 4-level quantization of ``x`` [B, H, T, D] over groups along ``axis``.

    ``scale`` and ``lo`` are rounded to ``scale_dtype`` *before* the codes are chosen, so that dequantization with
    the stored values has error at most ``scale / 2`` plus the rounding of ``lo``. A constant group gets scale 0
    and code 0 (no division by zero) and comes back as ``lo`` exactly. ``range_clip`` (``"channel"`` groups,
    :class:`~hf_kvint2.recipes.GroupLayout`): the levels span that fraction of each group's ``[min, max]``, about
    its centre; values outside take the end codes.
    """
    _check_group_shape(x.shape, axis, group_size)
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype}.")
    divisor = range_clip_divisor(range_clip)
    if divisor is not None and axis != "channel":
        raise ValueError("range_clip applies to 'channel' groups only (per-token groups clip rows instead).")
    xf = x.float()
    g, dim = _grouped(xf, axis, group_size)
    lo = g.amin(dim=dim, keepdim=True)
    hi = g.amax(dim=dim, keepdim=True)
    if divisor is not None:
        shrink = (hi - lo) / divisor
        lo, hi = lo + shrink, hi - shrink
    scale = (hi - lo) / 3
    if not tracing() and g.numel():
        # Both the range and the offset must fit in the scale dtype; say so instead of storing inf (fp32 too: a
        # range of two values near +-3e38 overflows). (A data-dependent ``if`` cannot be traced; exported graphs
        # rely on the eager prefill and the model's range.)
        biggest = torch.maximum(lo.abs().amax(), scale.amax() * 3)
        if not biggest <= torch.finfo(scale_dtype).max:
            raise scale_range_error(biggest.item(), scale_dtype)
    lo_s = lo.to(scale_dtype)
    scale_s = scale.to(scale_dtype)
    sf = as_stored(scale_s)
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = torch.where(sf > 0, torch.round((g - as_stored(lo_s)) / safe), torch.zeros_like(g)).clamp_(0, 3)
    codes = codes.reshape(x.shape)
    return QuantizedGroups(pack_int2(codes), scale_s.squeeze(dim), lo_s.squeeze(dim))


def dequantize_int2(q: QuantizedGroups, axis: str, group_size: int) -> torch.Tensor:
    """Float32 reconstruction ``code * scale + lo`` of :func:`quantize_int2`'s output, shape [B, H, T, D]."""
    codes = unpack_int2(q.codes).float()
    g, dim = _grouped(codes, axis, group_size)
    out = g * q.scale.float().unsqueeze(dim) + q.lo.float().unsqueeze(dim)
    return out.reshape(codes.shape)
