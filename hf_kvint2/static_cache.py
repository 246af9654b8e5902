"""Static (fixed-shape) Oscar caches for ``torch.export``, ``torch.compile`` and ONNX: a transformers ``Cache`` of
:class:`~hf_kvint2.static_layer.StaticOscarLayer` s (storage and numerics: see :mod:`hf_kvint2.static_layer`)."""

from __future__ import annotations

from collections.abc import Callable
from threading import get_ident

import torch
from transformers.cache_utils import Cache

from .concurrency import ThreadGuard
from .hub import check_layer_plan
from .model_config import WINDOWED, layer_plan, model_shape
from .quant import tracing
from .read_path import BODY_BLOCK_TOKENS
from .recipes import LayerRecipe
from .static_layer import StaticOscarLayer
from .window_layer import StaticWindowLayer


class StaticOscarCache(Cache):
    """A transformers ``Cache`` of :class:`StaticOscarLayer` s, one per full-attention layer, with the recipes of an
    :class:`~hf_kvint2.OscarCache` or :class:`~hf_kvint2.OscarScaledCache`, and a full-precision
    :class:`~hf_kvint2.window_layer.StaticWindowLayer` (a ring of ``min(sliding_window, max_cache_len)`` slots) per
    sliding-window layer (:func:`hf_kvint2.model_config.layer_plan`, as in the dynamic caches; ``window_dtype``:
    the rings' dtype, None for the K/V dtype, like the dynamic caches' ``sliding_window_dtype``).

    ``StaticOscarCache.from_cache(cache, config, max_cache_len)`` takes the recipes (rotations, clips, means,
    per-layer layouts, windows, window dtype) of a dynamic cache, e.g. ``OscarCache.from_pretrained(...)``. Layers are allocated
    at the first ``update`` or by ``early_initialization(batch_size, kv_heads, head_dim, dtype, device)`` (needed
    before ``torch.export``). Positions come from ``cumulative_length`` (transformers >= 5.24) or the
    ``cache_position`` that older versions pass to ``update``.
    """

    def __init__(self, recipe_for_layer: Callable[[int], LayerRecipe], config, max_cache_len: int,
                 attention_block: int = BODY_BLOCK_TOKENS, window_dtype: torch.dtype | None = None):
        if config is None:
            raise ValueError("StaticOscarCache needs the model config (config=model.config) to size its layers.")
        layers = []
        for idx, plan in enumerate(layer_plan(config, "StaticOscarCache")):
            if plan.storage == WINDOWED:
                if plan.layer_type != "sliding_attention":
                    raise ValueError(f"Layer {idx} of this model is of type {plan.layer_type!r}; the static Oscar "
                                     "cache supports full-attention and sliding-window layers. Use OscarCache "
                                     "(dynamic) for this model.")
                layers.append(StaticWindowLayer(max_cache_len, plan.window, idx, window_dtype))
            else:
                layers.append(StaticOscarLayer(recipe_for_layer(idx), max_cache_len, idx, attention_block))
        self._max_cache_len = max_cache_len
        self.config = config
        self.thread_guard = ThreadGuard()
        super().__init__(layers=layers)

    @property
    def max_cache_len(self) -> int:  # a read-only property of transformers < 5.24's Cache as well
        return self._max_cache_len

    @classmethod
    def from_cache(cls, cache, config, max_cache_len: int, attention_block: int = BODY_BLOCK_TOKENS):
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
        n = model_shape(config).num_layers
        if info.get("num_layers") not in (None, n):
            raise ValueError(f"The calibration artifact has num_layers={info['num_layers']} but the model has {n}: "
                             "load the artifact calibrated for this model.")
        check_layer_plan(info, config, f"the model config ({type(config).__name__})")
        return cls(recipe_for_layer, config, max_cache_len, attention_block, getattr(cache, "window_dtype", None))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx >= len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} is beyond the {len(self.layers)} layers of this static cache.")
        if tracing():  # an exported / compiled step: one program, no Python threads to tell apart
            return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        guard = self.thread_guard  # one thread at a time (hf_kvint2.concurrency)
        if guard.thread != get_ident() or guard.busy or guard.broken is not None:
            guard.enter(layer_idx, type(self).__name__)
        guard.busy = True
        try:
            out = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        except BaseException:
            guard.busy = False
            raise
        guard.leave(layer_idx)
        return out

    def reset(self):
        super().reset()
        self.thread_guard.reset()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every layer's state tensors, layer by layer in ``state_names`` order (the ONNX graph's state)."""
        return [t for layer in self.layers for t in layer.state_tensors()]

    def memory_report(self) -> dict:
        """Bytes allocated per layer and in total, by kind (codes, scales, norms, full_precision)."""
        layers = [dict(layer.memory_bytes(), layer=i) for i, layer in enumerate(self.layers)]
        total = {k: sum(row[k] for row in layers) for k in ("codes", "scales", "norms", "full_precision")}
        total["total_bytes"] = sum(total.values())
        return {"layers": layers, "total": total}


def static_cache_like(cache, config, max_cache_len: int, attention_block: int = BODY_BLOCK_TOKENS):
    """``cache`` if it is already a :class:`StaticOscarCache`, else its static counterpart."""
    if isinstance(cache, StaticOscarCache):
        if cache.max_cache_len != max_cache_len:
            raise ValueError(f"The static cache holds {cache.max_cache_len} positions but max_cache_len={max_cache_len} "
                             "was asked for.")
        return cache
    return StaticOscarCache.from_cache(cache, config, max_cache_len, attention_block)


__all__ = ["StaticOscarCache", "StaticOscarLayer", "StaticWindowLayer", "static_cache_like"]
