"""The static (fixed-shape) Oscar cache layer for ``torch.export``, ``torch.compile`` and ONNX.

(About 440 lines on purpose: the slot arithmetic of the storage, the branch-free writes and the reads must agree
position for position, so they stay in one class.)

Same numerics as :class:`~hf_kvint2.layers.OscarLayer`: the first ``S = sink_tokens`` positions stay in a
full-precision sink; later tokens enter a full-precision recent window and leave it into the INT2 body in blocks
of ``recipe.demotion_block`` (1 for per-token layouts, the token group of per-channel layouts), quantized once
with :meth:`StreamCodec.quantize <hf_kvint2.stream.StreamCodec.quantize>` (the dynamic layer's write path). Because per-token groups are per token and
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
(:func:`hf_kvint2.read_path.body_partial_blocked`: unpack + dequantize ``attention_block`` tokens in the
rotated space, online softmax), plus the sink, the past part of the ring and the current chunk at full
precision, merged by log-sum-exp and de-rotated once: the shared pipeline
:func:`hf_kvint2.read_path.attend_segments`. Numba/Triton kernels are not used (not traceable).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .layers import QUANTIZE_BLOCK_TOKENS, OscarLayer, validate_kv, write_path_inputs
from .quant import SCALE_DTYPES, QuantizedGroups, to_model_dtype
from .quant import tracing as _tracing
from .read_path import BODY_BLOCK_TOKENS, TORCH_BODY, attend_segments, step_mask
from .recipes import LayerRecipe
from .steps import StaticStep
from .stream import QuantizedBody, StreamCodec

STATIC_FIX = "Build the static cache (or export) for the model, batch and dtype you run."


def body_len(tokens_past_sink, recent_tokens: int, block: int):
    """Body tokens held once ``tokens_past_sink`` tokens followed the sink: the largest multiple of ``block`` that
    leaves at least ``recent_tokens`` in the window (what :class:`OscarLayer` holds after any sequence of updates).
    Works on ints and on integer tensors."""
    if isinstance(tokens_past_sink, torch.Tensor):
        return (tokens_past_sink - recent_tokens).clamp(min=0) // block * block
    return max(tokens_past_sink - recent_tokens, 0) // block * block


class FixedShapeLayerMixin:
    """What every fixed-shape (static, exportable) layer does alike: beam reordering in place, and clear refusals
    of the batch changes and offloading its preallocated buffers cannot follow, and the model's mask read over its
    slots. Needs ``state_tensors()``, ``is_initialized``, ``batch_size``, ``max_cache_len`` and ``_name``."""

    def _init_fixed_shape_state(self) -> None:
        """The position counter and the flags that hf_kvint2.export and the "oscar" attention set."""
        self.cumulative_length = torch.tensor(0, dtype=torch.long)
        self.fused_attention = False  # set by the "oscar" attention in eager mode (see hf_kvint2.steps)
        self.bound = False  # set by hf_kvint2.export.bind_static_cache: update returns the chunk itself
        self.functional = False  # writes out of place (ONNX: state as graph inputs/outputs)
        self._ring_snapshot = None

    def _mask_over_slots(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The model's mask over the ``max_cache_len`` absolute positions the cache's slots can hold (None: none)."""
        if attention_mask is None:
            return None
        if attention_mask.shape[-1] < self.max_cache_len:
            raise ValueError(f"{self._name}: the attention mask has {attention_mask.shape[-1]} columns, expected "
                             f"max_cache_len={self.max_cache_len} (static cache masks cover every slot).")
        return attention_mask[..., :self.max_cache_len]

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

    @property
    def keys(self):
        """transformers' ``layer.keys``: None before the first update, then a clear error (see :meth:`_no_tensor`)."""
        return self._no_tensor("keys")

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:  # (CacheLayerMixin.__init__ sets both to None)
            raise NotImplementedError(f"{self._name}: keys cannot be assigned; update() writes the layer's buffers.")

    @property
    def values(self):
        """transformers' ``layer.values``: see :meth:`keys`."""
        return self._no_tensor("values")

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise NotImplementedError(f"{self._name}: values cannot be assigned; update() writes the layer's buffers.")

    def _no_tensor(self, name: str):
        """A static layer's K/V live in fixed-size buffers by slot (a sink, a ring, INT2 codes), not in a tensor by
        position: code that reads ``layer.keys`` would otherwise get None and go on without them."""
        if self.is_initialized:
            raise NotImplementedError(f"{self._name} holds its {name} in fixed-size buffers (state_names(): a sink, a "
                                      "ring, INT2 codes), not as a tensor by position. Read layer.state_tensors() "
                                      "(what an exported program carries), or use transformers' StaticCache for code "
                                      "that reads layer.keys / layer.values.")

    def prefetch(self):
        pass


