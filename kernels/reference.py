"""PyTorch references for the Triton kernels, written with the library's own write and read paths.

Kept free of Triton so that the tests and ``benchmarks/bench_gpu.py --dry-run`` run them anywhere. The body
kernel's reference is the one every body backend shares: :func:`hf_kvint2.read_path.reference_body_partial`.
"""

from __future__ import annotations

import torch

from hf_kvint2.quant import quantize_int2
from hf_kvint2.read_path import dense_partial, mask_to_additive
from hf_kvint2.transforms import transform_tokens


def reference_quantize_tokens(x, rotation, mean, *, axis, group_size, clip, token_scaling, scale_dtype,
                              range_clip=None):
    """What a stream stores for new tokens ``x`` (:meth:`hf_kvint2.stream.StreamCodec.quantize`)."""
    xt, norm = transform_tokens(x, rotation.float(), None if mean is None else mean.float(), clip=clip,
                                token_scaling=token_scaling, scale_dtype=scale_dtype)
    return quantize_int2(xt, axis, group_size, scale_dtype, range_clip), norm


def layer_mask(attention_mask, lq: int, tkv: int, device) -> torch.Tensor:
    """The additive fp32 mask [B or 1, 1, Lq, Tkv] for a layer step; None means causal among the last Lq keys."""
    if attention_mask is None:
        rows = torch.arange(lq, device=device)[:, None] + (tkv - lq)
        allowed = torch.arange(tkv, device=device)[None, :] <= rows
        return mask_to_additive(allowed[None, None])
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-1] < tkv:
        raise ValueError(f"attention_mask must be [batch, 1, query_len, >= {tkv}], got {tuple(attention_mask.shape)}.")
    return mask_to_additive(attention_mask[..., :tkv])


def reference_layer_attention(query, layer, *, scaling, attention_mask=None):
    """Reference of :func:`hf_kvint2.kernels.layer_decode_attention`: SDPA math in fp32 over the layer's tokens
    (sink, dequantized body in the original space, recent). Returns [B, Hq, Lq, D] in ``query.dtype``."""
    lq = query.shape[2]
    parts_k, parts_v = [layer.sink_k.float()], [layer.sink_v.float()]
    if layer.body_len:
        parts_k.append(layer.key_body.dequantize())
        parts_v.append(layer.value_body.dequantize())
    parts_k.append(layer.recent_k.float())
    parts_v.append(layer.recent_v.float())
    k, v = torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)
    out, _ = dense_partial(query.float(), k, v, scaling, layer_mask(attention_mask, lq, k.shape[2], query.device))
    return out.to(query.dtype)


__all__ = ["layer_mask", "reference_layer_attention", "reference_quantize_tokens"]
