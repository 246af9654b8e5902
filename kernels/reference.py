"""PyTorch references for the Triton kernels, written with the library's own write and read paths.

Kept free of Triton so that the tests and ``benchmarks/bench_gpu.py --dry-run`` run them anywhere. The body
kernel's reference is the one every body backend shares: :func:`hf_kvint2.read_path.reference_body_partial`.
"""

from __future__ import annotations

import torch

from hf_kvint2.quant import quantize_int2
from hf_kvint2.read_path import dense_partial, step_mask
from hf_kvint2.transforms import transform_tokens


def reference_quantize_tokens(x, rotation, mean, *, axis, group_size, clip, token_scaling, scale_dtype,
                              range_clip=None):
    """What a stream stores for new tokens ``x`` (:meth:`hf_kvint2.stream.StreamCodec.quantize`)."""
    xt, norm = transform_tokens(x, rotation.float(), None if mean is None else mean.float(), clip=clip,
                                token_scaling=token_scaling, scale_dtype=scale_dtype)
    return quantize_int2(xt, axis, group_size, scale_dtype, range_clip), norm


def reference_layer_attention(query, layer, *, scaling, attention_mask=None):
    """Reference of :func:`hf_kvint2.kernels.layer_decode_attention`: SDPA math in fp32 over the layer's tokens
    (sink, dequantized body in the original space, recent). Returns [B, Hq, Lq, D] in ``query.dtype``."""
    parts_k, parts_v = [layer.sink_k.float()], [layer.sink_v.float()]
    if layer.body_len:
        parts_k.append(layer.key_body.dequantize())
        parts_v.append(layer.value_body.dequantize())
    parts_k.append(layer.recent_k.float())
    parts_v.append(layer.recent_v.float())
    k, v = torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)
    total, lq = k.shape[2], query.shape[2]  # the queries are the last lq tokens
    mask = step_mask(attention_mask, range(total - lq, total), range(total), query.device)
    out, _ = dense_partial(query.float(), k, v, scaling, mask)
    return out.to(query.dtype)


__all__ = ["reference_layer_attention", "reference_quantize_tokens"]
