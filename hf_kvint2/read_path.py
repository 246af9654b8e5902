"""The read path: attention of a query over full-precision segments and one INT2 body, merged by log-sum-exp.

One function composes a step, :func:`attend_segments`: dense partials for the full-precision segments before the
body (the sink), the body's partial from a backend (:class:`BodyBackend`, registered in
:mod:`hf_kvint2.backends`; computed in the rotated space with ``q' = q R_K`` and ``q.k = n_t (q'.k~) + q.mu_K``,
then de-rotated once, ``out = out_rot R_V^T + mu_V``), dense partials for the segments after it (recent window,
current chunk), and the log-sum-exp merge. GQA groups query heads by their KV head; K/V are never repeated. It
serves the dynamic layers' step, the static (export) layers and the Triton whole-layer step; a backend that can run
a whole step in one call (:attr:`BodyBackend.layer_step`) is called from there, on the same arguments. Masks
follow SDPA (bool: True attends; float: added) and are built in one place, :func:`step_mask`.

:func:`body_partial_blocked` is the PyTorch body backend (traceable, used by the static caches) and
:func:`reference_body_partial` the one dense reference every backend is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Body tokens dequantized at a time by the PyTorch body backend (dynamic and static layers).
BODY_BLOCK_TOKENS = 512
# Body tokens dequantized at a time by :func:`body_partial_dense` (its float32 temporaries: batch x heads x this x
# head_dim x 8 bytes).
BODY_DENSE_BLOCK_TOKENS = 8192


def mask_to_additive(mask: torch.Tensor | None) -> torch.Tensor | None:
    """bool (True attends) or additive float mask -> float32 additive mask (SDPA's conventions)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float()


def step_mask(model_mask: torch.Tensor | None, queries: range | torch.Tensor, keys: range | torch.Tensor,
                device, *, valid: torch.Tensor | None = None, window: int | None = None,
                causal: bool = True) -> torch.Tensor | None:
    """The additive fp32 mask ``[B or 1, 1, Lq, n]`` of one attention step (SDPA's conventions), or None where no
    key is masked: the one place masks are built.

    queries / keys: the absolute positions of the query rows and of the key columns, as a ``range`` (contiguous: the
    model's mask is sliced) or a LongTensor ``[Lq]`` / ``[n]`` (any order, e.g. the slots of a static layer's ring).
    model_mask: the model's mask over absolute positions, bool or additive ``[B or 1, 1, Lq, >= positions]``, or
    None. A key is attended where ``valid`` ``[n]`` holds (a slot that holds a position), within ``window``
    positions of the query (``key > query - window``), and where the model's mask allows it; without a model mask,
    where it is not after the query (``causal``).
    """
    contiguous = isinstance(queries, range) and isinstance(keys, range)
    out = None
    if model_mask is not None:
        if model_mask.dim() != 4 or model_mask.shape[1] != 1:
            raise ValueError(f"The attention mask must be [batch, 1, query_len, key_len], got {tuple(model_mask.shape)}"
                             " (per-head masks are read by SDPA on the portable view).")
        if isinstance(keys, range):
            if keys.step != 1 or model_mask.shape[-1] < keys.stop:
                raise ValueError(f"The attention mask has {model_mask.shape[-1]} key columns; this step reads "
                                 f"positions {keys.start}..{keys.stop - 1}.")
            out = mask_to_additive(model_mask[..., keys.start:keys.stop])
        else:
            out = mask_to_additive(model_mask).index_select(-1, keys.clamp(0, model_mask.shape[-1] - 1))
    causal = causal and model_mask is None
    if contiguous and valid is None and (not causal or keys.stop - 1 <= queries.start) and \
            (window is None or keys.start > queries.stop - 1 - window):
        return out  # every key is at or before every query (a decode step) and within the window
    q = torch.arange(queries.start, queries.stop, device=device) if isinstance(queries, range) else queries
    k = torch.arange(keys.start, keys.stop, device=device) if isinstance(keys, range) else keys
    allowed = None
    if causal:
        allowed = k[None, :] <= q[:, None]
    if window is not None:
        inside = k[None, :] > q[:, None] - window
        allowed = inside if allowed is None else allowed & inside
    if valid is not None:
        allowed = valid[None, :] if allowed is None else allowed & valid[None, :]
    if allowed is None:
        return out
    rule = torch.where(allowed, 0.0, float("-inf")).to(torch.float32)[None, None]
    return rule if out is None else out + rule


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def dense_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  mask: torch.Tensor | None, fused: bool = False, causal: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [B, Hq, Lq, D] over full-precision ``k``/``v`` [B, Hkv, n, D], GQA by grouping.

    mask: additive fp32 broadcastable to [B, 1, Lq, n]. ``causal`` (instead of a mask): k/v are the queries' own
    tokens (n == Lq), query i attends keys 0..i. Returns ``(out [B, Hq, Lq, D] fp32, lse [B, Hq, Lq])``;
    a row that attends nothing gives ``(0, -inf)``. ``fused``: on CPU, eagerly and without gradients, one fused
    flash-attention op instead of the separate ops (same result up to fp32 rounding; the static layers keep the
    separate ops, which their exported graphs reproduce bit for bit).
    """
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    if causal:
        if mask is not None or k.shape[2] != lq:
            raise ValueError(f"dense_partial(causal=True) attends the queries' own {lq} tokens without a mask; got "
                             f"{k.shape[2]} keys{' and a mask' if mask is not None else ''}.")
        if fused and _fused_cpu_eligible(q, k):
            return _dense_partial_causal_fused_cpu(q, k, v, scaling)
        mask = torch.full((lq, lq), float("-inf"), device=q.device).triu_(1)[None, None]
    if fused and _fused_cpu_eligible(q, k):
        return _dense_partial_fused_cpu(q, k, v, scaling, mask)
    q5 = q.float().reshape(b, hkv, hq // hkv, lq, d)
    scores = scaling * (q5 @ k.float().unsqueeze(2).transpose(-1, -2))  # [B, Hkv, g, Lq, n]
    if mask is not None:
        scores = scores + mask.unsqueeze(1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - finite_or_zero(lse).unsqueeze(-1))
    out = p @ v.float().unsqueeze(2)
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def _fused_cpu_eligible(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`dense_partial` may use PyTorch's fused CPU attention (eager, no gradient, CPU, tokens)."""
    return (q.device.type == "cpu" and k.shape[2] > 0 and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)))


