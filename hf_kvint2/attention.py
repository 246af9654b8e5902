"""The ``"oscar"`` attention: attention over an Oscar cache layer that reads the INT2 body without dequantizing it.

Importing :mod:`hf_kvint2` registers ``"oscar"`` with transformers' ``AttentionInterface`` (this function) and
``AttentionMaskInterface`` (SDPA's masks), so ``from_pretrained(..., attn_implementation="oscar")`` and
``model.set_attn_implementation("oscar")`` work.

How the attention finds the layer's storage: transformers calls ``cache.update(k, v, layer_idx)`` and passes what
it returns to the attention function. :meth:`OscarLayer.update` wraps one forward of a layer in a
:class:`LayerStep` (past tokens as stored + the current chunk at full precision). The first time the ``"oscar"``
attention receives a layer's ordinary output it marks the layer ``fused_attention``; from then on ``update``
returns :class:`DeferredKV` placeholders (no storage) that carry the step. The ``"oscar"`` attention reads the
step directly; any other attention implementation that touches a placeholder gets the portable full-precision
view instead, so results are right whatever the model's attention implementation is.

Fused math (SPEC 3, 5): with ``q' = q R_K``, a body key reconstructs as ``k = n_t (k~ R_K^T) + mu_K``, so
``q.k = n_t (q'.k~) + q.mu_K``; body values are accumulated in the rotated space and de-rotated once
(``out = out_rot R_V^T + mu_V``). Sink, body and recent segments are merged by log-sum-exp. GQA groups query heads
by their KV head; K/V are never repeated. Masks, padding, ``scaling`` and ``is_causal`` follow SDPA.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref

import torch
from torch.utils import _pytree as pytree
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .quant import QuantizedGroups

ATTN_IMPLEMENTATION = "oscar"
PORTABLE_PATH_WARNING = (
    "hf_kvint2: this Oscar cache is read through the portable attention path, which dequantizes the layer's whole "
    "INT2 cache at every step (slow). Load the model with attn_implementation=\"oscar\" (or call "
    "model.set_attn_implementation(\"oscar\")) after `import hf_kvint2` for the fused INT2 attention."
)
_portable_warning = {"issued": False}
# The last (layer, returned keys) of an OscarLayer.update that returned ordinary tensors (see module docstring).
_last_update: tuple[weakref.ref, weakref.ref] | None = None


def warn_portable_path_once() -> None:
    if not _portable_warning["issued"]:
        _portable_warning["issued"] = True
        warnings.warn(PORTABLE_PATH_WARNING, UserWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------------- layer step
class LayerStep:
    """One forward of one :class:`~hf_kvint2.layers.OscarLayer`: what its attention reads.

    Token order: ``sink_k`` (past sink tokens), the first ``body_tokens`` tokens of the layer's INT2 body, then
    ``tail_k`` (past recent tokens followed by the current chunk, all full precision). Tokens of the current chunk
    that were already demoted to the body or stored in the sink are attended from the chunk itself.
    """

    __slots__ = ("__weakref__", "_full", "body_tokens", "layer", "sink_k", "sink_v", "tail_k", "tail_v")

    def __init__(self, layer, key_states: torch.Tensor, value_states: torch.Tensor):
        n_new = key_states.shape[-2]
        past = layer.seq_len - n_new
        n_sink = layer.sink_k.shape[-2]
        self.layer = layer
        self.sink_k, self.sink_v = layer.sink_k[:, :, :min(n_sink, past)], layer.sink_v[:, :, :min(n_sink, past)]
        self.body_tokens = min(max(past - n_sink, 0), layer.body_len)
        recent_past = past - n_sink - layer.body_len
        if n_new <= layer.recent_k.shape[-2]:  # the chunk is the newest part of the recent window
            self.tail_k, self.tail_v = layer.recent_k, layer.recent_v
        else:  # the chunk overflowed the window, so every recent token is from it
            assert recent_past <= 0, "OscarLayer invariant: an overflowing chunk fills the whole recent window"
            self.tail_k, self.tail_v = key_states, value_states
        self._full = None

    @property
    def seq_len(self) -> int:
        return self.sink_k.shape[-2] + self.body_tokens + self.tail_k.shape[-2]

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The portable view: every token in the original space and the model's dtype (body dequantized)."""
        if self._full is None:
            ks, vs = [self.sink_k], [self.sink_v]
            if self.body_tokens:
                n, dtype = self.body_tokens, self.sink_k.dtype
                ks.append(self.layer.key_body.dequantize()[:, :, :n].to(dtype))
                vs.append(self.layer.value_body.dequantize()[:, :, :n].to(dtype))
            ks.append(self.tail_k)
            vs.append(self.tail_v)
            self._full = (torch.cat(ks, dim=-2), torch.cat(vs, dim=-2))
        return self._full

    def portable_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns for attention implementations other than ``"oscar"`` (warns once if slow)."""
        global _last_update
        if self.body_tokens:
            warn_portable_path_once()
        keys, values = self.materialize()
        self._full = None  # the caller owns the tensors now; keep no reference to a full-precision history
        _last_update = (weakref.ref(self.layer), weakref.ref(keys))
        return keys, values

    def deferred_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        return DeferredKV.make(self, 0), DeferredKV.make(self, 1)


_METADATA_FUNCS = {
    torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_floating_point,
    torch.Tensor.__len__, torch.Tensor.element_size, torch.Tensor.numel,
}


class DeferredKV(torch.Tensor):
    """Zero-storage stand-in for a layer's full K (``which=0``) or V (``which=1``) in one forward.

    It has the shape, dtype and device of the portable view. The ``"oscar"`` attention reads ``.step``; any other
    torch operation on it first materializes the portable view (dequantizing the body), so other attention
    implementations still compute the right thing.
    """

    step: LayerStep
    which: int

    @staticmethod
    def make(step: LayerStep, which: int) -> DeferredKV:
        like = step.tail_k
        shape = (*like.shape[:2], step.seq_len, like.shape[-1])
        t = like.new_zeros(()).expand(shape).as_subclass(DeferredKV)
        t.step, t.which = step, which
        return t

    def full(self) -> torch.Tensor:
        if self.step.body_tokens:
            warn_portable_path_once()
        return self.step.materialize()[self.which]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_FUNCS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(DeferredKV, lambda t: t.full(), (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self, **kwargs):
        return f"DeferredKV(layer={self.step.layer.layer_idx}, which={'KV'[self.which]}, shape={tuple(self.shape)})"


# ---------------------------------------------------------------------------------------------------- partials
def mask_to_additive(mask: torch.Tensor | None) -> torch.Tensor | None:
    """bool (True attends) or additive float mask -> float32 additive mask (SDPA's conventions)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float()


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def dense_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [B, Hq, Lq, D] over full-precision ``k``/``v`` [B, Hkv, n, D], GQA by grouping.

    mask: additive fp32 broadcastable to [B, 1, Lq, n]. Returns ``(out [B, Hq, Lq, D] fp32, lse [B, Hq, Lq])``;
    a row that attends nothing gives ``(0, -inf)``.
    """
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    q5 = q.float().reshape(b, hkv, hq // hkv, lq, d)
    scores = scaling * (q5 @ k.float().unsqueeze(2).transpose(-1, -2))  # [B, Hkv, g, Lq, n]
    if mask is not None:
        scores = scores + mask.unsqueeze(1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - _finite_or_zero(lse).unsqueeze(-1))
    out = p @ v.float().unsqueeze(2)
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of partial attentions ``(out [..., D], lse [...])`` over disjoint key sets."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    ref = _finite_or_zero(lse)
    out = sum(torch.exp(p[1] - ref).unsqueeze(-1) * p[0] for p in parts)
    return out, lse


# ---------------------------------------------------------------------------------------------------- INT2 body, CPU
BODY_BLOCK_TOKENS = 512


def _dequantize_rotated_block(stream, t0: int, t1: int) -> torch.Tensor:
    """Body tokens ``[t0, t1)`` of one stream in the rotated space (norms applied), fp32 [B, H, t1 - t0, D]."""
    g = stream.group if stream.layout.axis == "channel" else 1
    a0, a1 = (t0 // g) * g, -(-t1 // g) * g  # per-channel scales cover whole groups of tokens: the aligned span
    q = QuantizedGroups(stream.codes.view()[:, :, a0:a1], stream.scale.view()[:, :, a0 // g:a1 // g],
                        stream.lo.view()[:, :, a0 // g:a1 // g])
    norm = None if stream.norm is None else stream.norm.view()[:, a0:a1]
    return stream.dequantize_groups(q, norm, rotated=True)[:, :, t0 - a0:t1 - a0]


def body_attention_blocked(q_rot, key_body, value_body, *, n_tokens=None, scaling, key_mean_logits=None,
                           mask=None, block_tokens: int = BODY_BLOCK_TOKENS):
    """PyTorch reference of the body partial (same contract as ``hf_kvint2.kernels.body_attention``).

    Dequantizes ``block_tokens`` body tokens at a time (rotated space) and merges blocks by online softmax, so no
    full-precision copy of the body exists. q_rot: [B, Hq, Lq, D] (``q @ R_K``); key_mean_logits: ``q.mu_K``
    [B, Hq, Lq] or None; mask: bool/additive, broadcastable to [B, 1, Lq, n_tokens]. Traceable with static
    ``n_tokens`` (the static caches export it).
    Returns ``(out_rot [B, Hq, Lq, D] fp32, lse [B, Hq, Lq] fp32)``.
    """
    b, hq, lq, d = q_rot.shape
    n = key_body.codes.rows if n_tokens is None else n_tokens
    hkv = key_body.codes.view().shape[1]
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
        k = _dequantize_rotated_block(key_body, t0, t1)
        s = q5 @ k.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, g, Lq, t]
        if bias is not None:
            s = s + bias
        if add is not None:
            s = s + add[..., t0:t1].unsqueeze(1)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_ref = _finite_or_zero(m_new)
        p = torch.exp(s - m_ref)
        alpha = torch.exp(m - m_ref)
        v = _dequantize_rotated_block(value_body, t0, t1)
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + p @ v.unsqueeze(2)
        m = m_new
    out = torch.where(l > 0, acc / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(acc))
    lse = torch.where(l > 0, m + torch.log(l), torch.full_like(l, float("-inf")))
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def body_attention_cpu(q_rot, key_body, value_body, *, n_tokens=None, scaling, key_mean_logits=None, mask=None):
    """The body partial on CPU: the Numba kernel when installed (``pip install '.[cpu]'`` in a clone), else the blocked
    PyTorch path. ``HF_KVINT2_CPU_KERNEL=torch`` forces the PyTorch path."""
    if os.environ.get("HF_KVINT2_CPU_KERNEL", "numba") != "torch":
        from . import cpu_kernels

        if cpu_kernels.available():
            return cpu_kernels.body_attention(q_rot, key_body, value_body, n_tokens=n_tokens, scaling=scaling,
                                              key_mean_logits=key_mean_logits, mask=mask)
    return body_attention_blocked(q_rot, key_body, value_body, n_tokens=n_tokens, scaling=scaling,
                                  key_mean_logits=key_mean_logits, mask=mask)


def body_attention(q_rot, key_body, value_body, **kwargs):
    """Dispatch: Triton kernel for CUDA tensors when available, CPU path otherwise."""
    if q_rot.is_cuda:
        from . import kernels

        if kernels.kernels_enabled_for(q_rot):
            return kernels.body_attention(q_rot, key_body, value_body, **kwargs)
        return body_attention_blocked(q_rot, key_body, value_body, **kwargs)
    return body_attention_cpu(q_rot, key_body, value_body, **kwargs)


# ---------------------------------------------------------------------------------------------------- attention
def fused_step_attention(query: torch.Tensor, step: LayerStep, attention_mask: torch.Tensor | None,
                         scaling: float, is_causal: bool) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over one layer step, body read from codes. Returns [B, Hq, Lq, D]."""
    layer = step.layer
    _b, hq, lq, _d = query.shape
    hkv = layer.num_heads
    groups = hq // hkv
    n_sink, n_body, total = step.sink_k.shape[-2], step.body_tokens, step.seq_len
    if attention_mask is None and is_causal and lq > 1:  # SDPA's is_causal: top-left aligned
        attention_mask = torch.ones(lq, total, dtype=torch.bool, device=query.device).tril()[None, None]
    mask = mask_to_additive(attention_mask[..., :total]) if attention_mask is not None else None

    def cols(a, z):
        return None if mask is None else mask[..., a:z]

    qf = query.float()
    parts = []
    if n_sink:
        parts.append(dense_partial(qf, step.sink_k, step.sink_v, scaling, cols(0, n_sink)))
    kb, vb = layer.key_body, layer.value_body
    out_rot, lse = body_attention(qf @ kb.rotation, kb, vb, n_tokens=n_body, scaling=scaling,
                                  key_mean_logits=kb.mean_logits(qf, groups), mask=cols(n_sink, n_sink + n_body))
    parts.append((vb.unrotate(out_rot, groups), lse))
    parts.append(dense_partial(qf, step.tail_k, step.tail_v, scaling, cols(n_sink + n_body, total)))
    out, _ = merge_partials(parts)
    return out.to(query.dtype)


def oscar_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"oscar"``: fused INT2 attention on an Oscar cache, SDPA otherwise."""
    # Static caches (hf_kvint2.static_cache): a layer bound to this module by hf_kvint2.export (key/value are the
    # step's chunk; the traceable route for torch.export / torch.compile), or an eager step behind DeferredKV.
    static = getattr(module, "oscar_static_layer", None)
    if static is not None or (isinstance(key, DeferredKV) and hasattr(key.step, "attend")):
        return _static_attention_forward(module, static, query, key, value, attention_mask, dropout, scaling,
                                         **kwargs)
    if not isinstance(key, DeferredKV):
        last = _last_update
        if last is not None and last[1]() is key and last[0]() is not None:
            last[0]().fused_attention = True  # this layer is read by "oscar": defer its views from now on
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    step = key.step
    if step.body_tokens == 0 or _sdpa_only_features(dropout, attention_mask, kwargs) or \
            not isinstance(value, DeferredKV):
        # No INT2 tokens to read (early steps, fresh prefill) or a feature only SDPA has: plain SDPA on the view.
        return _sdpa_on_view(module, step, query, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = fused_step_attention(query, step, attention_mask, scaling, causal)
    return out.transpose(1, 2).contiguous(), None


def _sdpa_only_features(dropout: float, attention_mask: torch.Tensor | None, kwargs: dict) -> list[str]:
    """Attention features the fused paths do not implement (SDPA does); empty if none is asked for."""
    found = [name for name in ("softcap", "position_bias", "s_aux", "sinks") if kwargs.get(name) is not None]
    if dropout > 0:
        found.append("dropout")
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1:
        found.append("per-head masks")
    return found


def _sdpa_on_view(module, step, query, value, attention_mask, **sdpa_kwargs):
    """Plain SDPA on the step's full-precision view (released right after)."""
    k, v = step.materialize()
    out = sdpa_attention_forward(module, query, k, value if not isinstance(value, DeferredKV) else v,
                                 attention_mask, **sdpa_kwargs)
    step._full = None
    return out


def _static_attention_forward(module, bound, query, key, value, attention_mask, dropout, scaling, **kwargs):
    unsupported = _sdpa_only_features(dropout, attention_mask, kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if bound is None:
        step = key.step
        if unsupported:  # a feature only SDPA has: SDPA on the portable view
            return _sdpa_on_view(module, step, query, value, attention_mask, dropout=dropout, scaling=scaling,
                                 **kwargs)
        out = step.attend(query, attention_mask, scaling)
    else:
        if unsupported:
            raise ValueError(f"The static Oscar attention does not support {', '.join(unsupported)}; export this "
                             "model with transformers' StaticCache instead.")
        out = bound.attend(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"oscar"`` with transformers (idempotent; done on ``import hf_kvint2``)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, oscar_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()  # importing this module (which imports transformers' model code) makes "oscar" available

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DeferredKV",
    "LayerStep",
    "body_attention",
    "body_attention_blocked",
    "body_attention_cpu",
    "dense_partial",
    "fused_step_attention",
    "merge_partials",
    "oscar_attention_forward",
    "register",
]
