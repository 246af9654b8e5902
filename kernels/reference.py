"""PyTorch references for the Triton kernels: the exact math, written with the library's own dequantization.

Kept free of Triton so that the tests and ``benchmarks/bench_gpu.py --dry-run`` run them anywhere.
"""

from __future__ import annotations

import torch

from hf_kvint2.layers import QuantizedStream
from hf_kvint2.quant import QuantizedGroups
from hf_kvint2.recipes import GroupLayout


def reference_quantize_tokens(x, rotation, mean, *, axis, group_size, clip, token_scaling, scale_dtype):
    """What a :class:`QuantizedStream` stores for new tokens ``x`` (:meth:`QuantizedStream.quantize`)."""
    stream = QuantizedStream(GroupLayout(axis, group_size, clip, token_scaling), group_size, rotation.float(),
                             None if mean is None else mean.float(), scale_dtype)
    return stream.quantize(x)


def mask_to_additive(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """bool (True attends) or additive float mask -> float32 additive mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=like.device).masked_fill_(~mask, float("-inf"))
    return mask.float()


def _softmax_partial(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(scores) @ values, logsumexp(scores)), with rows that attend nothing giving (0, -inf)."""
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    return p @ values, lse


def reference_body_attention(q_rot, key_body: QuantizedStream, value_body: QuantizedStream, *, n_tokens=None,
                             scaling, key_mean_logits=None, mask=None):
    """Reference of :func:`hf_kvint2.kernels.body_attention`: dequantize the body (rotated space, norms applied),
    SDPA-style scores with GQA by grouping, softmax in fp32. Returns ``(out_rot, lse)``."""
    b, hq, lq, d = q_rot.shape
    k = key_body.dequantize(rotated=True)
    v = value_body.dequantize(rotated=True)
    n = k.shape[2] if n_tokens is None else n_tokens
    k, v = k[:, :, :n], v[:, :, :n]
    hkv = k.shape[1]
    q = q_rot.float().reshape(b, hkv, hq // hkv, lq, d)
    scores = scaling * (q @ k.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, rep, Lq, T]
    if key_mean_logits is not None:
        scores = scores + scaling * key_mean_logits.float().reshape(b, hkv, hq // hkv, lq, 1)
    add = mask_to_additive(mask, q_rot)
    if add is not None:
        scores = scores + add.expand(b, 1, lq, n).unsqueeze(1)
    out, lse = _softmax_partial(scores, v.unsqueeze(2))
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def merge_partials(*parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of partial attentions ``(out [..., D], lse [...])`` over disjoint key sets."""
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = sum(torch.exp(p[1] - ref).unsqueeze(-1) * p[0] for p in parts)
    return out, lse


def layer_mask(attention_mask, lq: int, tkv: int, device) -> torch.Tensor:
    """The additive fp32 mask [B or 1, 1, Lq, Tkv] for a layer step; None means causal among the last Lq keys."""
    if attention_mask is None:
        rows = torch.arange(lq, device=device)[:, None] + (tkv - lq)
        allowed = torch.arange(tkv, device=device)[None, :] <= rows
        return mask_to_additive(allowed[None, None], torch.empty(0, device=device))
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-1] < tkv:
        raise ValueError(f"attention_mask must be [batch, 1, query_len, >= {tkv}], got {tuple(attention_mask.shape)}.")
    return mask_to_additive(attention_mask[..., :tkv], torch.empty(0, device=device))


def reference_layer_attention(query, layer, *, scaling, attention_mask=None):
    """Reference of :func:`hf_kvint2.kernels.layer_decode_attention`: SDPA math in fp32 over the layer's tokens
    (sink, dequantized body in the original space, recent). Returns [B, Hq, Lq, D] in ``query.dtype``."""
    b, hq, lq, d = query.shape
    parts_k, parts_v = [layer.sink_k.float()], [layer.sink_v.float()]
    if layer.body_len:
        parts_k.append(layer.key_body.dequantize())
        parts_v.append(layer.value_body.dequantize())
    parts_k.append(layer.recent_k.float())
    parts_v.append(layer.recent_v.float())
    k, v = torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)
    hkv, tkv = k.shape[1], k.shape[2]
    q = query.float().reshape(b, hkv, hq // hkv, lq, d)
    scores = scaling * (q @ k.unsqueeze(2).transpose(-1, -2))
    scores = scores + layer_mask(attention_mask, lq, tkv, query.device).unsqueeze(1)
    out, _ = _softmax_partial(scores, v.unsqueeze(2))
    return out.reshape(b, hq, lq, d).to(query.dtype)


__all__ = [
    "QuantizedGroups",
    "layer_mask",
    "mask_to_additive",
    "merge_partials",
    "reference_body_attention",
    "reference_layer_attention",
    "reference_quantize_tokens",
]
