"""The body's partial attention as matrix products over the INT2 codes, for runtimes without fused kernels.

Same contract as :func:`hf_kvint2.read_path.body_partial_blocked` (a body-partial backend, traceable), another
formulation: a kernel library that runs one operator at a time over whole tensors (ExecuTorch's portable kernels)
pays for every elementwise pass over the body and for every transposed or broadcast copy a matrix product needs.
Here per block of tokens:

* the packed bytes become float codes ``[T, D]`` in one gather from a 256-row table (byte -> its four codes);
* keys: the affine dequantization ``k = code * scale + lo`` is folded into the query. Per-token groups: ``codes
  @ Q`` with ``Q [D, groups * M]`` the queries placed block-diagonally by channel group, then ``* scale + lo *
  sum(q)`` per group on ``[T, groups, M]``; per-channel groups: the queries scaled per token group,
  ``codes [T/G, G, D] @ (scale * q) [T/G, D, M]``, plus ``lo . q`` per group;
* values: the probabilities take the scales (per-token groups) or the products are scaled per channel (per-channel
  groups), then one product with the codes ``[T, D]``, plus the offsets' share.

The scores come out token-major (``[T, M]``, ``M`` = query rows of one KV head), so neither the codes nor the
values are ever transposed or repeated per query head; the only float ``[T, D]`` tensor of a block is its codes.
Token norms (omni-token scaling) scale the scores and the probabilities. Rounding differs from the blocked backend
(sums are grouped differently); both are tested against :func:`hf_kvint2.read_path.reference_body_partial`.
"""

from __future__ import annotations

import math

import torch

from .quant import unpack_int2
from .read_path import BODY_BLOCK_TOKENS, finite_or_zero, mask_to_additive

