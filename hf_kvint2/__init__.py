"""hf_kvint2: 2-bit KV-cache quantization (OSCAR and OScaR) for Hugging Face Transformers.

Public API: the caches, the static (export) cache, their settings types and the attention name. Internals are
reachable from their modules (``hf_kvint2.layers.OscarLayer``, ``hf_kvint2.quant.pack_int2``,
``hf_kvint2.recipes.LayerRecipe``, ...); ARCHITECTURE.md maps them.

``import hf_kvint2`` is cheap: it loads neither torch nor transformers. The public names below are imported from
their modules on first use, and the ``"oscar"`` attention is registered with transformers as soon as transformers'
model code is loaded (at once if it already is), so ``attn_implementation="oscar"`` works after ``import
hf_kvint2`` as before.
"""

from importlib import import_module

from .registration import register_when_transformers_loads
from .version import __version__

# public name -> the module that defines it (loaded on first access)
_EXPORTS = {
    "ATTN_IMPLEMENTATION": "attention",
    "GroupLayout": "recipes",
    "OscarCache": "cache",
    "OscarCalibration": "settings",
    "OscarScaledCache": "cache",
    "OscarScaledSettings": "settings",
    "OscarSettings": "settings",
    "SettingsError": "settings",
    "StaticOscarCache": "static_cache",
}

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


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    try:  # submodules, as `hf_kvint2.distributed.tp_group(...)` after a plain `import hf_kvint2`
        return import_module(f".{name}", __name__)
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


register_when_transformers_loads()  # makes attn_implementation="oscar" available to transformers
