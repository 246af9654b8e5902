"""Static (fixed-shape) Oscar caches for ``torch.export``, ``torch.compile`` and ONNX (issue 6).

Same numerics as :class:`~hf_kvint2.layers.OscarLayer`: the first ``S = sink_tokens`` positions stay in a
full-precision sink; later tokens enter a full-precision recent window and leave it into the INT2 body in blocks
of ``recipe.demotion_block`` (1 for per-token layouts, the token group of per-channel layouts), quantized once
with :meth:`QuantizedStream.transform` and the same INT2 formula. Because per-token groups are per token and
per-channel groups are aligned blocks counted from the end of the sink, quantizing a block when it leaves the
window gives the codes the dynamic layer stores, however the tokens were chunked.

Everything the layer holds is pre-allocated for ``max_cache_len`` and written in place at positions computed
from tensors, so a decode step has static shapes and no data-dependent Python control flow:

``sink_k/v [B, H, S, D]``
    model dtype, position ``j < S`` in slot ``j``.
``ring_k/v [B, H, R, D]``
    model dtype, ``R = recent_tokens + block``; position ``j >= S`` in slot ``(j - S) % R``. The window holds
    ``recent_tokens .. recent_tokens + block - 1`` tokens after a step, ``recent_tokens + block`` during it.
``<stream>_codes [B, H, N, D/4]`` uint8, ``<stream>_scale/_lo`` (``[B, H, N, D/G]`` per token,
``[B, H, N/G, D]`` per channel), ``<stream>_norm [B, N]`` (token scaling)
    body index ``i`` holds position ``S + i``; ``N`` is ``max_cache_len - S`` rounded up to the attention block.

Which positions are in the body is a function of the position alone (``body_len`` below), so validity masks
come from ``cache_position``; nothing records lengths except ``cumulative_length`` (as in transformers'
``StaticLayer``). A 1-token step always quantizes the candidate block (the oldest ``block`` tokens of the
window) and writes it with ``torch.where`` on a "block completed" flag: branch-free, exportable.

Attention (:meth:`StaticOscarLayer.attend`, used by the ``"oscar"`` attention) reads the body block by block
(:func:`hf_kvint2.attention.body_attention_blocked`: unpack + dequantize ``attention_block`` tokens in the
rotated space, online softmax), plus the sink, the past part of the ring and the current chunk at full
precision, merged by log-sum-exp and de-rotated once. Numba/Triton kernels are not used (not traceable).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import attention as _attention
from .attention import (
    DeferredKV,
    body_attention_blocked,
    dense_partial,
    mask_to_additive,
    merge_partials,
    warn_portable_path_once,
)
from .layers import OscarLayer, QuantizedStream, validate_kv
from .quant import SCALE_DTYPES, QuantizedGroups
from .quant import tracing as _tracing
from .recipes import LayerRecipe

ATTENTION_BLOCK_TOKENS = 512
STATIC_FIX = "Build the static cache (or export) for the model, batch and dtype you run."
_NEG_INF = float("-inf")


def body_len(tokens_past_sink, recent_tokens: int, block: int):
    """Body tokens held once ``tokens_past_sink`` tokens followed the sink: the largest multiple of ``block`` that
    leaves at least ``recent_tokens`` in the window (what :class:`OscarLayer` holds after any sequence of updates).
    Works on ints and on integer tensors."""
    if isinstance(tokens_past_sink, torch.Tensor):
        return (tokens_past_sink - recent_tokens).clamp(min=0) // block * block
    return max(tokens_past_sink - recent_tokens, 0) // block * block


class _View:
    """Adapter giving a static tensor the ``.view()`` of a :class:`~hf_kvint2.storage.TokenBuffer`."""

    __slots__ = ("data",)

    def __init__(self, data: torch.Tensor):
        self.data = data

    def view(self) -> torch.Tensor:
        return self.data

    @property
    def rows(self) -> int:
        return self.data.shape[2]


class _StreamView:
    """What :func:`body_attention_blocked` reads of a stream (layout, group, codes, scales, norms, and its
    dequantization), over the static buffers of one stream."""

    def __init__(self, stream: QuantizedStream, codes, scale, lo, norm):
        self.layout, self.group = stream.layout, stream.group
        self.dequantize_groups = stream.dequantize_groups
        self.codes, self.scale, self.lo = _View(codes), _View(scale), _View(lo)
        self.norm = None if norm is None else _View(norm)


class StaticStep:
    """One eager forward of a :class:`StaticOscarLayer` seen through :class:`~hf_kvint2.attention.DeferredKV`
    placeholders: the ``"oscar"`` attention calls :meth:`attend`; any other implementation gets
    :meth:`materialize` (the portable full view)."""

    __slots__ = ("__weakref__", "_full", "body_tokens", "key_states", "layer", "value_states")

    def __init__(self, layer: StaticOscarLayer, key_states, value_states, body_tokens: int):
        self.layer, self.key_states, self.value_states = layer, key_states, value_states
        self.body_tokens = body_tokens
        self._full = None

    @property
    def tail_k(self) -> torch.Tensor:  # DeferredKV.make takes batch, heads, dtype and device from it
        return self.key_states

    @property
    def seq_len(self) -> int:
        return self.layer.max_cache_len

    def materialize(self):
        if self._full is None:
            self._full = self.layer.full_view(self.key_states, self.value_states)
        return self._full

    def attend(self, query, attention_mask, scaling):
        return self.layer.attend(query, self.key_states, self.value_states, attention_mask, scaling)


class StaticOscarLayer(CacheLayerMixin):
    """Fixed-shape cache layer with :class:`OscarLayer` numerics (see the module docstring for the storage).

    ``attention_block``: body tokens dequantized at a time by the attention (rounded to the demotion block);
    it bounds the largest full-precision temporary of a step. A step reads the whole body capacity block by
    block (masked beyond the stored tokens): static shapes cost work proportional to ``max_cache_len``.
    """

    is_sliding = False
    is_croppable = False
    is_compileable = True

    def __init__(self, recipe: LayerRecipe, max_cache_len: int, layer_idx: int | None = None,
                 attention_block: int = ATTENTION_BLOCK_TOKENS):
        super().__init__()
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}.")
        if recipe.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {recipe.scale_dtype}.")
        self.recipe, self.max_cache_len, self.layer_idx = recipe, max_cache_len, layer_idx
        self.sink = min(recipe.sink_tokens, max_cache_len)
        self.window = recipe.recent_tokens
        self.block = recipe.demotion_block
        self.ring_size = self.window + self.block
        body_positions = max(max_cache_len - self.sink, 1)
        align = self.block
        self.attention_block = align * max(1, min(attention_block // align, -(-body_positions // align)))
        self.body_capacity = -(-body_positions // self.attention_block) * self.attention_block
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.fused_attention = False  # set by the "oscar" attention in eager mode (see hf_kvint2.attention)
        self.bound = False  # set by hf_kvint2.export.bind_static_cache: update returns the chunk itself
        self.functional = False  # writes out of place (ONNX: state as graph inputs/outputs)
        self._ring_snapshot = None

    def __repr__(self):
        return (f"StaticOscarLayer(idx={self.layer_idx}, key={self.recipe.key}, value={self.recipe.value}, "
                f"sink={self.sink}, recent={self.window}, block={self.block}, max_cache_len={self.max_cache_len})")

    @property
    def _name(self) -> str:
        return f"layer {self.layer_idx}" if self.layer_idx is not None else "this static cache layer"

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # The dynamic layer's initialization builds and checks the rotations, means and group sizes.
        proto = OscarLayer(self.recipe, self.layer_idx)
        proto.lazy_initialization(key_states, value_states)
        self.key_stream, self.value_stream = proto.key_body, proto.value_body
        # Fixed shapes and traced steps that quantize incomplete candidate blocks: keep the given basis and layout
        # (the dynamic layer settles them from its first demoted tokens, see QuantizedStream.settle_basis).
        self.key_stream.adaptive_basis = self.value_stream.adaptive_basis = False
        b, h, _, d = key_states.shape
        self.batch_size, self.num_heads, self.head_dim = b, h, d
        self.dtype, self.device = key_states.dtype, key_states.device
        self.max_batch_size = b
        fp = {"dtype": self.dtype, "device": self.device}
        self.sink_k = torch.zeros(b, h, self.sink, d, **fp) if self.sink else None
        self.sink_v = torch.zeros(b, h, self.sink, d, **fp) if self.sink else None
        self.ring_k = torch.zeros(b, h, self.ring_size, d, **fp)
        self.ring_v = torch.zeros(b, h, self.ring_size, d, **fp)
        n = self.body_capacity
        for prefix, stream in (("key", self.key_stream), ("value", self.value_stream)):
            sd = {"dtype": stream.scale_dtype, "device": self.device}
            g = stream.group
            if stream.layout.axis == "channel" and n % g:
                raise ValueError(f"{self._name}: body capacity {n} is not a multiple of the {prefix} group {g}.")
            rows, cols = (n, d // g) if stream.layout.axis == "token" else (n // g, d)
            setattr(self, f"{prefix}_codes", torch.zeros(b, h, n, d // 4, dtype=torch.uint8, device=self.device))
            setattr(self, f"{prefix}_scale", torch.zeros(b, h, rows, cols, **sd))
            setattr(self, f"{prefix}_lo", torch.zeros(b, h, rows, cols, **sd))
            setattr(self, f"{prefix}_norm", torch.zeros(b, n, **sd) if stream.norm is not None else None)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not _tracing():
            for t in self.state_tensors():
                torch._dynamo.mark_static_address(t)
            torch._dynamo.mark_static_address(self.cumulative_length)
        self.is_initialized = True

    def state_names(self) -> list[str]:
        """Names of the tensors that make up the layer's state, in a fixed order (the ONNX graph's state)."""
        names = ["sink_k", "sink_v"] if self.sink else []
        names += ["ring_k", "ring_v"]
        for prefix, stream in (("key", self.key_stream), ("value", self.value_stream)):
            names += [f"{prefix}_codes", f"{prefix}_scale", f"{prefix}_lo"]
            if stream.norm is not None:
                names.append(f"{prefix}_norm")
        return names

    def state_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self.state_names()]

    def _write(self, name: str, dim: int, index: torch.Tensor, value: torch.Tensor) -> None:
        """``index_copy`` into a state tensor: in place (buffers), or out of place in functional mode."""
        t = getattr(self, name)
        value = value.to(t.dtype)
        if self.functional:
            setattr(self, name, t.index_copy(dim, index, value))
        else:
            t.index_copy_(dim, index, value)

    def _write_where(self, name: str, dim: int, index: torch.Tensor, value: torch.Tensor, flag: torch.Tensor):
        """Write ``value`` at ``index`` where ``flag`` holds, else write back what is there (branch-free)."""
        old = getattr(self, name).index_select(dim, index)
        self._write(name, dim, index, torch.where(flag, value.to(old.dtype), old))

    # ------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        validate_kv(self, key_states, value_states, fix=STATIC_FIX)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache_position = _cache_position_from(args, kwargs)
        if cache_position is not None:  # transformers < 5.24 passes positions; later versions use cumulative_length
            start = cache_position.reshape(-1)[:1].to(self.cumulative_length.device).reshape(())
            self._set_length(start)
        n_new = key_states.shape[-2]
        if n_new == 1:
            self._update_one(key_states, value_states)
        else:
            self._update_chunk(key_states, value_states)
        if self.bound:  # the "oscar" attention reads this layer directly; key/value carry only the chunk
            return key_states, value_states
        if not _tracing() and self.fused_attention:
            step = StaticStep(self, key_states, value_states, self._body_tokens_now())
            return DeferredKV.make(step, 0), DeferredKV.make(step, 1)
        keys, values = self.full_view(key_states, value_states)
        if not _tracing():
            if self._body_tokens_now():
                warn_portable_path_once()
            _attention._last_update = (weakref.ref(self), weakref.ref(keys))
        return keys, values

    def _set_length(self, value: torch.Tensor) -> None:
        if self.functional:
            self.cumulative_length = value.to(torch.long).reshape(())
        else:
            self.cumulative_length.copy_(value)

    def _body_tokens_now(self) -> int:
        end = int(self.cumulative_length)
        return body_len(end - self.sink, self.window, self.block)

    def _write_body(self, prefix: str, stream: QuantizedStream, q: QuantizedGroups, norm, start, n: int,
                    flag: torch.Tensor | None = None) -> None:
        """Write ``n`` quantized tokens at body index ``start`` (a multiple of the block); ``flag``: only if set."""
        dev = self.device
        idx = start + torch.arange(n, device=dev)
        if stream.layout.axis == "channel":
            g = stream.group
            rows = start // g + torch.arange(n // g, device=dev)
        else:
            rows = idx
        pieces = [(f"{prefix}_codes", 2, idx, q.codes), (f"{prefix}_scale", 2, rows, q.scale),
                  (f"{prefix}_lo", 2, rows, q.lo)]
        if norm is not None:
            pieces.append((f"{prefix}_norm", 1, idx, norm))
        for name, dim, index, value in pieces:
            if flag is None:
                self._write(name, dim, index, value)
            else:
                self._write_where(name, dim, index, value, flag)

    def _update_one(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A 1-token step at position ``p = cumulative_length``: branch-free (the exported/compiled step)."""
        s, w, blk, r = self.sink, self.window, self.block, self.ring_size
        dev = self.device
        p = self.cumulative_length.reshape(1)
        if not _tracing() and int(p) >= self.max_cache_len:
            raise ValueError(f"{self._name}: cache position {int(p)} is beyond max_cache_len="
                             f"{self.max_cache_len}; build the static cache with a larger max_cache_len.")
        # The candidate block: window positions [p + 1 - w - blk, p + 1 - w), complete when the window reaches
        # w + blk tokens. With w == 0 its last token is the current one (not yet in the ring).
        n_after = p + 1 - s  # tokens past the sink after this step
        flag = ((n_after - w) >= blk) & ((n_after - w) % blk == 0)
        first = p + 1 - w - blk
        slots = (first - s + torch.arange(blk, device=dev)) % r
        src_k, src_v = self.ring_k.index_select(2, slots), self.ring_v.index_select(2, slots)
        if w == 0:
            src_k = torch.cat([src_k[:, :, :-1], key_states], dim=2)
            src_v = torch.cat([src_v[:, :, :-1], value_states], dim=2)
        qk, nk = self.key_stream.quantize(src_k)
        qv, nv = self.value_stream.quantize(src_v)
        start = (first - s).clamp(0, self.body_capacity - blk)
        if s:
            in_sink = (p < s).reshape(1, 1, 1, 1)
            self._write_where("sink_k", 2, p.clamp(max=s - 1), key_states, in_sink)
            self._write_where("sink_v", 2, p.clamp(max=s - 1), value_states, in_sink)
        slot = (p - s) % r
        past_sink = (p >= s).reshape(1, 1, 1, 1)
        self._write_where("ring_k", 2, slot, key_states, past_sink)
        self._write_where("ring_v", 2, slot, value_states, past_sink)
        start = start.reshape(())
        self._write_body("key", self.key_stream, qk, nk, start, blk, flag)
        self._write_body("value", self.value_stream, qv, nv, start, blk, flag)
        self._ring_snapshot = None
        self._set_length(self.cumulative_length + 1)

    def _update_chunk(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Several tokens (prefill) in eager mode: positions are known, so Python decides what goes where."""
        if _tracing():
            raise RuntimeError(f"{self._name}: the exported/compiled step of a static Oscar cache takes one token at "
                               "a time; prefill the prompt eagerly or feed it token by token through the program.")
        s, w, blk, r = self.sink, self.window, self.block, self.ring_size
        p0 = int(self.cumulative_length)
        n_new = key_states.shape[-2]
        p1 = p0 + n_new
        if p1 > self.max_cache_len:
            raise ValueError(f"{self._name}: positions {p0}..{p1 - 1} go beyond max_cache_len={self.max_cache_len}; "
                             "build the static cache with a larger max_cache_len.")
        self._ring_snapshot = (self.ring_k.clone(), self.ring_v.clone())  # the attention reads past ring tokens
        b0, b1 = body_len(p0 - s, w, blk), body_len(p1 - s, w, blk)
        writes = []
        if b1 > b0:  # demote positions [s + b0, s + b1): from the ring (before p0) and from the chunk
            ring_pos = list(range(s + b0, min(s + b1, p0)))
            chunk_pos = list(range(max(s + b0, p0), s + b1))
            parts_k, parts_v = [], []
            if ring_pos:
                slots = torch.tensor([(j - s) % r for j in ring_pos], device=self.device)
                parts_k.append(self.ring_k.index_select(2, slots))
                parts_v.append(self.ring_v.index_select(2, slots))
            if chunk_pos:
                parts_k.append(key_states[:, :, chunk_pos[0] - p0:chunk_pos[-1] + 1 - p0])
                parts_v.append(value_states[:, :, chunk_pos[0] - p0:chunk_pos[-1] + 1 - p0])
            src_k, src_v = torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)
            qk, nk = self.key_stream.quantize(src_k)  # raises before anything is written
            qv, nv = self.value_stream.quantize(src_v)
            writes.append((qk, nk, qv, nv, b0, b1 - b0))
        if p0 < s:
            n = min(p1, s) - p0
            idx = torch.arange(p0, p0 + n, device=self.device)
            self._write("sink_k", 2, idx, key_states[:, :, :n])
            self._write("sink_v", 2, idx, value_states[:, :, :n])
        first = max(p0, s, p1 - r)
        if first < p1:
            slots = torch.tensor([(j - s) % r for j in range(first, p1)], device=self.device)
            self._write("ring_k", 2, slots, key_states[:, :, first - p0:])
            self._write("ring_v", 2, slots, value_states[:, :, first - p0:])
        for qk, nk, qv, nv, start, n in writes:
            self._write_body("key", self.key_stream, qk, nk, start, n)
            self._write_body("value", self.value_stream, qv, nv, start, n)
        self._set_length(self.cumulative_length + n_new)

    # ------------------------------------------------------------------ reading
    def _step_geometry(self, n_new: int):
        """Positions of the step that just ran: its first position ``p0`` and the body length ``b1`` after it."""
        end = self.cumulative_length
        p0 = end - n_new
        b1 = body_len(end - self.sink, self.window, self.block)
        return p0, b1

    def attend(self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [B, Hq, L, D] for the step that just stored ``key_states``/``value_states``
        (its chunk, attended at full precision). ``attention_mask``: the model's mask over ``max_cache_len``
        columns (absolute positions; bool or additive) or None (causal). Returns [B, Hq, L, D]."""
        _b, hq, lq, _d = query.shape
        s, r, n = self.sink, self.ring_size, self.body_capacity
        groups = hq // self.num_heads
        dev = query.device
        p0, b1 = self._step_geometry(lq)
        add = mask_to_additive(attention_mask)
        if add is not None:
            add = add[..., : self.max_cache_len]
            if add.shape[-1] < self.max_cache_len:
                raise ValueError(f"{self._name}: the attention mask has {add.shape[-1]} columns, expected "
                                 f"max_cache_len={self.max_cache_len} (static cache masks cover every slot).")

        def columns(valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            """Additive mask [B|1, 1, L|1, k] for keys at ``positions`` (clamped into range) valid where ``valid``."""
            out = torch.where(valid, 0.0, _NEG_INF).to(torch.float32)[None, None, None, :]
            if add is not None:
                out = out + add.index_select(-1, positions.clamp(0, self.max_cache_len - 1))
            return out

        qf = query.float()
        parts = []
        if s:
            pos = torch.arange(s, device=dev)
            parts.append(dense_partial(qf, self.sink_k, self.sink_v, scaling, columns(pos < p0, pos)))
        kb, vb = self.key_stream, self.value_stream
        pos = s + torch.arange(n, device=dev)
        body_mask = columns((pos < s + b1) & (pos < p0), pos)
        kview = _StreamView(kb, self.key_codes, self.key_scale, self.key_lo, self.key_norm)
        vview = _StreamView(vb, self.value_codes, self.value_scale, self.value_lo, self.value_norm)
        out_rot, lse = body_attention_blocked(qf @ kb.rotation, kview, vview, n_tokens=n, scaling=scaling,
                                              key_mean_logits=kb.mean_logits(qf, groups), mask=body_mask,
                                              block_tokens=self.attention_block)
        parts.append((vb.unrotate(out_rot, groups), lse))
        ring_k, ring_v = self._ring_snapshot if self._ring_snapshot is not None else (self.ring_k, self.ring_v)
        slot = torch.arange(r, device=dev)
        last = p0 - 1  # newest past position; slot i holds the newest past position j with (j - s) % r == i
        pos = last - (last - s - slot) % r
        parts.append(dense_partial(qf, ring_k, ring_v, scaling, columns((pos >= s + b1) & (pos >= s), pos)))
        cpos = p0 + torch.arange(lq, device=dev)
        if add is not None:
            chunk_mask = add.index_select(-1, cpos.clamp(0, self.max_cache_len - 1))
        else:  # causal within the chunk
            chunk_mask = torch.zeros(lq, lq, device=dev).masked_fill_(
                torch.ones(lq, lq, dtype=torch.bool, device=dev).triu(1), _NEG_INF)[None, None]
        parts.append(dense_partial(qf, key_states, value_states, scaling, chunk_mask))
        out, _ = merge_partials(parts)
        return out.to(query.dtype)

    def full_view(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Portable path: every slot ``[B, H, max_cache_len, D]`` by absolute position (body dequantized and
        de-rotated, the chunk at full precision, unwritten positions zero), for SDPA-style attention with the
        model's mask. Slow: it dequantizes the whole body."""
        lq = key_states.shape[-2]
        s, r, m = self.sink, self.ring_size, self.max_cache_len
        dev = key_states.device
        p0, b1 = self._step_geometry(lq)
        pos = torch.arange(m, device=dev)
        ring_k, ring_v = self._ring_snapshot if self._ring_snapshot is not None else (self.ring_k, self.ring_v)
        ring_slots = (pos - s) % r
        chunk_idx = (pos - p0).clamp(0, lq - 1)
        body_idx = (pos - s).clamp(0, self.body_capacity - 1)
        in_sink = (pos < s) & (pos < p0)
        in_body = (pos >= s) & (pos < s + b1) & (pos < p0)
        in_ring = (pos >= s) & (pos >= s + b1) & (pos < p0)
        in_chunk = (pos >= p0) & (pos < p0 + lq)
        outs = []
        for chunk, ring, sink, stream, prefix in ((key_states, ring_k, self.sink_k, self.key_stream, "key"),
                                                  (value_states, ring_v, self.sink_v, self.value_stream, "value")):
            q = QuantizedGroups(getattr(self, f"{prefix}_codes"), getattr(self, f"{prefix}_scale"),
                                getattr(self, f"{prefix}_lo"))
            body = stream.dequantize_groups(q, getattr(self, f"{prefix}_norm"))
            x = chunk.index_select(2, chunk_idx)
            x = torch.where(in_chunk[:, None], x, torch.zeros_like(x))
            x = torch.where(in_ring[:, None], ring.index_select(2, ring_slots), x)
            x = torch.where(in_body[:, None], body.index_select(2, body_idx).to(x.dtype), x)
            if s:
                x = torch.where(in_sink[:, None], sink.index_select(2, pos.clamp(max=s - 1)), x)
            outs.append(x)
        return outs[0], outs[1]

    # ------------------------------------------------------------------ transformers contract
    def get_seq_length(self):
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            for t in self.state_tensors():
                t.zero_()
        self.cumulative_length.zero_()
        self._ring_snapshot = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(f"{self._name}: a static Oscar cache cannot be cropped (tokens that left the "
                             "full-precision window are quantized and their full-precision slots reused). Use "
                             "OscarCache / OscarScaledCache for assisted or prompt-lookup decoding.")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder batch rows in place (buffers keep their addresses)."""
        if self.is_initialized:
            for t in self.state_tensors():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError(f"{self._name}: a static cache has a fixed batch size; build it for batch "
                         f"{self.batch_size * repeats} instead of repeating it.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError(f"{self._name}: a static cache has a fixed batch size; build it for the batch you run.")

    def offload(self):
        raise ValueError("A static Oscar cache does not support offloading.")

    def prefetch(self):
        pass

    def memory_bytes(self) -> dict[str, int]:
        """Bytes allocated, by kind (static: the same at every step)."""
        out = {"codes": 0, "scales": 0, "norms": 0, "full_precision": 0}
        if not self.is_initialized:
            return out
        for name in self.state_names():
            t = getattr(self, name)
            kind = ("codes" if name.endswith("codes") else "norms" if name.endswith("norm")
                    else "scales" if name.endswith(("scale", "_lo")) else "full_precision")
            out[kind] += t.numel() * t.element_size()
        return out


def _cache_position_from(args, kwargs) -> torch.Tensor | None:
    """transformers < 5.24 passes ``cache_kwargs={"cache_position": ...}`` to ``update``."""
    for candidate in (*args, kwargs.get("cache_kwargs")):
        if isinstance(candidate, dict) and isinstance(candidate.get("cache_position"), torch.Tensor):
            return candidate["cache_position"]
    return None


class StaticOscarCache(Cache):
    """A transformers ``Cache`` of :class:`StaticOscarLayer` s, one per full-attention layer, with the recipes of an
    :class:`~hf_kvint2.OscarCache` or :class:`~hf_kvint2.OscarScaledCache`.

    ``StaticOscarCache.from_cache(cache, config, max_cache_len)`` takes the recipes (rotations, clips, means,
    per-layer layouts, windows) of a dynamic cache, e.g. ``OscarCache.from_pretrained(...)``. Layers are allocated
    at the first ``update`` or by ``early_initialization(batch_size, kv_heads, head_dim, dtype, device)`` (needed
    before ``torch.export``). Positions come from ``cumulative_length`` (transformers >= 5.24) or the
    ``cache_position`` that older versions pass to ``update``.
    """

    def __init__(self, recipe_for_layer: Callable[[int], LayerRecipe], config, max_cache_len: int,
                 attention_block: int = ATTENTION_BLOCK_TOKENS):
        from .cache import _layer_types

        if config is None:
            raise ValueError("StaticOscarCache needs the model config (config=model.config) to size its layers.")
        layers = []
        for idx, layer_type in enumerate(_layer_types(config)):
            if layer_type != "full_attention":
                raise ValueError(f"Layer {idx} of this model is of type {layer_type!r}; the static Oscar cache supports "
                                 "full-attention layers only. Use OscarCache (dynamic) for this model.")
            layers.append(StaticOscarLayer(recipe_for_layer(idx), max_cache_len, idx, attention_block))
        self._max_cache_len = max_cache_len
        self.config = config
        super().__init__(layers=layers)

    @property
    def max_cache_len(self) -> int:  # a read-only property of transformers < 5.24's Cache as well
        return self._max_cache_len

    @classmethod
    def from_cache(cls, cache, config, max_cache_len: int, attention_block: int = ATTENTION_BLOCK_TOKENS):
        """The static counterpart of a dynamic ``OscarCache`` / ``OscarScaledCache`` (same per-layer recipes)."""
        if isinstance(cache, StaticOscarCache):
            raise TypeError("from_cache takes a dynamic OscarCache / OscarScaledCache; this one is already static.")
        recipe_for_layer = getattr(cache, "_recipe_for_layer", None)
        if recipe_for_layer is None:
            raise ValueError(f"Cannot build a static Oscar cache from {type(cache).__name__}; pass an OscarCache or "
                             "OscarScaledCache.")
        if getattr(cache, "shard", None) is not None:
            raise ValueError("Static Oscar caches do not support tensor parallelism; export the unsharded model.")
        info = getattr(cache, "artifact_info", None) or {}
        n = config.get_text_config(decoder=True).num_hidden_layers
        if info.get("num_layers") not in (None, n):
            raise ValueError(f"The calibration artifact has num_layers={info['num_layers']} but the model has {n}: "
                             "load the artifact calibrated for this model.")
        return cls(recipe_for_layer, config, max_cache_len, attention_block)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} is beyond the {len(self.layers)} layers of this static cache.")
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every layer's state tensors, layer by layer in ``state_names`` order (the ONNX graph's state)."""
        return [t for layer in self.layers for t in layer.state_tensors()]

    def memory_report(self) -> dict:
        """Bytes allocated per layer and in total, by kind (codes, scales, norms, full_precision)."""
        layers = [dict(layer.memory_bytes(), layer=i) for i, layer in enumerate(self.layers)]
        total = {k: sum(row[k] for row in layers) for k in ("codes", "scales", "norms", "full_precision")}
        total["total_bytes"] = sum(total.values())
        return {"layers": layers, "total": total}


def static_cache_like(cache, config, max_cache_len: int, attention_block: int = ATTENTION_BLOCK_TOKENS):
    """``cache`` if it is already a :class:`StaticOscarCache`, else its static counterpart."""
    if isinstance(cache, StaticOscarCache):
        if cache.max_cache_len != max_cache_len:
            raise ValueError(f"The static cache holds {cache.max_cache_len} positions but max_cache_len={max_cache_len} "
                             "was asked for.")
        return cache
    return StaticOscarCache.from_cache(cache, config, max_cache_len, attention_block)


__all__ = ["ATTENTION_BLOCK_TOKENS", "StaticOscarCache", "StaticOscarLayer", "StaticStep", "body_len",
           "static_cache_like"]
