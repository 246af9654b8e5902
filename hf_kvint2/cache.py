"""The two public caches: ``OscarCache`` (OSCAR) and ``OscarScaledCache`` (OScaR), plus bits/memory accounting."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from . import hub
from .distributed import resolve_shard, warn_if_undetectable
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


class OscarCacheBase(hub.CacheHubMixin, Cache):
    """Shared mechanism: one :class:`OscarLayer` per full-attention layer, created eagerly from ``config`` or lazily
    at the first ``update`` of each layer index."""

    def __init__(self, recipe_for_layer: Callable[[int], LayerRecipe], config=None, tp_group=None):
        self._recipe_for_layer = recipe_for_layer
        self.config = config
        # Tensor parallelism (transformers' tp_plan): this rank's KV heads; None for a whole model.
        self.shard = resolve_shard(config, tp_group)
        layers: list[CacheLayerMixin] = []
        if config is not None:
            text_config = config.get_text_config(decoder=True)
            for idx, layer_type in enumerate(_layer_types(config)):
                if layer_type == "full_attention":
                    layers.append(OscarLayer(recipe_for_layer(idx), idx, self.shard))
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
        if self.artifact_info is not None:  # loaded from an artifact: check it fits this model (hub.check_update)
            hub.check_update(self, key_states, layer_idx)
        if not self.layers:
            warn_if_undetectable(self.config)
        while len(self.layers) <= layer_idx:
            idx = len(self.layers)
            self.layers.append(OscarLayer(self._recipe_for_layer(idx), idx, self.shard))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # ------------------------------------------------------------------ accounting
    _BYTE_KINDS = ("codes", "scales", "norms", "full_precision", "elements", "allocated")

    def memory_report(self, global_view: bool = False) -> dict:
        """Bytes held per layer, per device and in total (codes, scales, norms, full-precision windows), with
        bits/element.

        Under tensor parallelism the report covers this rank's KV heads; ``global_view=True`` sums the counts over
        the tensor-parallel group (a collective: call it on every rank) so that it describes the whole model as one
        process would hold it, and ``by_device`` then names devices as ``"rank<r>:<device>"``. Token norms (omni-token
        scaling) are the same on every rank: the global view counts them once and reports the extra copies as
        ``tensor_parallel["replicated_bytes"]``; ``allocated`` stays the physical sum over ranks.
        """
        per_layer, by_device = [], {}
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, OscarLayer):
                row = layer.memory_bytes()
                device = layer.device if layer.is_initialized else None
            else:  # full-precision windowed layer
                held = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                        if isinstance(t, torch.Tensor)]
                fp = sum(t.numel() * t.element_size() for t in held)
                row = {"codes": 0, "scales": 0, "norms": 0, "full_precision": fp,
                       "elements": sum(t.numel() for t in held), "allocated": fp}
                device = held[0].device if held else None
            row = dict(row, layer=idx, kind=type(layer).__name__, device=None if device is None else str(device))
            if device is not None:
                held_bytes = row["codes"] + row["scales"] + row["norms"] + row["full_precision"]
                by_device[str(device)] = by_device.get(str(device), 0) + held_bytes
            per_layer.append(row)
        if global_view and self.shard is not None:
            counts = torch.tensor([[row[k] for k in self._BYTE_KINDS] for row in per_layer], dtype=torch.int64)
            local_norms = sum(row["norms"] for row in per_layer)
            self.shard.all_reduce_sum(counts)
            for row, summed in zip(per_layer, counts.tolist()):
                row.update(zip(self._BYTE_KINDS, summed))
                row["norms"] //= self.shard.world_size  # replicated, not sharded
        total = {k: sum(row[k] for row in per_layer) for k in self._BYTE_KINDS}
        for row in per_layer + [total]:
            row["total_bytes"] = row["codes"] + row["scales"] + row["norms"] + row["full_precision"]
            row["bits_per_element"] = 8 * row["total_bytes"] / row["elements"] if row["elements"] else 0.0
        report = {"layers": per_layer, "by_device": by_device, "total": total}
        if self.shard is not None:
            report["tensor_parallel"] = {"rank": self.shard.rank, "world_size": self.shard.world_size,
                                         "kv_heads": self.shard.global_kv_heads if global_view
                                         else self.shard.local_kv_heads, "global_view": global_view}
            if global_view:
                report["tensor_parallel"]["replicated_bytes"] = local_norms * (self.shard.world_size - 1)
            if global_view:
                gathered = [None] * self.shard.world_size
                torch.distributed.all_gather_object(gathered, by_device, group=self.shard.group)
                report["by_device"] = {f"rank{r}:{dev}": n for r, part in enumerate(gathered) for dev, n in part.items()}
        return report

    def bits_per_element(self, layer_idx: int | None = None, global_view: bool = False) -> float:
        """Stored bits per cached K/V element, from the bytes held: (codes + scales + norms + full-precision windows)
        * 8 / (tokens * kv_heads * head_dim * 2). ``layer_idx=None`` averages over all layers by bytes.
        ``global_view=True`` counts all KV heads of a tensor-parallel model (a collective, see ``memory_report``)."""
        report = self.memory_report(global_view=global_view)
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

    Tensor parallelism (transformers' ``tp_plan``): built with ``config=model.config`` of a sharded model, the cache
    holds this rank's KV heads; ``tp_group`` names the tensor-parallel process group when it is not the default
    group (``hf_kvint2.distributed.tp_group(model)``). See ``hf_kvint2.distributed``.
    """

    artifact_format = hub.OSCAR_SCALED_FORMAT  # save_pretrained / from_pretrained / push_to_hub: see hub.py

    def __init__(self, config=None, *, sink_tokens: int = 0, recent_tokens: int = 128, group_size: int = 32,
                 key_group_size: int | None = None, value_group_size: int | None = None,
                 hadamard_block: int | None = None, token_scaling: bool = True,
                 scale_dtype: torch.dtype = torch.float16, tp_group=None):
        self.settings = {"sink_tokens": sink_tokens, "recent_tokens": recent_tokens, "group_size": group_size,
                         "key_group_size": key_group_size, "value_group_size": value_group_size,
                         "hadamard_block": hadamard_block, "token_scaling": token_scaling,
                         "scale_dtype": scale_dtype}
        recipe = oscar_scaled_recipe(**self.settings)
        super().__init__(lambda idx: recipe, config, tp_group)

    def __repr__(self):
        return f"OscarScaledCache({self.settings}, layers={len(self.layers)})"