class StaticOscarLayer(FixedShapeLayerMixin, CacheLayerMixin):
    """Fixed-shape cache layer with :class:`OscarLayer` numerics (see the module docstring for the storage).

    ``attention_block``: body tokens dequantized at a time by the attention (rounded to the demotion block);
    it bounds the largest full-precision temporary of a step. A step reads the whole body capacity block by
    block (masked beyond the stored tokens): static shapes cost work proportional to ``max_cache_len``.
    """

    is_sliding = False
    is_croppable = False
    is_compileable = True
    # The body reader of attend (traceable); hf_kvint2.export_executorch sets another formulation.
    body_backend = TORCH_BODY

    def __init__(self, recipe: LayerRecipe, max_cache_len: int, layer_idx: int | None = None,
                 attention_block: int = BODY_BLOCK_TOKENS):
        super().__init__()
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}.")
        if recipe.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {recipe.scale_dtype}.")
        self.recipe, self.max_cache_len, self.layer_idx = recipe, max_cache_len, layer_idx
        self.sink = min(recipe.sink_tokens, max_cache_len)
        self.window = recipe.recent_tokens
        self.block = recipe.demotion_block
        body_positions = max(max_cache_len - self.sink, 1)
        # Every allocation is bounded by max_cache_len: when the window and one block do not fit in the positions
        # past the sink, no token ever leaves the window (as in OscarLayer), so the ring covers those positions and
        # the body holds one block (written never: the "block completed" flag stays off), or nothing when even one
        # block does not fit. One block keeps the exported graph's shape (the body is state, like other layers').
        demotes = self.window + self.block <= body_positions
        self.ring_size = self.window + self.block if demotes else body_positions
        align = self.block
        self.attention_block = align * max(1, min(attention_block // align, -(-body_positions // align)))
        self.body_capacity = -(-body_positions // self.attention_block) * self.attention_block if demotes else \
            (self.block if self.block <= body_positions else 0)
        self.writes_body = self.body_capacity >= self.block
        self._init_fixed_shape_state()

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
        self.key_codec, self.value_codec = proto.key_body.codec, proto.value_body.codec
        # The codecs as given: fixed shapes and traced steps that quantize incomplete candidate blocks keep the
        # Hadamard / per-token keys (only the dynamic layer settles an uncalibrated key basis, key_basis.py).
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
        for prefix, codec in (("key", self.key_codec), ("value", self.value_codec)):
            sd = {"dtype": codec.scale_dtype, "device": self.device}
            g = codec.group
            if codec.layout.axis == "channel" and n % g:
                raise ValueError(f"{self._name}: body capacity {n} is not a multiple of the {prefix} group {g}.")
            rows, cols = (n, d // g) if codec.layout.axis == "token" else (n // g, d)
            setattr(self, f"{prefix}_codes", torch.zeros(b, h, n, d // 4, dtype=torch.uint8, device=self.device))
            setattr(self, f"{prefix}_scale", torch.zeros(b, h, rows, cols, **sd))
            setattr(self, f"{prefix}_lo", torch.zeros(b, h, rows, cols, **sd))
            setattr(self, f"{prefix}_norm", torch.zeros(b, n, **sd) if codec.layout.token_scaling else None)
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
        for prefix, codec in (("key", self.key_codec), ("value", self.value_codec)):
            names += [f"{prefix}_codes", f"{prefix}_scale", f"{prefix}_lo"]
            if codec.layout.token_scaling:
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
    @write_path_inputs
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        validate_kv(self, key_states, value_states, fix=STATIC_FIX, update_args=(args, kwargs))
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
        if _tracing():  # the portable view (a traced graph with another attention implementation)
            return self.full_view(key_states, value_states)
        return StaticStep(self, key_states, value_states, self._body_tokens_now()).output(like=key_states)

    def _set_length(self, value: torch.Tensor) -> None:
        if self.functional:
            self.cumulative_length = value.to(torch.long).reshape(())
        else:
            self.cumulative_length.copy_(value)

    def _body_tokens_now(self) -> int:
        end = int(self.cumulative_length)
        return body_len(end - self.sink, self.window, self.block)

    def _write_body(self, prefix: str, codec: StreamCodec, q: QuantizedGroups, norm, start, n: int,
                    flag: torch.Tensor | None = None) -> None:
        """Write ``n`` quantized tokens at body index ``start`` (a multiple of the block); ``flag``: only if set."""
        dev = self.device
        idx = start + torch.arange(n, device=dev)
        if codec.layout.axis == "channel":
            g = codec.group
            rows = start // g + torch.arange(n // g, device=dev)
        else:
            rows = idx
        pieces = [(f"{prefix}_codes", 2, idx, q.codes), (f"{prefix}_scale", 2, rows, q.scale),
                  (f"{prefix}_lo", 2, rows, q.lo)]
        if norm is not None:
            pieces.append((f"{prefix}_norm", 1, idx, norm))
        for name, dim, index, value in pieces:
            value = value.detach()  # the body is data, not part of the autograd graph (as in OscarLayer)
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
        if self.writes_body:
            slots = (first - s + torch.arange(blk, device=dev)) % r
            src_k, src_v = self.ring_k.index_select(2, slots), self.ring_v.index_select(2, slots)
            if w == 0:
                src_k = torch.cat([src_k[:, :, :-1], key_states], dim=2)
                src_v = torch.cat([src_v[:, :, :-1], value_states], dim=2)
            qk, nk = self.key_codec.quantize(src_k)
            qv, nv = self.value_codec.quantize(src_v)
            start = (first - s).clamp(0, self.body_capacity - blk)
        if s:
            in_sink = (p < s).reshape(1, 1, 1, 1)
            self._write_where("sink_k", 2, p.clamp(max=s - 1), key_states, in_sink)
            self._write_where("sink_v", 2, p.clamp(max=s - 1), value_states, in_sink)
        slot = (p - s) % r
        past_sink = (p >= s).reshape(1, 1, 1, 1)
        self._write_where("ring_k", 2, slot, key_states, past_sink)
        self._write_where("ring_v", 2, slot, value_states, past_sink)
        if self.writes_body:
            start = start.reshape(())
            self._write_body("key", self.key_codec, qk, nk, start, blk, flag)
            self._write_body("value", self.value_codec, qv, nv, start, blk, flag)
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
        # demote positions [s + b0, s + b1): from the ring (before p0) and from the chunk, QUANTIZE_BLOCK_TOKENS at
        # a time (whole blocks: the same codes), each block written as it is quantized. A refusal midway leaves codes
        # only at body positions past the stored ones (what is stored is a function of cumulative_length, which
        # moves at the end), so it changes nothing the cache holds.
        step = max(blk, QUANTIZE_BLOCK_TOKENS // blk * blk)
        for j0 in range(b0, b1, step):
            j1 = min(j0 + step, b1)
            ring_pos = list(range(s + j0, min(s + j1, p0)))
            parts_k, parts_v = [], []
            if ring_pos:
                slots = torch.tensor([(j - s) % r for j in ring_pos], device=self.device)
                parts_k.append(self.ring_k.index_select(2, slots))
                parts_v.append(self.ring_v.index_select(2, slots))
            if s + j1 > p0:  # a view of the chunk: a long prefill is never copied whole
                parts_k.append(key_states[:, :, max(s + j0, p0) - p0:s + j1 - p0])
                parts_v.append(value_states[:, :, max(s + j0, p0) - p0:s + j1 - p0])
            src_k = parts_k[0] if len(parts_k) == 1 else torch.cat(parts_k, dim=2)
            src_v = parts_v[0] if len(parts_v) == 1 else torch.cat(parts_v, dim=2)
            qk, nk = self.key_codec.quantize(src_k)
            qv, nv = self.value_codec.quantize(src_v)
            self._write_body("key", self.key_codec, qk, nk, j0, j1 - j0)
            self._write_body("value", self.value_codec, qv, nv, j0, j1 - j0)
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
        lq = query.shape[2]
        s, r, n = self.sink, self.ring_size, self.body_capacity
        dev = query.device
        p0, b1 = self._step_geometry(lq)
        # The position each column holds, and whether it holds one the step may read: the sink's past slots, the
        # body's stored tokens, the ring's past slots not yet in the body (slot i holds the newest past position
        # j with (j - s) % r == i), then the chunk.
        sink_pos = torch.arange(s, device=dev)
        body_pos = s + torch.arange(n, device=dev)
        last = p0 - 1
        ring_pos = last - (last - s - torch.arange(r, device=dev)) % r
        chunk_pos = p0 + torch.arange(lq, device=dev)
        positions = torch.cat([sink_pos, body_pos, ring_pos, chunk_pos])
        valid = torch.cat([sink_pos < p0, (body_pos < s + b1) & (body_pos < p0),
                           (ring_pos >= s + b1) & (ring_pos >= s), torch.ones(lq, dtype=torch.bool, device=dev)])
        mask = step_mask(self._mask_over_slots(attention_mask), chunk_pos, positions, dev, valid=valid)
        ring_k, ring_v = self._ring_snapshot if self._ring_snapshot is not None else (self.ring_k, self.ring_v)
        before = [(self.sink_k, self.sink_v)] if s else []
        return attend_segments(query, before, self.body("key"), self.body("value"),
                               [(ring_k, ring_v), (key_states, value_states)], scaling, self.body_backend, mask,
                               block_tokens=self.attention_block)

    def body(self, prefix: str) -> QuantizedBody:
        """The ``"key"`` or ``"value"`` body over its whole capacity (unwritten tokens are masked by readers)."""
        return QuantizedBody(getattr(self, f"{prefix}_codec"), getattr(self, f"{prefix}_codes"),
                             getattr(self, f"{prefix}_scale"), getattr(self, f"{prefix}_lo"),
                             getattr(self, f"{prefix}_norm"), self.body_capacity)

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
        for chunk, ring, sink, prefix in ((key_states, ring_k, self.sink_k, "key"),
                                          (value_states, ring_v, self.sink_v, "value")):
            codec = getattr(self, f"{prefix}_codec")
            q = QuantizedGroups(getattr(self, f"{prefix}_codes"), getattr(self, f"{prefix}_scale"),
                                getattr(self, f"{prefix}_lo"))
            x = chunk.index_select(2, chunk_idx)
            x = torch.where(in_chunk[:, None], x, torch.zeros_like(x))
            x = torch.where(in_ring[:, None], ring.index_select(2, ring_slots), x)
            if self.body_capacity:
                body = codec.dequantize_groups(q, getattr(self, f"{prefix}_norm"))
                x = torch.where(in_body[:, None], to_model_dtype(body.index_select(2, body_idx), x.dtype), x)
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
