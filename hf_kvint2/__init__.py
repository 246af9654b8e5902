"""hf_kvint2: 2-bit KV-cache quantization (OSCAR and OScaR) for Hugging Face Transformers.

Public API: the caches, the static (export) cache, their settings types and the attention name. Internals are
reachable from their modules (``hf_kvint2.layers.OscarLayer``, ``hf_kvint2.quant.pack_int2``,
``hf_kvint2.recipes.LayerRecipe``, ...); ARCHITECTURE.md maps them.
"""

from .attention import ATTN_IMPLEMENTATION
from .attention import register as _register_attention
from .cache import OscarCache, OscarScaledCache
from .recipes import GroupLayout
from .settings import OscarCalibration, OscarScaledSettings, OscarSettings, SettingsError
from .static_cache import StaticOscarCache
from .version import __version__

_register_attention()  # makes attn_implementation="oscar" available to transformers

__all__ = [
    "ATTN_IMPLEMENTATION",
    "GroupLayout",
    "OscarCache",
    "OscarCalibration",
    "OscarScaledCache",
    "OscarScaledSettings",
    "OscarSettings",
    "SettingsError",
    "StaticOscarCache",
    "__version__",
]