class OscarCache(OscarCacheBase):
    """OSCAR: per-layer orthogonal rotations of keys and values (calibrated ``U H P``; normalised Hadamard until
    a calibration is given), row clipping, per-token INT2 over ``min(group_size, head_dim)`` channels,
    full-precision sink and recent windows.

    Per-layer settings (``k_rotations``, ``v_rotations``, ``k_clip``, ``v_clip``, ``key_means``,
    ``value_means``, ``layer_layouts``) are sequences indexed by layer; scalars apply to every layer.
    ``layer_layouts`` entries are ``(key GroupLayout, value GroupLayout)`` pairs chosen by calibration.

    Tensor parallelism (transformers' ``tp_plan``): built with ``config=model.config`` of a sharded model, the cache
    holds this rank's KV heads; ``tp_group`` names the tensor-parallel process group when it is not the default
    group (``hf_kvint2.distributed.tp_group(model)``). See ``hf_kvint2.distributed``.
    """

    artifact_format = hub.OSCAR_FORMAT  # save_pretrained / from_pretrained / push_to_hub: see hub.py

    def __init__(self, config=None, *, k_rotations: Sequence[torch.Tensor] | None = None,
                 v_rotations: Sequence[torch.Tensor] | None = None, k_clip: float | Sequence[float] | None = 0.96,
                 v_clip: float | Sequence[float] | None = 0.92, sink_tokens: int = 64, recent_tokens: int = 256,
                 group_size: int = 128, key_means: Sequence[torch.Tensor] | None = None,
                 value_means: Sequence[torch.Tensor] | None = None,
                 layer_layouts: Sequence[tuple[GroupLayout, GroupLayout]] | None = None,
                 scale_dtype: torch.dtype = torch.float16, tp_group=None):
        self.settings = {"k_clip": k_clip, "v_clip": v_clip, "sink_tokens": sink_tokens,
                         "recent_tokens": recent_tokens, "group_size": group_size, "scale_dtype": scale_dtype}
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

        super().__init__(recipe_for_layer, config, tp_group)
        if self.shard is not None:  # fail before generate if the calibration cannot be split over the ranks
            for name, seq in (("key_means", key_means), ("value_means", value_means)):
                for idx, mean in enumerate(seq or ()):
                    if mean is not None:
                        self.shard.head_slice(mean.shape[0], f"{name}[{idx}] of the calibration")

    def __repr__(self):
        calibrated = self.k_rotations is not None
        return f"OscarCache({self.settings}, calibrated={calibrated}, layers={len(self.layers)})"

    @classmethod
    def calibrate(cls, model, tokenizer, texts, num_tokens: int = 30000, window: int = 2048,
                  **kwargs) -> OscarCache:
        """Calibrate OSCAR for ``model`` on ``texts`` (SPEC 3) and return a ready cache: spectral rotations,
        means, clip ratios and a per-layer layout chosen by measured attention-output error. Two streaming passes
        over ``num_tokens`` tokens in windows of ``window``; see :func:`hf_kvint2.calibration.calibrate` for the
        keyword arguments. Save it with ``save_pretrained``."""
        from .calibration import calibrate

        return calibrate(model, tokenizer, texts, num_tokens=num_tokens, window=window, **kwargs)

    @classmethod
    def from_rotation_zoo(cls, path_or_repo, *, subfolder: str | None = None, revision: str | None = None,
                          cache_dir=None, token=None, local_files_only: bool = False,
                          k_method: str = hub.ZOO_K_METHOD, v_method: str = hub.ZOO_V_METHOD, config=None,
                          **overrides) -> OscarCache:
        """Import rotations from the reference OSCAR RotationZoo (a local folder or a Hub repo + ``subfolder``):
        ``k_rotation_<k_method>.pt`` and ``v_rotation_<v_method>.pt``, each ``{"format_version", "objective",
        "layers": {i: {"rotation" [d, d], "eigenvalues" [d]}}}``. Read with ``torch.load(weights_only=True)``
        only; rotations are checked for orthogonality. Clip ratios default to the reference 0.96 / 0.92;
        ``**overrides`` set any other setting. ``save_pretrained`` then writes it in hf_kvint2's format."""
        return hub.load_rotation_zoo(cls, path_or_repo, subfolder=subfolder, revision=revision,
                                     cache_dir=cache_dir, token=token, local_files_only=local_files_only,
                                     k_method=k_method, v_method=v_method, config=config, **overrides)
