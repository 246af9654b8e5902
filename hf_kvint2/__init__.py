"""hf_kvint2: 2-bit KV-cache quantization (OSCAR and OScaR) for Hugging Face Transformers."""

from .attention import ATTN_IMPLEMENTATION
from .attention import register as _register_attention
from .cache import OscarCache, OscarCacheBase, OscarScaledCache
from .layers import OscarLayer
from .quant import dequantize_int2, pack_int2, quantize_int2, unpack_int2
from .recipes import GroupLayout, LayerRecipe, oscar_recipe, oscar_scaled_recipe
from .static_cache import StaticOscarCache, StaticOscarLayer

_register_attention()  # makes attn_implementation="oscar" available to transformers

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "GroupLayout",
    "LayerRecipe",
    "OscarCache",
    "OscarCacheBase",
    "OscarLayer",
    "OscarScaledCache",
    "StaticOscarCache",
    "StaticOscarLayer",
    "dequantize_int2",
    "oscar_recipe",
    "oscar_scaled_recipe",
    "pack_int2",
    "quantize_int2",
    "unpack_int2",
]
