"""The ``"oscar"`` attention: attention over an Oscar cache layer that reads the INT2 body without dequantizing it.

Importing :mod:`hf_kvint2` registers ``"oscar"`` with transformers' ``AttentionInterface`` (this function) and
``AttentionMaskInterface`` (SDPA's masks), so ``from_pretrained(..., attn_implementation="oscar")`` and
``model.set_attn_implementation("oscar")`` work.

How the attention finds the layer's storage: see :mod:`hf_kvint2.steps` (the step object an Oscar layer's
``update`` returns, through placeholders or a tag on the portable view). Static layers bound for export
(:func:`hf_kvint2.export.bind_static_cache`) are found on the attention module (``module.oscar_static_layer``).
The arithmetic is :func:`hf_kvint2.read_path.attend_segments`; masks, padding, ``scaling`` and ``is_causal``
follow SDPA, and features only SDPA has (dropout, per-head masks, softcap, attention sinks) run SDPA on the view.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .model_config import layer_plan
from .steps import DeferredKV, PackedSteps

ATTN_IMPLEMENTATION = "oscar"


def oscar_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"oscar"``: fused INT2 attention on an Oscar cache, SDPA otherwise."""
    unsupported = _sdpa_only_features(dropout, attention_mask, kwargs)
    bound = getattr(module, "oscar_static_layer", None)
    if bound is not None:  # a static layer bound by hf_kvint2.export: key/value are the step's chunk (traceable)
        if unsupported:
            raise ValueError(f"The static Oscar attention does not support {', '.join(unsupported)}; export this "
                             "model with transformers' StaticCache instead.")
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = bound.attend(query, key, value, attention_mask, scaling)
        return out.transpose(1, 2).contiguous(), None
    if not isinstance(key, DeferredKV):
        # the portable view of an Oscar layer (hf_kvint2.steps) or a window layer's K/V, tagged with their layer
        layer_ref = getattr(key, "oscar_layer", None)
        layer = None if layer_ref is None else layer_ref()
        if layer is not None:
            cache_ref = getattr(key, "oscar_cache", None)  # a cache built without config, at a layer's first chunk
            if cache_ref is not None and cache_ref() is not None:
                cache_ref().learn_layer_types(getattr(module, "config", None), layer.layer_idx, key, value)
            else:
                check_layer_type(layer, module)
            if not layer.is_sliding:
                layer.fused_attention = True  # this layer is read by "oscar": defer its views from now on
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    step = key.step
    if isinstance(step, PackedSteps):  # several requests packed in one row (hf_kvint2.serving)
        if unsupported:
            raise ValueError(f"Continuous batching with INT2 pages does not support {', '.join(unsupported)}.")
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return step.attend(module, query, scaling).transpose(1, 2).contiguous(), None
    check_layer_type(step.layer, module)
    if step.body_tokens == 0 or unsupported or not isinstance(value, DeferredKV):
        # No INT2 tokens to read (early steps, fresh prefill) or a feature only SDPA has: plain SDPA on the view.
        return _sdpa_on_view(module, step, query, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = step.attend(query, attention_mask, scaling, causal)
    return out.transpose(1, 2).contiguous(), None


def check_layer_type(layer, module: torch.nn.Module) -> None:
    """Refuse a cache layer stored otherwise than ``module``'s layer type asks (:func:`~hf_kvint2.model_config.
    layer_plan` of the module's config): a cache built with ``config=`` of another model would quantize a
    sliding-window layer's whole history, or cut a full-attention layer to another model's window (wrong logits,
    silently). Checked once per layer and model config (one identity test on later steps)."""
    config = getattr(module, "config", None)
    if config is None or getattr(layer, "oscar_checked_config", None) is config:
        return
    idx = getattr(module, "layer_idx", None)
    if idx is None:  # an attention module that does not say which layer it is: nothing to compare with
        return
    plan = layer_plan(config)
    want = plan[idx] if idx < len(plan) else None
    window = layer.sliding_window if layer.is_sliding else None
    if want is not None and want.window == window:
        layer.oscar_checked_config = config
        return
    have = f"a full-precision window of {window} tokens" if window else "quantized (a full-attention layer)"
    wanted = "unknown to its config" if want is None else \
        f"a {want.layer_type} layer (window {want.window})" if want.window else f"a {want.layer_type} layer"
    raise ValueError(f"Layer {idx} of this cache is {have}, but layer {idx} of the model is {wanted}: the cache was "
                     "built for another model (config= of a model with other layer types). Build it with "
                     "config=model.config of the model you run, or without config= (the \"oscar\" attention then "
                     "tells it each layer's type).")


def _sdpa_only_features(dropout: float, attention_mask: torch.Tensor | None, kwargs: dict) -> list[str]:
    """Attention features the fused paths do not implement (SDPA does); empty if none is asked for."""
    found = [name for name in ("softcap", "position_bias", "s_aux", "sinks") if kwargs.get(name) is not None]
    if dropout > 0:
        found.append("dropout")
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1:
        found.append("per-head masks")
    return found


def _sdpa_on_view(module, step, query, value, attention_mask, **sdpa_kwargs):
    """Plain SDPA on the step's full-precision view (released right after)."""
    k, v = step.materialize()
    out = sdpa_attention_forward(module, query, k, value if not isinstance(value, DeferredKV) else v,
                                 attention_mask, **sdpa_kwargs)
    step.release()
    return out


def register() -> None:
    """Register ``"oscar"`` with transformers (idempotent; done on ``import hf_kvint2``)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, oscar_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()  # importing this module (which imports transformers' model code) makes "oscar" available

__all__ = ["ATTN_IMPLEMENTATION", "oscar_attention_forward", "register"]
