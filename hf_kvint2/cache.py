"""The two public caches: ``OscarCache`` (OSCAR) and ``OscarScaledCache`` (OScaR), plus bits/memory accounting."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from threading import get_ident

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .calibration import (
    DEFAULT_NUM_TOKENS,
    DEFAULT_TEXT_WINDOW,
    CalibrationData,
    calibration_from_choices,
    fit_calibration,
    fit_from_statistics,
    settings_from_choices,
)
from .calibration.run import print_summary
from .concurrency import ThreadGuard
from .distributed import resolve_shard, warn_if_undetectable
from .hub import (
    OSCAR_FORMAT,
    OSCAR_SCALED_FORMAT,
    ZOO_K_METHOD,
    ZOO_V_METHOD,
    CacheHubMixin,
    check_layer_plan,
    check_update,
)
from .hub.zoo import load_rotation_zoo
from .layers import OscarLayer
from .model_config import WINDOWED, LayerPlan, layer_plan, model_shape
from .recipes import LayerRecipe
from .settings import OscarCalibration, OscarScaledSettings, OscarSettings, oscar_layer_recipe
from .steps import DeferredKV
from .window_layer import WindowLayer, window_memory_bytes

LAYER_TYPES_WARNING = (
    "hf_kvint2: {cls} was built without config=, and the model's attention is not \"oscar\", so the cache cannot "
    "tell which layers attend to a sliding window: it quantizes the whole history of every layer. The output is "
    "right, but a sliding-window layer (Gemma 2/3, Mistral and Qwen2 with sliding windows, gpt-oss, ...) needs only "
    "its window, in full precision. Pass config=model.config (or load the model with attn_implementation=\"oscar\", "
    "whose first forward tells the cache each layer's type)."
)
_layer_types_warning = {"issued": False}  # warn once per process (a user-facing notice, not state of a computation)


def warn_layer_types_unknown_once(owner: str) -> None:
    if not _layer_types_warning["issued"]:
        _layer_types_warning["issued"] = True
        warnings.warn(LAYER_TYPES_WARNING.format(cls=owner), UserWarning, stacklevel=4)


class OscarCacheBase(Cache):
    """Shared mechanism: one :class:`OscarLayer` per full-attention layer and a full-precision
    :class:`~hf_kvint2.window_layer.WindowLayer` per sliding-window layer (:func:`hf_kvint2.model_config.layer_plan`),
    created eagerly from ``config`` or lazily at the first ``update`` of each layer index (OscarLayers from
    ``recipe_for_layer(idx)``). Internal (the evaluation harness builds baselines from it); the public caches add
    their settings and Hub I/O.

    Without ``config`` the cache learns the layer types at the first forward when the model runs the ``"oscar"``
    attention (the attention module carries the model config): the first layer's first chunk is still at full
    precision then, so the result is the cache that ``config=`` builds. Under any other attention implementation it
    cannot, quantizes every layer and warns once (``LAYER_TYPES_WARNING``).

    Tensor parallelism (transformers' ``tp_plan``): built with ``config=model.config`` of a sharded model, a cache
    holds this rank's KV heads; ``tp_group`` names the tensor-parallel process group when it is not the default
    group (``hf_kvint2.distributed.tp_group(model)``). See ``hf_kvint2.distributed``. ``artifact_info`` /
    ``quality`` of the public caches are set by ``from_pretrained`` (the artifact's recorded shapes and card table).

    ``offloading`` / ``offload_only_non_sliding``: transformers' layer offloading (CUDA), as in ``DynamicCache``:
    each layer's storage (codes, scales, windows) goes to the CPU right after its update and comes back before its
    next one; the step an update returns keeps what the ``"oscar"`` attention reads (hf_kvint2.steps).
    """

    artifact_info: dict | None = None  # the recorded model shapes of a loaded artifact (checked at first update)

    def __init__(self, recipe_for_layer: Callable[[int], LayerRecipe], config=None, tp_group=None,
                 window_dtype: torch.dtype | None = None, offloading: bool = False,
                 offload_only_non_sliding: bool = False):
        self._recipe_for_layer = recipe_for_layer
        self.thread_guard = ThreadGuard()
        self.window_dtype = window_dtype  # what sliding-window layers store their window in (None: the K/V dtype)
        self.config = config
        # Tensor parallelism (transformers' tp_plan): this rank's KV heads; None for a whole model.
        self.shard = resolve_shard(config, tp_group)
        # How each layer is stored (model_config.layer_plan); None until known (from config or the first forward)
        self.layer_plan: list[LayerPlan] | None = None if config is None else layer_plan(config, type(self).__name__)
        super().__init__(layers=[self._new_layer(idx) for idx in range(len(self.layer_plan or ()))],
                         offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    def _new_layer(self, idx: int) -> CacheLayerMixin:
        plan = self.layer_plan[idx] if self.layer_plan is not None and idx < len(self.layer_plan) else None
        if plan is not None and plan.storage == WINDOWED:
            return self._window_layer(plan.window)
        return OscarLayer(self._recipe_for_layer(idx), idx, self.shard)

    def _window_layer(self, window: int) -> WindowLayer:
        layer = WindowLayer(sliding_window=window, storage_dtype=self.window_dtype)
        recording = getattr(self, "_recording_past", None)
        if recording is not None:  # asked for before this layer existed (assisted decoding)
            layer.activate_past_recording(**recording)
        return layer

    def activate_past_recording(self, **kwargs):
        # transformers >= 5.25 passes recurrent_states_to_keep (for linear-attention layers; windows ignore it)
        self._recording_past = kwargs  # also for the layers a cache without config creates later
        super().activate_past_recording(**kwargs)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        guard = self.thread_guard  # one thread at a time (hf_kvint2.concurrency): a few field reads per update
        if guard.thread != get_ident() or guard.busy or guard.broken is not None:
            guard.enter(layer_idx, type(self).__name__)
        guard.busy = True
        try:
            if self.artifact_info is not None:  # loaded from an artifact: check it fits this model (hub.check_update)
                check_update(self, key_states, layer_idx)
            if not self.layers:
                warn_if_undetectable(self.config)
            while len(self.layers) <= layer_idx:
                self.layers.append(self._new_layer(len(self.layers)))
            layer = self.layers[layer_idx]
            learning = self.layer_plan is None and isinstance(layer, OscarLayer)
            if learning and layer.seq_len > 0:  # a second forward and no "oscar" attention told the types
                warn_layer_types_unknown_once(type(self).__name__)
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if learning and layer.seq_len == key_states.shape[-2] and not isinstance(keys, DeferredKV):
                # The layer's first chunk, handed to the attention as it came (full precision): the "oscar" attention
                # may tell the cache the model's layer types now (learn_layer_types).
                keys.oscar_cache = weakref.ref(self)
        except BaseException:
            guard.busy = False
            raise
        guard.leave(layer_idx)
        return keys, values

    def reset(self):
        super().reset()
        self.thread_guard.reset()

    def learn_layer_types(self, config, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Called by the ``"oscar"`` attention at a layer's first forward (``keys`` / ``values``: its first chunk, as
        ``update`` received it) with the model config from the attention module: the layers from now on are created
        as ``config=`` would create them, and layer ``layer_idx``, if it is a sliding-window layer, becomes a
        window holding that chunk (nothing of it was quantized for attention; its INT2 copy is dropped)."""
        if self.layer_plan is not None or config is None:
            return
        if self.artifact_info is not None:  # the artifact's calibrated layers must be the ones this model quantizes
            check_layer_plan(self.artifact_info, config, f"the model ({type(config).__name__} of its attention)")
        plan = layer_plan(config, type(self).__name__)
        self.layer_plan = plan
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if layer_idx < len(plan) and plan[layer_idx].storage == WINDOWED and isinstance(layer, OscarLayer) \
                and layer.seq_len == keys.shape[-2]:
            window = self._window_layer(plan[layer_idx].window)
            window.update(keys, values)
            self.layers[layer_idx] = window

    # ------------------------------------------------------------------ accounting
    _BYTE_KINDS = ("codes", "scales", "norms", "full_precision", "elements", "allocated")

    def memory_report(self, global_view: bool = False) -> dict:
        """Bytes held per layer, per device and in total (codes, scales, norms, full-precision windows), with
        bits/element. Each layer row names its ``storage``: ``"quantized"`` (an :class:`OscarLayer`: sink, INT2 body,
        recent window) or ``"windowed"`` (a sliding-window layer: the last ``window - 1`` tokens in full precision;
        its ``elements`` are those tokens'); ``by_storage`` sums the rows of each (``by_storage["quantized"]
        ["bits_per_element"]``: the quantized layers alone). ``allocated`` adds what the storage behind the tensors
        holds (buffer capacity).

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
            else:  # full-precision windowed layer: its window's tokens (and the storage behind them)
                row = window_memory_bytes(layer)
                device = layer.keys.device if row["elements"] else None
            storage = "windowed" if getattr(layer, "is_sliding", False) else "quantized"
            row = dict(row, layer=idx, kind=type(layer).__name__, storage=storage,
                       device=None if device is None else str(device))
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
        by_storage = {kind: {k: sum(row[k] for row in per_layer if row["storage"] == kind) for k in self._BYTE_KINDS}
                      for kind in ("quantized", "windowed")}
        for row in per_layer + [total, *by_storage.values()]:
            row["total_bytes"] = row["codes"] + row["scales"] + row["norms"] + row["full_precision"]
            row["bits_per_element"] = 8 * row["total_bytes"] / row["elements"] if row["elements"] else 0.0
        report = {"layers": per_layer, "by_device": by_device, "total": total, "by_storage": by_storage}
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


class OscarScaledCache(CacheHubMixin, OscarCacheBase):
    """OScaR (data-free): block Hadamard rotation, omni-token key scaling (keys whose channels vary very unevenly
    keep the model's basis without it: :mod:`hf_kvint2.key_basis`), INT2 keys per channel over token groups and
    values per token over channel groups, with a full-precision residual window.

    ``OscarScaledCache()`` creates its layers lazily; ``OscarScaledCache(config=model.config)`` creates them up
    front (and keeps sliding-window layers in full precision). Settings: the fields of
    :class:`~hf_kvint2.OscarScaledSettings` as keyword arguments (``recent_tokens=64``), or ``settings=``.

    ``tp_group``, ``artifact_info``, ``quality``, ``offloading``, ``offload_only_non_sliding``: see
    :class:`OscarCacheBase`.
    """

    artifact_format = OSCAR_SCALED_FORMAT  # save_pretrained / from_pretrained / push_to_hub: see hf_kvint2.hub
    settings_type = OscarScaledSettings

    def __init__(self, config=None, *, settings: OscarScaledSettings | None = None, tp_group=None,
                 artifact_info: dict | None = None, quality: list[dict] | None = None, offloading: bool = False,
                 offload_only_non_sliding: bool = False, **fields):
        self.settings = _settings(OscarScaledSettings, settings, fields, type(self).__name__)
        self.artifact_info, self.quality = artifact_info, quality
        self._recipe = self.settings.recipe()
        # A bound method, not a closure: caches pickle and deepcopy like DynamicCache.
        super().__init__(self._layer_recipe, config, tp_group, self.settings.sliding_window_dtype, offloading,
                         offload_only_non_sliding)

    def _layer_recipe(self, idx: int) -> LayerRecipe:
        return self._recipe

    def __repr__(self):
        return f"OscarScaledCache({self.settings}, layers={len(self.layers)})"


def _settings(settings_type, settings, fields: dict, owner: str):
    """``settings`` or the settings built from keyword fields (not both); unknown names are refused."""
    unknown = set(fields) - settings_type.field_names()
    if unknown:
        raise TypeError(f"{owner} got unknown settings {sorted(unknown)}; valid: {sorted(settings_type.field_names())}.")
    if settings is None:
        return settings_type(**fields)
    if not isinstance(settings, settings_type):
        raise TypeError(f"{owner}: settings must be a {settings_type.__name__}, got {type(settings).__name__}.")
    return settings.replace(**fields) if fields else settings


class OscarCache(CacheHubMixin, OscarCacheBase):
    """OSCAR: per-layer orthogonal rotations of keys and values (calibrated ``U H P``; normalised Hadamard until
    a calibration is given), row clipping, per-token INT2 over ``min(group_size, head_dim)`` channels,
    full-precision sink and recent windows.

    Settings: the fields of :class:`~hf_kvint2.OscarSettings` as keyword arguments or ``settings=``. Calibration:
    the fields of :class:`~hf_kvint2.OscarCalibration` as keyword arguments (``k_rotations``, ``v_rotations``,
    ``key_means``, ``value_means``, ``layer_layouts``, ...: sequences indexed by layer) or ``calibration=``;
    ``layer_layouts`` entries are ``(key GroupLayout, value GroupLayout)`` pairs chosen by calibration.

    ``tp_group``, ``artifact_info``, ``quality``, ``offloading``, ``offload_only_non_sliding``: see
    :class:`OscarCacheBase`.
    """

    artifact_format = OSCAR_FORMAT  # save_pretrained / from_pretrained / push_to_hub: see hf_kvint2.hub
    settings_type = OscarSettings

    def __init__(self, config=None, *, settings: OscarSettings | None = None,
                 calibration: OscarCalibration | None = None, tp_group=None, artifact_info: dict | None = None,
                 quality: list[dict] | None = None, offloading: bool = False, offload_only_non_sliding: bool = False,
                 **fields):
        per_layer = {k: fields.pop(k) for k in list(fields) if k in OscarCalibration.PER_LAYER}
        if per_layer:
            calibration = dataclasses.replace(calibration or OscarCalibration(), **per_layer)
        self.calibration = calibration or OscarCalibration()
        self.settings = _settings(OscarSettings, settings, fields, type(self).__name__)
        self.artifact_info, self.quality = artifact_info, quality
        if config is not None:
            self.calibration.check_layers(model_shape(config).num_layers)
        # The settings and calibration of construction time; a bound method, not a closure: caches pickle and
        # deepcopy like DynamicCache.
        self._recipe_sources = (self.settings, self.calibration)
        super().__init__(self._layer_recipe, config, tp_group, self.settings.sliding_window_dtype, offloading,
                         offload_only_non_sliding)
        if self.shard is not None:  # fail before generate if the calibration cannot be split over the ranks
            for name in ("key_means", "value_means"):
                for idx, mean in enumerate(getattr(self.calibration, name) or ()):
                    if mean is not None:
                        self.shard.head_slice(mean.shape[0], f"{name}[{idx}] of the calibration")

    def _layer_recipe(self, idx: int) -> LayerRecipe:
        return oscar_layer_recipe(*self._recipe_sources, idx)

    def __repr__(self):
        return f"OscarCache({self.settings}, calibrated={self.calibration.calibrated}, layers={len(self.layers)})"

    @classmethod
    def calibrate(cls, model, tokenizer, texts, num_tokens: int = DEFAULT_NUM_TOKENS,
                  text_window: int = DEFAULT_TEXT_WINDOW, *, verbose: bool = True, **kwargs) -> OscarCache:
        """Calibrate OSCAR for ``model`` on ``texts`` and return a ready cache: spectral rotations, means, clip
        ratios and a per-layer layout chosen by measured attention-output error, and narrowed ranges of
        per-channel groups where the model's loss on the held-back windows, decoded through this cache, confirms
        them. Two streaming passes over ``num_tokens`` tokens in text windows of ``text_window`` tokens (the last
        ``fit_windows`` held back for fitting). ``calibration_scripts/calibrate_oscar.py`` runs this with the same
        defaults. Keyword arguments (:func:`hf_kvint2.calibration.fit_calibration`): ``fit_clip``, ``layouts``,
        ``centering``, ``clip_grid``, ``fit_windows``, ``fit_queries``, ``sink_tokens``, ``recent_tokens``,
        ``group_size``, ``group_sizes`` and ``bits_budget`` (each layer's K and V get the group size among
        ``group_sizes`` that minimises the held-back error with the mean bits/element of the quantized body
        within ``bits_budget``; default ``"auto"``: 2.35, or what ``group_size`` everywhere costs where that is
        more, e.g. 2.5 at head_dim 64; ``bits_budget=None``: ``group_size`` everywhere), ``scale_dtype``,
        ``data_description``, ``model_id``, ``model_revision``, ``value_pass`` (``"spill"`` keeps one window of
        keys/values on disk between the two passes, ``"recompute"`` runs the model twice), ``spill_dir``,
        ``layers``, ``progress``. The cache carries ``calibration_report`` (time, peak memory, choices, statistics:
        printed, not saved). Save it with ``save_pretrained``."""
        result = fit_calibration(model, tokenizer, texts, num_tokens=num_tokens, text_window=text_window,
                                 cache_type=cls, **kwargs)
        return cls._from_result(result, model.config, verbose)

    @classmethod
    def from_statistics(cls, data: CalibrationData, model, *, verbose: bool = True, **kwargs) -> OscarCache:
        """:meth:`calibrate` from statistics it collected before (``cache.calibration_report["data"]``, saved with
        :meth:`~hf_kvint2.calibration.CalibrationData.save` and read with ``CalibrationData.load``): the same cache
        as that run without running the model over the text again (the narrowed ranges are still checked on the
        held-back windows). Keyword arguments: those of :meth:`calibrate` that fit
        (:func:`hf_kvint2.calibration.fit_from_statistics`); ``sink_tokens`` / ``recent_tokens`` must be those
        the statistics were collected with."""
        result = fit_from_statistics(data, model.config, model=model, cache_type=cls, **kwargs)
        return cls._from_result(result, model.config, verbose)

    @classmethod
    def _from_result(cls, result, config, verbose: bool) -> OscarCache:
        cache = cls(config, settings=result.settings, calibration=result.calibration)
        cache.calibration_report = result.report
        if verbose:
            print_summary(cache)
        return cache

    @classmethod
    def from_choices(cls, choices, config=None, *, info: dict | None = None, **settings) -> OscarCache:
        """A cache storing every layer as its :class:`~hf_kvint2.calibration.LayerChoice` says (``settings``:
        ``sink_tokens``, ``recent_tokens``, ``group_size``, ``scale_dtype``)."""
        return cls(config, settings=settings_from_choices(choices, **settings),
                   calibration=calibration_from_choices(choices, info))

    @classmethod
    def from_rotation_zoo(cls, path_or_repo, *, subfolder: str | None = None, revision: str | None = None,
                          cache_dir=None, token=None, local_files_only: bool = False,
                          k_method: str = ZOO_K_METHOD, v_method: str = ZOO_V_METHOD, config=None,
                          **overrides) -> OscarCache:
        """Import rotations from the reference OSCAR RotationZoo (a local folder or a Hub repo + ``subfolder``):
        ``k_rotation_<k_method>.pt`` and ``v_rotation_<v_method>.pt``, each ``{"format_version", "objective",
        "layers": {i: {"rotation" [d, d], "eigenvalues" [d]}}}``. Read with ``torch.load(weights_only=True)``
        only; rotations are checked for orthogonality. Clip ratios default to the reference 0.96 / 0.92;
        ``**overrides`` set any other setting. ``save_pretrained`` then writes it in hf_kvint2's format."""
        calibration, info = load_rotation_zoo(path_or_repo, subfolder=subfolder, revision=revision,
                                              cache_dir=cache_dir, token=token, local_files_only=local_files_only,
                                              k_method=k_method, v_method=v_method, config=config)
        unknown = set(overrides) - OscarSettings.field_names()
        if unknown:
            raise TypeError(f"{cls.__name__}.from_rotation_zoo got unknown settings {sorted(unknown)}.")
        return cls(config, settings=OscarSettings(**overrides), calibration=calibration, artifact_info=info)