# Row b: the four codes of byte b (channel 4j in its two lowest bits: hf_kvint2.quant's packing).
CODE_TABLE = unpack_int2(torch.arange(256, dtype=torch.uint8)[:, None]).float()


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes ``[..., T, D/4]`` -> float codes ``[..., T, D]`` (one table gather)."""
    table = CODE_TABLE.to(packed.device)
    out = torch.nn.functional.embedding(packed.to(torch.int32), table)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def _group_mask(d: int, group: int, device) -> torch.Tensor:
    """``[D, D / group]`` float: 1 where channel c is in channel group c // group."""
    return (torch.arange(d, device=device)[:, None] // group == torch.arange(d // group, device=device)[None, :]).float()


def _key_scores(q: torch.Tensor, body, t0: int, t1: int) -> torch.Tensor:
    """Scores ``[BH, T, M]`` of query rows ``q [BH, M, D]`` (pre-scaled) against body keys ``[t0, t1)``."""
    bh, m, d = q.shape
    b, h = body.codes.shape[:2]
    g = body.group
    if body.layout.axis == "token":
        codes = _codes(body.codes[:, :, t0:t1]).reshape(bh, t1 - t0, d)
        ng = d // g
        mask = _group_mask(d, g, q.device)  # [D, ng]
        q_blocks = (q.transpose(1, 2).unsqueeze(2) * mask[None, :, :, None]).reshape(bh, d, ng * m)
        raw = (codes @ q_blocks).reshape(bh, t1 - t0, ng, m)
        scale = body.scale[:, :, t0:t1].float().reshape(bh, t1 - t0, ng, 1)
        lo = body.lo[:, :, t0:t1].float().reshape(bh, t1 - t0, ng, 1)
        q_sums = (q @ mask).transpose(1, 2).unsqueeze(1)  # [BH, 1, ng, M]
        scores = (raw * scale + lo * q_sums).sum(dim=2)
    else:  # whole token groups: t0 is aligned, a body may end inside its last group
        r0, r1 = t0 // g, -(-t1 // g)
        codes = _codes(body.codes[:, :, r0 * g:r1 * g]).reshape(bh, r1 - r0, g, d)
        scale = body.scale[:, :, r0:r1].float().reshape(bh, r1 - r0, d, 1)
        lo = body.lo[:, :, r0:r1].float().reshape(bh, r1 - r0, d)
        q_t = q.transpose(1, 2)  # [BH, D, M]
        raw = codes @ (scale * q_t.unsqueeze(1))  # [BH, groups, G, M]
        scores = (raw + (lo @ q_t).unsqueeze(2)).reshape(bh, (r1 - r0) * g, m)[:, :t1 - t0]
    if body.norm is not None:
        scores = scores * body.norm[:, t0:t1].float().reshape(b, 1, t1 - t0, 1).expand(b, h, t1 - t0, 1) \
            .reshape(bh, t1 - t0, 1)
    return scores


def _value_sum(p: torch.Tensor, body, t0: int, t1: int) -> torch.Tensor:
    """``sum_t p[t] v[t]`` ``[BH, M, D]`` for probabilities ``p [BH, T, M]`` over body values ``[t0, t1)``."""
    bh, t, m = p.shape
    b, h = body.codes.shape[:2]
    d = body.codes.shape[-1] * 4
    if body.norm is not None:
        p = p * body.norm[:, t0:t1].float().reshape(b, 1, t, 1).expand(b, h, t, 1).reshape(bh, t, 1)
    g = body.group
    if body.layout.axis == "token":
        codes = _codes(body.codes[:, :, t0:t1]).reshape(bh, t, d)
        ng = d // g
        mask = _group_mask(d, g, p.device).T  # [ng, D]
        scale = body.scale[:, :, t0:t1].float().reshape(bh, t, ng, 1)
        lo = body.lo[:, :, t0:t1].float().reshape(bh, t, ng)
        p_scaled = (p.unsqueeze(2) * scale).reshape(bh, t, ng * m).transpose(1, 2)  # [BH, ng * M, T]
        out = ((p_scaled @ codes).reshape(bh, ng, m, d) * mask[None, :, None, :]).sum(dim=1)
        return out + (p.transpose(1, 2) @ lo) @ mask
    r0, r1 = t0 // g, -(-t1 // g)  # whole token groups; tokens past t1 get probability 0
    codes = _codes(body.codes[:, :, r0 * g:r1 * g]).reshape(bh, r1 - r0, g, d)
    scale = body.scale[:, :, r0:r1].float().reshape(bh, r1 - r0, 1, d)
    lo = body.lo[:, :, r0:r1].float().reshape(bh, r1 - r0, d)
    if (r1 - r0) * g > t:
        p = torch.nn.functional.pad(p, (0, 0, 0, (r1 - r0) * g - t))
    p_groups = p.reshape(bh, r1 - r0, g, m)
    out = ((p_groups.transpose(2, 3) @ codes) * scale).sum(dim=1)
    return out + p_groups.sum(dim=2).transpose(1, 2) @ lo


def body_partial_codes(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None,
                       block_tokens: int = BODY_BLOCK_TOKENS):
    """Body-partial backend (see the module docstring): ``(out_rot [B, Hq, Lq, D] fp32, lse [B, Hq, Lq] fp32)``
    over the bodies' ``tokens``, ``block_tokens`` at a time (online softmax across blocks)."""
    b, hq, lq, d = q_rot.shape
    n = key_body.tokens
    hkv = key_body.codes.shape[1]
    g = hq // hkv
    bh, m = b * hkv, g * lq
    q = (q_rot.float() * scaling).reshape(bh, m, d)  # rows (query head in the group, position)
    bias = None
    if key_mean_logits is not None:
        bias = (scaling * key_mean_logits.float()).reshape(bh, 1, m)
    add = mask_to_additive(mask)
    if add is not None:  # [B|1, 1, Lq|1, n] -> [B, 1, n, 1, Lq] (token-major, like the scores)
        add = add.expand(b, 1, lq, add.shape[-1]).permute(0, 1, 3, 2).unsqueeze(3)
    align = math.lcm(*[s.group for s in (key_body, value_body) if s.layout.axis == "channel"] or [1])
    block = max(align, (block_tokens // align) * align)
    mx = torch.full((bh, 1, m), float("-inf"), device=q_rot.device)
    total = torch.zeros_like(mx)
    acc = torch.zeros(bh, m, d, device=q_rot.device)
    for t0 in range(0, n, block):
        t1 = min(n, t0 + block)
        s = _key_scores(q, key_body, t0, t1)
        if bias is not None:
            s = s + bias
        if add is not None:
            s = (s.reshape(b, hkv, t1 - t0, g, lq) + add[:, :, t0:t1]).reshape(bh, t1 - t0, m)
        m_new = torch.maximum(mx, s.amax(dim=1, keepdim=True))
        m_ref = finite_or_zero(m_new)
        p = torch.exp(s - m_ref)
        alpha = torch.exp(mx - m_ref)
        total = total * alpha + p.sum(dim=1, keepdim=True)
        acc = acc * alpha.transpose(1, 2) + _value_sum(p, value_body, t0, t1)
        mx = m_new
    total_t = total.transpose(1, 2)
    out = torch.where(total_t > 0, acc / torch.where(total_t > 0, total_t, torch.ones_like(total_t)),
                      torch.zeros_like(acc))
    lse = torch.where(total > 0, mx + torch.log(total), torch.full_like(total, float("-inf")))
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


__all__ = ["CODE_TABLE", "body_partial_codes"]
