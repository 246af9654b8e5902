"""What hf_kvint2 reads of a transformers model config, in one place: the decoder's shape and its layer types."""

from __future__ import annotations

from typing import NamedTuple

from transformers.cache_utils import get_layer_types_and_kwargs

# Layer types whose KV the caches keep in full precision, bounded by the window (never quantized).
WINDOWED_LAYER_TYPES = ("sliding_attention", "chunked_attention")


class ModelShape(NamedTuple):
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


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
