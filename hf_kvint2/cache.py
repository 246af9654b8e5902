"""The two public caches: ``OscarCache`` (OSCAR) and ``OscarScaledCache`` (OScaR), plus bits/memory accounting."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .layers import OscarLayer
from .recipes import GroupLayout, LayerRecipe, oscar_recipe, oscar_scaled_recipe

# Layer types whose KV the caches keep in full precision, bounded by the window (never quantized).
_WINDOWED_LAYER_TYPES = ("sliding_attention", "chunked_attention")


def _layer_types(config) -> list[str]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return list(types)


def _num_layers(config) -> int:
    return config.get_text_config(decoder=True).num_hidden_layers


class OscarCacheBase(Cache):
    """Shared mechanism: one :class:`OscarLayer` per full-attention layer, created eagerly from ``config`` or lazily
    at the first ``update`` of each layer index."""

    def __init__(self, recipe_for_layer: Callable[[int], LayerRecipe], config=None):
        self._recipe_for_layer = recipe_for_layer
        self.config = config
        layers: list[CacheLayerMixin] = []
        if config is not None:
            text_config = config.get_text_config(decoder=True)
            for idx, layer_type in enumerate(_layer_types(config)):
                if layer_type == "full_attention":
                    layers.append(OscarLayer(recipe_for_layer(idx), idx))
                elif layer_type in _WINDOWED_LAYER_TYPES:
                    window = getattr(text_config, "sliding_window", None) or text_config.attention_chunk_size
                    layers.append(DynamicSlidingWindowLayer(sliding_window=window))
                else:
                    raise ValueError(
                        f"Layer {idx} of this model is of type {layer_type!r}, which {type(self).__name__} cannot "
                        f"store (it quantizes 'full_attention' layers and keeps {_WINDOWED_LAYER_TYPES} windows in "
                        "full precision). Use transformers' DynamicCache for this model.")
        super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            idx = len(self.layers)
            self.layers.append(OscarLayer(self._recipe_for_layer(idx), idx))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ------------------------------------------------------------------ accounting
    def memory_report(self) -> dict:
        """Bytes held per layer and in total (codes, scales, norms, full-precision windows), with bits/element."""
        per_layer = []
        total = {"codes": 0, "scales": 0, "norms": 0, "full_precision": 0, "elements": 0, "allocated": 0}
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, OscarLayer):
                row = layer.memory_bytes()
            else:  # full-precision windowed layer
                held = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                        if isinstance(t, torch.Tensor)]
                fp = sum(t.numel() * t.element_size() for t in held)
                row = {"codes": 0, "scales": 0, "norms": 0, "full_precision": fp,
                       "elements": sum(t.numel() for t in held), "allocated": fp}
            row = dict(row, layer=idx, kind=type(layer).__name__)
            row["total_bytes"] = row["codes"] + row["scales"] + row["norms"] + row["full_precision"]
            row["bits_per_element"] = 8 * row["total_bytes"] / row["elements"] if row["elements"] else 0.0
            per_layer.append(row)
            for key in total:
                total[key] += row[key]
        total["total_bytes"] = total["codes"] + total["scales"] + total["norms"] + total["full_precision"]
        total["bits_per_element"] = 8 * total["total_bytes"] / total["elements"] if total["elements"] else 0.0
        return {"layers": per_layer, "total": total}

    def bits_per_element(self, layer_idx: int | None = None) -> float:
        """Stored bits per cached K/V element, from the bytes held: (codes + scales + norms + full-precision windows)
        * 8 / (tokens * kv_heads * head_dim * 2). ``layer_idx=None`` averages over all layers by bytes."""
        report = self.memory_report()
        row = report["total"] if layer_idx is None else report["layers"][layer_idx]
        return row["bits_per_element"]


def _per_layer(value, idx: int, name: str):
    """A setting given once for all layers or as a per-layer sequence."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if idx >= len(value):
            raise ValueError(f"{name} has {len(value)} entries but the model has a layer {idx}: the calibration "
                             "does not match this model's layer count.")
        return value[idx]
    return value


