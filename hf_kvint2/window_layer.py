"""The windowed cache layers: what the Oscar caches keep for a sliding-window attention layer (Gemma 2/3, ...).

A sliding-window layer attends to the last ``sliding_window`` positions only, so its cache is bounded by the window
whatever the context length. The Oscar caches keep it in the K/V dtype (or 16 bits) and never quantize it
(:func:`hf_kvint2.model_config.layer_plan`): at Gemma 3 270M's window of 512 a sliding layer holds 0.5 MiB of K/V
in 16 bits, and INT2 costs quality on the only tokens a sliding layer reads for about the same bytes
(docs/results.md, "Hybrid models (Gemma 3 270M)": OScaR +0.13% perplexity with float32 windows, +0.14% float16,
+3.43% INT2; OSCAR +4.54%, +4.56%, +13.54%).

* :class:`WindowLayer`: the dynamic layer, transformers' ``DynamicSlidingWindowLayer`` (same tokens, masks,
  ``crop`` and past recording) that also lets go of a long chunk: transformers keeps the window as a view into the
  concatenated chunk, so after a 32k-token prefill the layer would hold the whole prefill until the next update.
  With ``storage_dtype`` (the caches' ``sliding_window_dtype``) it stores the window in 16 bits: a float32 model's
  windows are then half the bytes (at 32k on Gemma 3 270M the windows are 44% of ``OscarScaledCache``'s bytes in
  float32) for a 16-bit rounding of tokens the attention still reads at full weight.
* :class:`StaticWindowLayer`: the fixed-shape layer of :class:`~hf_kvint2.static_cache.StaticOscarCache`
  (``torch.export``, ``torch.compile``, ONNX): a ring of ``min(sliding_window, max_cache_len)`` slots, position
  ``j`` in slot ``j % ring``, written in place at positions computed from tensors, and read either through the
  ``"oscar"`` attention of an exported module (:meth:`StaticWindowLayer.attend`) or as a view by absolute position
  (:meth:`StaticWindowLayer.full_view`) that the model's sliding mask windows.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from .quant import tracing
from .read_path import dense_partial, step_mask
from .static_layer import FixedShapeLayerMixin, _cache_position_from


def check_fits_window_dtype(key_states: torch.Tensor, value_states: torch.Tensor, dtype: torch.dtype | None,
                            where: str) -> None:
    """K/V stored in ``dtype`` (a sliding window's ``storage_dtype``) must not overflow it: float16 holds at most
    65504, beyond which a stored token would read back as inf (NaN attention). Other dtypes hold any float32."""
    if dtype != torch.float16 or key_states.dtype == torch.float16 or not key_states.numel():
        return
    largest = float(torch.maximum(key_states.abs().amax(), value_states.abs().amax()))  # one sync per update
    if largest > torch.finfo(torch.float16).max:
        raise ValueError(f"{where}: K/V of magnitude {largest:.4g} do not fit sliding_window_dtype=torch.float16 "
                         "(largest 65504). Build the cache with sliding_window_dtype=torch.bfloat16 (same range as "
                         "float32) or None (the K/V dtype).")


class WindowLayer(DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer`` that keeps only its window after a chunk longer than the window
    (a clone of the last ``sliding_window - 1`` tokens instead of a view into the whole chunk).

    ``storage_dtype`` (the caches' ``sliding_window_dtype``; None: the K/V dtype) stores the window in another
    dtype, e.g. float16 for a float32 model (half the bytes). The stored window is cast to the K/V dtype and
    transformers' update concatenates it with the chunk, so the attention reads the past window as stored and the
    step's own tokens as they came, all in the K/V dtype; the new window is stored in ``storage_dtype`` (a copy, so
    never a view into a long chunk either)."""

    def __init__(self, sliding_window: int, storage_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.storage_dtype = storage_dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        converted = self.storage_dtype is not None and self.storage_dtype != key_states.dtype
        if not converted:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if not self.record_past and keys.shape[-2] > 2 * self.keys.shape[-2]:
                self.keys, self.values = self.keys.clone(), self.values.clone()
            keys.oscar_layer = weakref.ref(self)  # the "oscar" attention checks the layer against the model's
            return keys, values
        check_fits_window_dtype(key_states, value_states, self.storage_dtype, "sliding-window layer")
        # The stored window in the K/V dtype first (torch.cat would promote a bfloat16 chunk and a float16 or
        # float32 window to float32, which SDPA refuses beside a bfloat16 query): the attention reads the past window
        # as stored, the chunk exact; then the window transformers kept is stored in storage_dtype again.
        if self.is_initialized:
            self.keys, self.values = self.keys.to(key_states.dtype), self.values.to(value_states.dtype)
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.keys, self.values = self.keys.to(self.storage_dtype), self.values.to(self.storage_dtype)
        keys.oscar_layer = weakref.ref(self)
        return keys, values


def window_memory_bytes(layer) -> dict[str, int]:
    """Bytes a full-precision layer (``keys`` / ``values`` tensors, e.g. a ``DynamicSlidingWindowLayer`` or a
    ``DynamicLayer``) holds: ``full_precision`` counts its tokens, ``allocated`` the storage behind them."""
    held = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]
    fp = sum(t.numel() * t.element_size() for t in held)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return {"codes": 0, "scales": 0, "norms": 0, "full_precision": fp, "elements": sum(t.numel() for t in held),
            "allocated": sum(storages.values())}


class StaticWindowLayer(FixedShapeLayerMixin, CacheLayerMixin):
    """Fixed-shape sliding-window layer: a full-precision ring of ``min(sliding_window, max_cache_len)`` slots.

    After a step at positions ``p0 .. p1 - 1`` the ring holds positions ``p1 - ring .. p1 - 1``; a query at ``p``
    attends to ``p - sliding_window + 1 .. p`` (transformers' sliding mask), all in the ring or in the chunk. Masks
    cover ``max_cache_len`` absolute positions, like the other layers of a static Oscar cache.
    """

    is_sliding = True
    is_croppable = False
    is_compileable = True

    def __init__(self, max_cache_len: int, sliding_window: int, layer_idx: int | None = None,
                 storage_dtype: torch.dtype | None = None):
        super().__init__()
        self.storage_dtype = storage_dtype  # the ring's dtype (None: the K/V dtype), as WindowLayer's
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}.")
        if not isinstance(sliding_window, int) or sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}.")
        self.max_cache_len, self.sliding_window, self.layer_idx = max_cache_len, sliding_window, layer_idx
        self.ring_size = min(sliding_window, max_cache_len)
        self._init_fixed_shape_state()

    def __repr__(self):
        return (f"StaticWindowLayer(idx={self.layer_idx}, sliding_window={self.sliding_window}, "
                f"max_cache_len={self.max_cache_len})")

    @property
    def _name(self) -> str:
        return f"layer {self.layer_idx}" if self.layer_idx is not None else "this static window layer"

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.batch_size, self.num_heads, self.head_dim = b, h, d
        self.max_batch_size = b
        self.dtype, self.device = key_states.dtype, key_states.device
        ring = {"dtype": self.storage_dtype or self.dtype, "device": self.device}
        self.ring_k = torch.zeros(b, h, self.ring_size, d, **ring)
        self.ring_v = torch.zeros(b, h, self.ring_size, value_states.shape[-1], **ring)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not tracing():
            for t in (self.ring_k, self.ring_v, self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def state_names(self) -> list[str]:
        return ["ring_k", "ring_v"]

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.ring_k, self.ring_v]

    def _set_length(self, value: torch.Tensor) -> None:
        if self.functional:
            self.cumulative_length = value.to(torch.long).reshape(())
        else:
            self.cumulative_length.copy_(value)

    def _write(self, name: str, index: torch.Tensor, value: torch.Tensor) -> None:
        t = getattr(self, name)
        value = value.to(t.dtype)
        if self.functional:
            setattr(self, name, t.index_copy(2, index, value))
        else:
            t.index_copy_(2, index, value)

    # ------------------------------------------------------------------ update
    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ValueError(f"{self._name}: expected key/value states of the same shape [batch, kv_heads, tokens, "
                             f"head_dim], got {tuple(key_states.shape)} and {tuple(value_states.shape)}.")
        if self.is_initialized:
            b, h, _, d = key_states.shape
            if (b, h, d) != (self.batch_size, self.num_heads, self.head_dim) or key_states.dtype != self.dtype:
                raise ValueError(f"{self._name}: got K/V with batch={b}, kv_heads={h}, head_dim={d}, dtype="
                                 f"{key_states.dtype} but the static cache holds batch={self.batch_size}, kv_heads="
                                 f"{self.num_heads}, head_dim={self.head_dim}, dtype={self.dtype}. Build the static "
                                 "cache (or export) for the model, batch and dtype you run.")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache_position = _cache_position_from(args, kwargs)
        if cache_position is not None:  # transformers < 5.24 passes positions; later versions use cumulative_length
            self._set_length(cache_position.reshape(-1)[:1].to(self.cumulative_length.device).reshape(()))
        n_new = key_states.shape[-2]
        if not tracing():
            check_fits_window_dtype(key_states, value_states, self.storage_dtype, self._name)
            p0 = int(self.cumulative_length)
            if p0 + n_new > self.max_cache_len:
                raise ValueError(f"{self._name}: positions {p0}..{p0 + n_new - 1} go beyond max_cache_len="
                                 f"{self.max_cache_len}; build the static cache with a larger max_cache_len.")
        if n_new == 1:  # branch-free: the exported / compiled step
            self._ring_snapshot = None
            slot = self.cumulative_length.reshape(1) % self.ring_size
            self._write("ring_k", slot, key_states)
            self._write("ring_v", slot, value_states)
        else:  # a prefill chunk (eager): the attention reads the past window as it was before the chunk
            if tracing():
                raise RuntimeError(f"{self._name}: the exported/compiled step of a static Oscar cache takes one "
                                   "token at a time; prefill the prompt eagerly or feed it token by token.")
            self._ring_snapshot = (self.ring_k.clone(), self.ring_v.clone())
            keep = min(n_new, self.ring_size)
            p1 = p0 + n_new
            slots = torch.arange(p1 - keep, p1, device=self.device) % self.ring_size
            self._write("ring_k", slots, key_states[:, :, n_new - keep:])
            self._write("ring_v", slots, value_states[:, :, n_new - keep:])
        self._set_length(self.cumulative_length + n_new)
        if self.bound:  # the "oscar" attention of an exported module reads the ring through attend()
            return key_states, value_states
        keys, values = self.full_view(key_states, value_states)
        if not tracing():  # the eager "oscar" attention checks the layer against the model's
            keys.oscar_layer = weakref.ref(self)
        return keys, values

    # ------------------------------------------------------------------ reading
    def _past(self, n_new: int):
        """The ring the step reads, the position each slot holds (newest first wins) and whether it is a past
        position still held: ``(ring_k, ring_v, positions [ring], valid [ring])``."""
        end = self.cumulative_length
        p0 = end - n_new
        if self._ring_snapshot is not None:
            ring_k, ring_v = self._ring_snapshot
            last = p0 - 1
        else:
            ring_k, ring_v = self.ring_k, self.ring_v
            last = end - 1
        slot = torch.arange(self.ring_size, device=ring_k.device)
        pos = last - (last - slot) % self.ring_size
        return ring_k, ring_v, pos, (pos >= 0) & (pos < p0)

    def full_view(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Every position ``[B, H, max_cache_len, D]`` (past window from the ring, the chunk, zero elsewhere), for
        SDPA-style attention with the model's sliding mask over ``max_cache_len`` columns."""
        n_new = key_states.shape[-2]
        ring_k, ring_v, _, _ = self._past(n_new)
        end = self.cumulative_length
        p0 = end - n_new
        pos = torch.arange(self.max_cache_len, device=key_states.device)
        oldest = (end - 1 - self.ring_size) if self._ring_snapshot is None else (p0 - 1 - self.ring_size)
        in_ring = ((pos < p0) & (pos > oldest))[:, None]
        in_chunk = ((pos >= p0) & (pos < end))[:, None]
        chunk_idx = (pos - p0).clamp(0, n_new - 1)
        outs = []
        for chunk, ring in ((key_states, ring_k), (value_states, ring_v)):
            x = chunk.index_select(2, chunk_idx)
            x = torch.where(in_chunk, x, torch.zeros_like(x))
            outs.append(torch.where(in_ring, ring.index_select(2, pos % self.ring_size).to(x.dtype), x))
        return outs[0], outs[1]

    def attend(self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [B, Hq, L, D] over the past window (ring) and the step's chunk. ``attention_mask``:
        the model's sliding mask over ``max_cache_len`` absolute columns (bool or additive) or None (then causal);
        the window is applied here either way. Returns [B, Hq, L, D]."""
        lq = query.shape[2]
        dev = query.device
        ring_k, ring_v, pos, valid = self._past(lq)
        chunk_pos = self.cumulative_length - lq + torch.arange(lq, device=dev)
        mask = step_mask(self._mask_over_slots(attention_mask), chunk_pos, torch.cat([pos, chunk_pos]), dev,
                         window=self.sliding_window,
                         valid=torch.cat([valid, torch.ones(lq, dtype=torch.bool, device=dev)]))
        keys = torch.cat([ring_k.to(key_states.dtype), key_states], dim=2)
        values = torch.cat([ring_v.to(value_states.dtype), value_states], dim=2)
        out, _ = dense_partial(query, keys, values, scaling, mask)
        return out.to(query.dtype)

    # ------------------------------------------------------------------ transformers contract
    def get_seq_length(self):
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            self.ring_k.zero_()
            self.ring_v.zero_()
        self.cumulative_length.zero_()
        self._ring_snapshot = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError(f"{self._name}: a static Oscar cache cannot be cropped. Use OscarCache / "
                             "OscarScaledCache for assisted or prompt-lookup decoding.")

    def memory_bytes(self) -> dict[str, int]:
        """Bytes allocated (static: the same at every step): the ring, full precision."""
        fp = sum(t.numel() * t.element_size() for t in self.state_tensors()) if self.is_initialized else 0
        return {"codes": 0, "scales": 0, "norms": 0, "full_precision": fp}