def _dense_partial_fused_cpu(q, k, v, scaling, mask):
    """:func:`dense_partial` as one fused CPU kernel (flash attention with its log-sum-exp): the query heads of a
    GQA group are rows of their KV head's query (no K/V repeat). About 4x faster than the separate ops at decode."""
    b, hq, lq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    q4 = q.float().reshape(b, hkv, g * lq, d)
    m4 = None
    if mask is not None:
        m4 = mask.float()
        if lq > 1 and g > 1:  # rows are (group, query position): the mask of each position for every group member
            m4 = m4.expand(m4.shape[0], 1, lq, n).repeat(1, 1, g, 1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k.float(), v.float(), 0.0, False, attn_mask=m4, scale=scaling)
    if m4 is not None:  # a row that attends nothing: the kernel gives (0, 0); the contract is (0, -inf)
        dead = torch.isneginf(m4).all(dim=-1)
        lse = lse.masked_fill(dead.expand_as(lse) if dead.dim() == lse.dim() else dead.squeeze(1), float("-inf"))
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def _dense_partial_causal_fused_cpu(q, k, v, scaling):
    """:func:`dense_partial` of a chunk over its own tokens with the fused kernel's causal rule (no mask; it skips
    the blocks above the diagonal). Its causal rule needs one query row per position, so the chunk's K/V (Lq
    tokens, small) are repeated to the query heads instead of grouping the queries."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float(), v.float()
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.float(), k, v, 0.0, True, scale=scaling)
    return out, lse


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of partial attentions ``(out [..., D], lse [...])`` over disjoint key sets."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    ref = finite_or_zero(lse)
    out = sum(torch.exp(p[1] - ref).unsqueeze(-1) * p[0] for p in parts)
    return out, lse


# A body-partial backend: (q_rot, key: QuantizedBody, value: QuantizedBody, *, scaling, key_mean_logits, mask,
# **options) -> (out_rot [B, Hq, Lq, D] fp32, lse [B, Hq, Lq] fp32), over the bodies' ``tokens``.
BodyPartial = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BodyBackend:
    """A body-partial backend (:data:`BodyPartial`) for a device type (None: any), with an availability check.

    ``layer_step`` (optional): the whole step of :func:`attend_segments` in one call, ``layer_step(query, (sink k,
    v), key body, value body, (tail k, v), *, scaling, mask, **options)`` with ``mask`` over all columns, for the
    steps that ``serves_layer_step(query, key_body)`` accepts (one segment on each side of the body). It is called
    by :func:`attend_segments` and must give what the composition gives with the reference body. It also takes
    ``window_rows`` / ``after_tokens`` (windows with rows of their own, read in place) and ``body_tokens`` (each
    row's body length), see the Numba one, for :func:`hf_kvint2.steps.decode_batch` over a serving engine's
    window slots and requests of different lengths."""

    name: str
    device_type: str | None
    available: Callable[[], bool]
    run: BodyPartial
    # The Triton kernel's matrix products take the model's 16-bit dtype as operands (fp32 accumulation), as flash
    # attention does; the rotated query reaching it is fp32, so the model dtype is passed as an option.
    takes_dot_dtype: bool = False
    layer_step: Callable | None = None
    serves_layer_step: Callable[..., bool] = lambda query, key_body: False
    # whether layer_step reads bodies where they are stored, an arena's pages through a page table
    # (:class:`~hf_kvint2.stream.PagedQuantizedBody`), instead of a gathered copy
    reads_pages: bool = False

    def options(self, query) -> dict:
        """Backend options that depend on the query (the model's dtype)."""
        return {"dot_dtype": query.dtype} if self.takes_dot_dtype else {}


def attend_segments(query: torch.Tensor, before: Sequence[tuple], key_body, value_body, after: Sequence[tuple],
                    scaling: float, backend: BodyBackend, mask: torch.Tensor | None = None, *,
                    fused_dense: bool = False, own: tuple | None = None, **options) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over the ``before`` segments, the body and the ``after`` segments, in
    that order: the one composition of the read path.

    before / after: ``(k, v)`` full-precision segments [B, Hkv, n, D]. key_body / value_body:
    :class:`~hf_kvint2.stream.QuantizedBody` (their ``tokens`` are attended). mask: bool or additive over all the
    columns in that order, broadcastable to [B, 1, Lq, columns] (:func:`step_mask`), or None. ``own``: the
    queries' own ``(k, v)`` [B, Hkv, Lq, D], last, attended causally (a prefill chunk: every other column is
    before every query, so a long chunk needs no mask at all). ``backend`` reads the body (with ``options``); where
    it offers the whole step in one call and serves this one (:class:`BodyBackend`), that call is the step.
    ``fused_dense``: see :func:`dense_partial` (the dynamic layers' eager step). Returns [B, Hq, Lq, D] in
    query.dtype.
    """
    options = {**backend.options(query), **options}
    if own is not None and backend.layer_step is not None and backend.serves_layer_step(query, key_body):
        # the one-call step takes one segment after the body and a mask over every column: the queries' own
        # tokens join that segment under the causal rule
        lq = query.shape[2]
        cols = sum(k.shape[2] for k, _ in (*before, *after)) + key_body.tokens
        rule = step_mask(None, range(cols, cols + lq), range(cols + lq), query.device)
        mask = rule if mask is None else rule + torch.nn.functional.pad(mask_to_additive(mask), (0, lq))
        after = [(torch.cat([*(k for k, _ in after), own[0]], dim=2), torch.cat([*(v for _, v in after), own[1]],
                                                                                dim=2))]
        own = None
    if backend.layer_step is not None and len(before) <= 1 and len(after) == 1 and \
            backend.serves_layer_step(query, key_body):
        sink = before[0] if before else (after[0][0][:, :, :0], after[0][1][:, :, :0])
        return backend.layer_step(query, sink, key_body, value_body, after[0], scaling=scaling, mask=mask, **options)
    groups = query.shape[1] // key_body.codes.shape[1]
    qf = query.float()
    mask = mask_to_additive(mask)
    parts, col = [], 0

    def columns(n: int):
        return None if mask is None else mask[..., col:col + n]

    def attend_dense(segments):
        nonlocal col
        for k, v in segments:
            if k.shape[2]:
                parts.append(dense_partial(qf, k, v, scaling, columns(k.shape[2]), fused_dense))
            col += k.shape[2]

    attend_dense(before)
    kc, vc = key_body.codec, value_body.codec
    out_rot, lse = backend.run(qf @ kc.rotation, key_body, value_body, scaling=scaling,
                               key_mean_logits=kc.mean_logits(qf, groups), mask=columns(key_body.tokens), **options)
    parts.append((vc.unrotate(out_rot, groups), lse))
    col += key_body.tokens
    attend_dense(after)
    if own is not None:
        parts.append(dense_partial(qf, own[0], own[1], scaling, None, fused_dense, causal=True))
    out, _ = merge_partials(parts)
    return out.to(query.dtype)


def body_partial_blocked(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None,
                         block_tokens: int = BODY_BLOCK_TOKENS):
    """The PyTorch body backend: dequantizes ``block_tokens`` body tokens at a time (rotated space) and merges
    blocks by online softmax, so no full-precision copy of the body exists. Traceable (the static caches export
    it). q_rot: [B, Hq, Lq, D] (``q @ R_K``); key_mean_logits: ``q.mu_K`` [B, Hq, Lq] or None; mask: bool/additive,
    broadcastable to [B, 1, Lq, tokens]. Returns ``(out_rot [B, Hq, Lq, D] fp32, lse [B, Hq, Lq] fp32)``.
    """
    b, hq, lq, d = q_rot.shape
    n = key_body.tokens
    hkv = key_body.codes.shape[1]
    g = hq // hkv
    q5 = (q_rot.float() * scaling).reshape(b, hkv, g, lq, d)
    bias = None if key_mean_logits is None else (scaling * key_mean_logits.float()).reshape(b, hkv, g, lq, 1)
    add = mask_to_additive(mask)
    align = math.lcm(*[s.group for s in (key_body, value_body) if s.layout.axis == "channel"] or [1])
    block = max(align, (block_tokens // align) * align)
    m = torch.full((b, hkv, g, lq, 1), float("-inf"), device=q_rot.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(b, hkv, g, lq, d, device=q_rot.device)
    for t0 in range(0, n, block):
        t1 = min(n, t0 + block)
        k = key_body.dequantize(t0, t1, rotated=True)
        s = q5 @ k.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, g, Lq, t]
        if bias is not None:
            s = s + bias
        if add is not None:
            s = s + add[..., t0:t1].unsqueeze(1)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_ref = finite_or_zero(m_new)
        p = torch.exp(s - m_ref)
        alpha = torch.exp(m - m_ref)
        v = value_body.dequantize(t0, t1, rotated=True)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + p @ v.unsqueeze(2)
        m = m_new
    out = torch.where(l > 0, acc / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(acc))
    lse = torch.where(l > 0, m + torch.log(l), torch.full_like(l, float("-inf")))
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def body_partial_dense(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None,
                       block_tokens: int = BODY_DENSE_BLOCK_TOKENS):
    """The body partial for many query rows (a prefill chunk over a stored body): ``block_tokens`` body tokens at a
    time dequantized (rotated space) and attended by :func:`dense_partial` (fused flash attention on CPU), the
    blocks merged by log-sum-exp. A chunk's rows share every dequantized token, so this costs one dequantization per
    token and matrix products, where a code-reading kernel decodes each token once per group of rows. Same
    arguments and result as :func:`body_partial_blocked`; ``q . mu_K`` is the same for every token of a row, so it
    moves the row's log-sum-exp and leaves its weights unchanged."""
    n = key_body.tokens
    add = mask_to_additive(mask)
    align = math.lcm(*[s.group for s in (key_body, value_body) if s.layout.axis == "channel"] or [1])
    block = max(align, (block_tokens // align) * align)
    parts = []
    for t0 in range(0, n, block):
        t1 = min(n, t0 + block)
        k = key_body.dequantize(t0, t1, rotated=True)
        v = value_body.dequantize(t0, t1, rotated=True)
        parts.append(dense_partial(q_rot, k, v, scaling, None if add is None else add[..., t0:t1], fused=True))
    if not parts:  # an empty body: every row attends nothing
        b, hq, lq, d = q_rot.shape
        return q_rot.new_zeros(b, hq, lq, d, dtype=torch.float32), q_rot.new_full((b, hq, lq), float("-inf"),
                                                                                    dtype=torch.float32)
    out, lse = merge_partials(parts)
    if key_mean_logits is not None:
        lse = lse + scaling * key_mean_logits.float()
    return out, lse


def reference_body_partial(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None):
    """The dense reference of every body backend: dequantize the whole body (rotated space, norms applied),
    SDPA-style scores with GQA by grouping, softmax in fp32. Returns ``(out_rot, lse)``."""
    b, hq, lq, d = q_rot.shape
    k, v = key_body.dequantize(rotated=True), value_body.dequantize(rotated=True)
    n, hkv = key_body.tokens, k.shape[1]
    q = q_rot.float().reshape(b, hkv, hq // hkv, lq, d)
    scores = scaling * (q @ k.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, rep, Lq, T]
    if key_mean_logits is not None:
        scores = scores + scaling * key_mean_logits.float().reshape(b, hkv, hq // hkv, lq, 1)
    add = mask_to_additive(mask)
    if add is not None:
        scores = scores + add.expand(b, 1, lq, n).unsqueeze(1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - finite_or_zero(lse).unsqueeze(-1))
    return (p @ v.unsqueeze(2)).reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


TORCH_BODY = BodyBackend("torch", None, lambda: True, body_partial_blocked)
# what every backend is tested against
REFERENCE_BODY = BodyBackend("reference", None, lambda: True, reference_body_partial)
