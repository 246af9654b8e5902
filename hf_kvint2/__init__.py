"""hf_kvint2: 2-bit KV-cache quantization (OSCAR and OScaR) for Hugging Face Transformers.

``import hf_kvint2`` is cheap: it loads neither torch nor transformers. The public names below are imported from
their modules on first use, and the ``"oscar"`` attention is registered with transformers as soon as transformers'
model code is loaded (at once if it already is), so ``attn_implementation="oscar"`` works after ``import
hf_kvint2`` as before.
"""

from importlib import import_module

from .registration import register_when_transformers_loads

__version__ = "0.1.0"

# public name -> the module that defines it (loaded on first access)
_EXPORTS = {
    "ATTN_IMPLEMENTATION": "attention",
    "GroupLayout": "recipes",
    "LayerRecipe": "recipes",
    "OscarCache": "cache",
    "OscarCacheBase": "cache",
    "OscarLayer": "layers",
    "OscarScaledCache": "cache",
    "StaticOscarCache": "static_cache",
    "StaticOscarLayer": "static_cache",
    "dequantize_int2": "quant",
    "oscar_recipe": "recipes",
    "oscar_scaled_recipe": "recipes",
    "pack_int2": "quant",
    "quantize_int2": "quant",
    "unpack_int2": "quant",
}

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
