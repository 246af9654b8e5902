"""What hf_kvint2 reads of a transformers model config, in one place: the decoder's shape and its layer types.

How the caches store each layer (:func:`layer_plan`): a ``"full_attention"`` layer is **quantized** (sink + INT2
body + recent window); a ``"sliding_attention"`` / ``"chunked_attention"`` layer is **windowed**: it keeps its
window (the last ``window - 1`` tokens, what the layer can still attend to) in full precision and is never
quantized. Calibration calibrates the quantized layers only (:func:`quantized_layers`).
"""

from __future__ import annotations

from typing import NamedTuple

from transformers.cache_utils import get_layer_types_and_kwargs

QUANTIZED_LAYER_TYPES = ("full_attention",)
# Layer types whose KV the caches keep in full precision, bounded by the window (never quantized).
WINDOWED_LAYER_TYPES = ("sliding_attention", "chunked_attention")
QUANTIZED, WINDOWED = "quantized", "windowed"


class ModelShape(NamedTuple):
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


class LayerPlan(NamedTuple):
    """How the caches store one decoder layer: its transformers type, ``"quantized"`` or ``"windowed"``, and the
    window of a windowed layer (None for a quantized one)."""

    layer_type: str
    storage: str
    window: int | None


def model_shape(config) -> ModelShape:
    """Layers, query heads, KV heads and head dim of a transformers config (its decoder text part)."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(text.num_hidden_layers, heads, kv_heads, head_dim)


def layer_types(config) -> list[str]:
    """Each decoder layer's attention type as transformers' caches see it (``"full_attention"``, ...)."""
    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return list(types)


def window_length(config) -> int:
    """The window of a model's sliding / chunked attention layers."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "sliding_window", None) or text.attention_chunk_size


def layer_plan(config, owner: str = "hf_kvint2") -> list[LayerPlan]:
    """Per decoder layer: how the Oscar caches (dynamic and static) store it. The one decision of which layers are
    quantized; ``owner`` names the caller in the error for a layer type no cache can store."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    plan = []
    for idx, (layer_type, kw) in enumerate(zip(types, kwargs)):
        if layer_type in QUANTIZED_LAYER_TYPES:
            plan.append(LayerPlan(layer_type, QUANTIZED, None))
        elif layer_type in WINDOWED_LAYER_TYPES:
            window = kw.get("sliding_window") or window_length(config)
            plan.append(LayerPlan(layer_type, WINDOWED, int(window)))
        else:
            raise ValueError(
                f"Layer {idx} of this model is of type {layer_type!r}, which {owner} cannot store (it quantizes "
                f"{QUANTIZED_LAYER_TYPES} layers and keeps {WINDOWED_LAYER_TYPES} windows in full precision). Use "
                "transformers' DynamicCache for this model.")
    return plan


def quantized_layers(config) -> list[int]:
    """Indices of the decoder layers whose K/V the caches quantize (the layers calibration fits)."""
    return [idx for idx, p in enumerate(layer_plan(config)) if p.storage == QUANTIZED]