class OscarScaledCache(OscarCacheBase):
    """OScaR (data-free): block Hadamard rotation, omni-token key scaling, INT2 keys per channel over token
    groups and values per token over channel groups, with a full-precision residual window.

    ``OscarScaledCache()`` creates its layers lazily; ``OscarScaledCache(config=model.config)`` creates them up
    front (and keeps sliding-window layers in full precision). All settings are keyword arguments.
    """

    def __init__(self, config=None, *, sink_tokens: int = 0, recent_tokens: int = 128, group_size: int = 32,
                 key_group_size: int | None = None, value_group_size: int | None = None,
                 hadamard_block: int | None = None, token_scaling: bool = True,
                 scale_dtype: torch.dtype = torch.float16):
        self.settings = dict(sink_tokens=sink_tokens, recent_tokens=recent_tokens, group_size=group_size,
                             key_group_size=key_group_size, value_group_size=value_group_size,
                             hadamard_block=hadamard_block, token_scaling=token_scaling, scale_dtype=scale_dtype)
        recipe = oscar_scaled_recipe(**self.settings)
        super().__init__(lambda idx: recipe, config)

    def __repr__(self):
        return f"OscarScaledCache({self.settings}, layers={len(self.layers)})"


class OscarCache(OscarCacheBase):
    """OSCAR: per-layer orthogonal rotations of keys and values (calibrated ``U H P``; normalised Hadamard until
    a calibration is given), row clipping, per-token INT2 over ``min(group_size, head_dim)`` channels,
    full-precision sink and recent windows.

    Per-layer settings (``k_rotations``, ``v_rotations``, ``k_clip``, ``v_clip``, ``key_means``,
    ``value_means``, ``layer_layouts``) are sequences indexed by layer; scalars apply to every layer.
    ``layer_layouts`` entries are ``(key GroupLayout, value GroupLayout)`` pairs chosen by calibration.
    """

    def __init__(self, config=None, *, k_rotations: Sequence[torch.Tensor] | None = None,
                 v_rotations: Sequence[torch.Tensor] | None = None, k_clip: float | Sequence[float] | None = 0.96,
                 v_clip: float | Sequence[float] | None = 0.92, sink_tokens: int = 64, recent_tokens: int = 256,
                 group_size: int = 128, key_means: Sequence[torch.Tensor] | None = None,
                 value_means: Sequence[torch.Tensor] | None = None,
                 layer_layouts: Sequence[tuple[GroupLayout, GroupLayout]] | None = None,
                 scale_dtype: torch.dtype = torch.float16):
        self.settings = dict(k_clip=k_clip, v_clip=v_clip, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                             group_size=group_size, scale_dtype=scale_dtype)
        self.k_rotations, self.v_rotations = k_rotations, v_rotations
        self.key_means, self.value_means, self.layer_layouts = key_means, value_means, layer_layouts
        if config is not None:
            n = _num_layers(config)
            for name, seq in (("k_rotations", k_rotations), ("v_rotations", v_rotations),
                              ("key_means", key_means), ("value_means", value_means),
                              ("layer_layouts", layer_layouts)):
                if seq is not None and len(seq) != n:
                    raise ValueError(f"{name} has {len(seq)} entries but the model has {n} layers: the "
                                     "calibration does not match this model.")

        def recipe_for_layer(idx: int) -> LayerRecipe:
            layouts = _per_layer(layer_layouts, idx, "layer_layouts") if layer_layouts is not None else (None, None)
            return oscar_recipe(
                key_rotation=_per_layer(k_rotations, idx, "k_rotations") if k_rotations is not None else None,
                value_rotation=_per_layer(v_rotations, idx, "v_rotations") if v_rotations is not None else None,
                k_clip=_per_layer(k_clip, idx, "k_clip"), v_clip=_per_layer(v_clip, idx, "v_clip"),
                sink_tokens=sink_tokens, recent_tokens=recent_tokens, group_size=group_size,
                key_mean=_per_layer(key_means, idx, "key_means") if key_means is not None else None,
                value_mean=_per_layer(value_means, idx, "value_means") if value_means is not None else None,
                key_layout=layouts[0], value_layout=layouts[1], scale_dtype=scale_dtype)

        super().__init__(recipe_for_layer, config)

    def __repr__(self):
        calibrated = self.k_rotations is not None
        return f"OscarCache({self.settings}, calibrated={calibrated}, layers={len(self.layers)})"
