"""Continuous batching on transformers' own engine with the KV history in INT2 pages.

``enable_paged_int2(model, cache, kv_budget_bytes=...)`` makes the model's ``init_continuous_batching`` (hence
``model.generate_batch`` and ``transformers serve --continuous-batching``) run transformers' engine with the
full-attention layers' history in INT2 pages and each request's sink and recent window at full precision, as
``cache`` (an ``OscarCache`` or ``OscarScaledCache``: its settings and calibration) stores them for one sequence.
``disable_paged_int2(model)`` restores the model. The byte budget holds both (:func:`plan_budget`):

    budget = window_slots * window_bytes (full-precision windows, one slot per live request)
             + (num_blocks + 2) * bytes_per_block (INT2 pages; the engine keeps two blocks unused)

See docs/serving.md for the memory layout and the limits.
"""

from __future__ import annotations

import types

import torch

from ..cache import OscarCacheBase
from ..hub.artifact import check_update
from ..model_config import QUANTIZED, layer_plan, model_shape
from .engine import OscarBatchingManager, PagedLayout, check_transformers_version
from .pages import page_tokens_for

# Tokens (prompt and generated) of a typical request, by default: without max_concurrent_requests, the window slots
# are sized so that the budget holds as many requests of expected_request_tokens as it can (windows and pages).
EXPECTED_REQUEST_TOKENS = 2048
_ORIGINAL = "_hf_kvint2_original_init_continuous_batching"


def window_bytes(plan, recipes, heads: int, head_dim: int, dtype: torch.dtype,
                 window_dtype: torch.dtype | None) -> int:
    """Full-precision bytes one request's layers hold at most: each quantized layer's sink and recent window (with
    room for one demotion block), each sliding-window layer's window; K and V."""
    item = torch.empty((), dtype=dtype).element_size()
    window_item = item if window_dtype is None else torch.empty((), dtype=window_dtype).element_size()
    total = 0
    for idx, p in enumerate(plan):
        if p.storage == QUANTIZED:
            r = recipes[idx]
            total += 2 * heads * head_dim * item * (r.sink_tokens + r.recent_tokens + r.demotion_block)
        else:
            total += 2 * heads * head_dim * window_item * p.window
    return total


def plan_budget(model, cache: OscarCacheBase, kv_budget_bytes: int, *, max_concurrent_requests: int | None = None,
                page_size: int | None = None,
                expected_request_tokens: int = EXPECTED_REQUEST_TOKENS) -> PagedLayout:
    """How ``kv_budget_bytes`` is split between full-precision window slots and INT2 pages for ``model`` with the
    settings of ``cache`` (see the module docstring). ``max_concurrent_requests``: the window slots (default: as many
    requests of ``expected_request_tokens`` tokens, prompt and generated, as the budget holds: a slot without pages
    for its request, or pages without a slot, hold no one); ``page_size``: tokens per page (default: the smallest
    multiple of the layers' demotion blocks that is at least 64)."""
    if not isinstance(cache, OscarCacheBase):
        raise TypeError(f"cache must be an OscarCache or OscarScaledCache (its settings and calibration are used for "
                        f"every request), got {type(cache).__name__}.")
    if not isinstance(kv_budget_bytes, int) or isinstance(kv_budget_bytes, bool) or kv_budget_bytes <= 0:
        raise ValueError(f"kv_budget_bytes must be a positive int (bytes), got {kv_budget_bytes!r}.")
    config = model.config
    plan = layer_plan(config, type(cache).__name__)
    shape = model_shape(config)
    heads, head_dim = shape.num_key_value_heads, shape.head_dim
    if head_dim % 4:
        raise ValueError(f"head_dim={head_dim} is not supported: INT2 pages pack four channels per byte.")
    if cache.artifact_info is not None:  # the calibration must be this model's (the template's state untouched)
        probe, seen = torch.empty(1, heads, 0, head_dim, device="meta"), types.SimpleNamespace(
            artifact_info=cache.artifact_info, shard=None)
        for idx in [*range(len(plan)), 0]:  # every layer, then layer 0 again: fewer layers than the artifact's
            check_update(seen, probe, idx)
    recipes = {idx: cache._recipe_for_layer(idx) for idx, p in enumerate(plan) if p.storage == QUANTIZED}
    if not recipes:
        raise ValueError("This model has no full-attention layer: there is nothing to keep in INT2 pages.")
    page_tokens = page_tokens_for(list(recipes.values()), head_dim, page_size)
    page_bytes = PagedLayout.page_bytes(recipes, heads, head_dim, page_tokens)
    block_bytes = page_bytes * len(recipes)
    windows = window_bytes(plan, recipes, heads, head_dim, model.dtype, getattr(cache, "window_dtype", None))
    if not isinstance(expected_request_tokens, int) or isinstance(expected_request_tokens, bool) or \
            expected_request_tokens <= 0:
        raise ValueError(f"expected_request_tokens must be a positive int (tokens), got {expected_request_tokens!r}.")
    per_request = windows + block_bytes * -(-expected_request_tokens // page_tokens)
    minimum = windows + 3 * block_bytes  # one request's windows and one page, and the engine's two unused blocks
    if kv_budget_bytes < minimum:
        raise ValueError(f"kv_budget_bytes={kv_budget_bytes} is too small for one request: its full-precision "
                         f"windows take {windows} bytes and one page of {page_tokens} tokens {block_bytes} bytes; "
                         f"the minimum is {minimum} bytes (a useful budget holds many requests: about "
                         f"{per_request} bytes each at {expected_request_tokens} tokens).")
    if max_concurrent_requests is None:
        slots = max(1, kv_budget_bytes // per_request)
    else:
        if not isinstance(max_concurrent_requests, int) or max_concurrent_requests <= 0:
            raise ValueError(f"max_concurrent_requests must be a positive int, got {max_concurrent_requests!r}.")
        slots = max_concurrent_requests
    num_blocks = (kv_budget_bytes - slots * windows) // block_bytes - 2
    if num_blocks < 1:
        raise ValueError(f"max_concurrent_requests={slots} window slots ({windows} bytes each) leave no room for "
                         f"INT2 pages in kv_budget_bytes={kv_budget_bytes}: at most "
                         f"{(kv_budget_bytes - 3 * block_bytes) // windows} slots fit this budget.")
    return PagedLayout(plan=plan, recipes=recipes, heads=heads, head_dim=head_dim, dtype=model.dtype,
                       page_tokens=page_tokens, bytes_per_page=page_bytes,
                       window_bytes=windows, window_slots=slots, num_blocks=num_blocks,
                       window_dtype=getattr(cache, "window_dtype", None))


def enable_paged_int2(model, cache: OscarCacheBase, kv_budget_bytes: int, *,
                      max_concurrent_requests: int | None = None, page_size: int | None = None,
                      expected_request_tokens: int = EXPECTED_REQUEST_TOKENS) -> PagedLayout:
    """Make ``model.init_continuous_batching`` (``generate_batch``, ``transformers serve``) run on INT2 pages with
    ``cache``'s settings, within ``kv_budget_bytes`` (:func:`plan_budget`). Returns the layout."""
    check_transformers_version()
    layout = plan_budget(model, cache, kv_budget_bytes, max_concurrent_requests=max_concurrent_requests,
                         page_size=page_size, expected_request_tokens=expected_request_tokens)
    disable_paged_int2(model)
    original = model.init_continuous_batching

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 workload_hints=None):
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, OscarBatchingManager) and cached.layout is layout:
            cached.switch_to_cb_friendly_attn(self)
            return cached
        gen_config = generation_config if generation_config is not None else self.generation_config
        if gen_config.eos_token_id is None:
            gen_config.eos_token_id = -1
        from transformers import ContinuousBatchingConfig
        cb_config = continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig()
        return OscarBatchingManager(self, gen_config, cb_config, workload_hints, layout=layout)

    setattr(model, _ORIGINAL, original)
    model.init_continuous_batching = types.MethodType(init_continuous_batching, model)
    return layout


def disable_paged_int2(model) -> None:
    """Undo :func:`enable_paged_int2` (no-op if it was not called); a kept manager is destroyed."""
    if getattr(model, _ORIGINAL, None) is None:
        return
    model.destroy_cached_continuous_batching_manager()
    del model.init_continuous_batching  # the instance attribute: the class's method is back
    delattr(model, _ORIGINAL)


__all__ = ["PagedLayout", "disable_paged_int2", "enable_paged_int2", "plan_budget"]
