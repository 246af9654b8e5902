"""transformers' continuous batching with the full-attention layers' history in INT2 pages.

The engine (``transformers.generation.continuous_batching``) schedules requests, cuts prefills into chunks, packs
every scheduled request's tokens into one row of the model's forward and hands blocks of its cache to requests.
Three of its pieces are replaced by subclasses, each the smallest one that holds the decision (transformers offers
no hook for a cache format; docs/serving.md names the upstream hooks that would remove them):

* :class:`Int2PageAllocator` (its full-attention allocator): a block is one request's INT2 pages of
  ``page_tokens`` body tokens for every quantized layer (:mod:`hf_kvint2.serving.pages`); it builds no dense
  read / write indices, since nothing is read back as full precision K/V.
* :class:`OscarPagedAttentionCache` (its ``PagedAttentionCache``): keeps each live request's
  :class:`RequestKV` (the same layers ``OscarCache`` builds: sink and recent window at full precision, the body in
  the request's pages; sliding-window layers keep their window), admits a request only when a full-precision window
  slot is free, and answers ``update`` per request, returning placeholders that carry the packed step
  (:class:`~hf_kvint2.steps.PackedSteps`) to the ``"oscar"`` attention.
* :class:`OscarBatchingManager` (its manager): runs the model with the ``"oscar"`` attention (the engine accepts
  only its own attention names) and builds the cache above.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import transformers
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from ..attention import ATTN_IMPLEMENTATION
from ..layers import OscarLayer, all_finite_kv
from ..model_config import QUANTIZED, LayerPlan
from ..recipes import LayerRecipe
from ..steps import DeferredKV, LayerStep, PackedSteps
from ..window_layer import WindowLayer
from .pages import PageArena, PagedBody, layer_page_bytes

# Page bytes are padded to a multiple of this (the engine's sector size is the lcm of the block bytes and 128).
PAGE_ALIGN = 128
# transformers versions whose continuous-batching internals these subclasses were written against and tested on.
TESTED_TRANSFORMERS = ("5.25",)


def check_transformers_version(version: str = transformers.__version__) -> None:
    """Refuse a transformers whose continuous-batching internals were not tested with these subclasses."""
    if not any(version == v or version.startswith(v + ".") for v in TESTED_TRANSFORMERS):
        raise RuntimeError(
            f"hf_kvint2's continuous batching subclasses transformers' engine internals (PagedAttentionCache, its "
            f"full-attention allocator, ContinuousBatchingManager), tested on transformers {', '.join(TESTED_TRANSFORMERS)}.x;"
            f" this is transformers {version}. Install a tested version (pip install 'transformers=="
            f"{TESTED_TRANSFORMERS[-1]}.*'), or use model.generate(cache=...) with one batch.")


@dataclass
class PagedLayout:
    """What the engine's pieces share: the model's layer plan, each quantized layer's recipe, the page geometry, the
    full-precision window slots and the budget split (see :func:`hf_kvint2.serving.plan_budget`)."""

    plan: list[LayerPlan]
    recipes: dict[int, LayerRecipe]
    heads: int
    head_dim: int
    dtype: torch.dtype
    page_tokens: int
    bytes_per_page: int
    window_bytes: int  # full-precision bytes of one request's windows (every layer), at most
    window_slots: int
    num_blocks: int
    window_dtype: torch.dtype | None = None

    @property
    def quantized_layers(self) -> list[int]:
        return [i for i, p in enumerate(self.plan) if p.storage == QUANTIZED]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_page * len(self.quantized_layers)

    @property
    def kv_bytes(self) -> int:
        """The budget the layout uses: window slots and pages (with the engine's two unused blocks)."""
        return self.window_slots * self.window_bytes + (self.num_blocks + 2) * self.bytes_per_block

    @staticmethod
    def page_bytes(recipes: dict[int, LayerRecipe], heads: int, head_dim: int, page_tokens: int) -> int:
        """The engine's bytes per page (its pages have one size, a block is one page per quantized layer): the
        layers' pages on average, rounded up so that a block is a multiple of ``PAGE_ALIGN`` bytes (the engine's
        sector is the lcm of the block bytes and 128: one block)."""
        n = len(recipes)
        total = sum(layer_page_bytes(r, heads, head_dim, page_tokens) for r in recipes.values())
        unit = PAGE_ALIGN // math.gcd(n, PAGE_ALIGN)
        average = -(-total // n)
        return -(-average // unit) * unit


class SharedTensors:
    """One tensor object per content: the requests' codecs share their rotations and means, so that the decode steps
    of requests with equal codecs are attended in one call (:class:`~hf_kvint2.steps.PackedSteps` groups them by
    identity)."""

    def __init__(self):
        self._by_content: dict[tuple, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        key = (tuple(t.shape), t.dtype, t.device, t.detach().cpu().numpy().tobytes())
        return self._by_content.setdefault(key, t)

    def codec(self, codec):
        rotation, mean = self(codec.rotation), self(codec.mean)
        if rotation is codec.rotation and mean is codec.mean:
            return codec
        return dataclasses.replace(codec, rotation=rotation, mean=mean)


class WindowSlots:
    """The quantized layers' full-precision windows of ``layout.window_slots`` requests, allocated once: per layer,
    sink K/V [slots, H, sink, D] and recent-window K/V [slots, H, recent + demotion block, D] (the model's dtype).
    A live request holds one slot; its layers write their sink and recent window there instead of allocating
    buffers at every demotion, so a long-serving process does not scatter long-lived buffers among each step's
    temporaries (the allocator then keeps memory that no one uses: RSS grows past the budget)."""

    def __init__(self, layout: PagedLayout, device):
        slots, h, d = layout.window_slots, layout.heads, layout.head_dim
        lengths = {idx: (r.sink_tokens, r.sink_tokens, r.recent_tokens + r.demotion_block,
                         r.recent_tokens + r.demotion_block) for idx, r in layout.recipes.items()}
        # one allocation for all (freed whole when the engine goes, not kept by the allocator in pieces)
        self.storage = torch.zeros(slots * h * d * sum(sum(n) for n in lengths.values()), dtype=layout.dtype,
                                   device=device)
        self.tensors, offset = {}, 0
        for idx, parts in lengths.items():
            views = []
            for n in parts:
                views.append(self.storage[offset:offset + slots * h * n * d].view(slots, h, n, d))
                offset += slots * h * n * d
            self.tensors[idx] = tuple(views)
        self.free = list(range(slots - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def views(self, slot: int, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """Slot ``slot``'s (sink K, sink V, recent K, recent V) buffers of one layer, each [1, H, n, D]."""
        return tuple(t[slot:slot + 1] for t in self.tensors[layer_idx])


class PagedOscarLayer(OscarLayer):
    """An :class:`~hf_kvint2.layers.OscarLayer` of one request whose key and value bodies are
    :class:`~hf_kvint2.serving.pages.PagedBody` stores over the request's blocks, and whose sink and recent window
    are the request's window slot (:class:`WindowSlots`)."""

    def __init__(self, recipe: LayerRecipe, layer_idx: int, arena: PageArena, block_ids: list[int],
                 shared: SharedTensors, windows: WindowSlots, slot: int):
        self.arena, self.block_ids, self.shared = arena, block_ids, shared
        self.slot, self.slot_tensors = slot, windows.tensors[layer_idx]
        self.window = windows.views(slot, layer_idx)
        super().__init__(recipe, layer_idx)
        self.fused_attention = True  # read by the "oscar" attention: update() returns the step's placeholders

    def _new_stream(self, kind, codec):
        return PagedBody(self.shared.codec(codec), self.arena, self.layer_idx, kind, self.block_ids)

    def _append_sink(self, new_k, new_v):
        n0, n = self.sink_k.shape[-2], self.sink_k.shape[-2] + new_k.shape[-2]
        buf_k, buf_v = self.window[0], self.window[1]
        if n > buf_k.shape[-2] or new_k.dtype != buf_k.dtype:  # (left padding: a longer sink, allocated)
            return super()._append_sink(new_k, new_v)
        buf_k[:, :, n0:n], buf_v[:, :, n0:n] = new_k, new_v
        self.sink_k, self.sink_v = buf_k[:, :, :n], buf_v[:, :, :n]

    def _window_buffers(self, like, n, cap):
        buf_k, buf_v = self.window[2], self.window[3]
        if n > buf_k.shape[-2] or like.dtype != buf_k.dtype:
            return super()._window_buffers(like, n, cap)
        return buf_k, buf_v

    def appends_in_slot(self, dtype: torch.dtype) -> int | None:
        """Where this layer's next decode token goes when storing it is one write into its window slot and nothing
        else (no sink to fill, no demotion due, no key basis to settle, room in the slot): the token's position in
        the slot's recent window; else None (the layer's own ``update`` stores it). See
        :meth:`OscarPagedAttentionCache.update`."""
        bufs, recent = self._recent_buffers, self.recent_k
        if bufs is None or bufs[2] is not recent or bufs[3] is not self.recent_v or bufs[0] is not self.window[2] or \
                self.dtype != dtype:
            return None
        n = recent.shape[-2]
        if n == 0 or n >= bufs[0].shape[-2]:
            return None
        overflow = n + 1 - self.recipe.recent_tokens
        if overflow > 0 and (self.key_basis_open or self._whole_blocks(overflow)):
            return None
        return n

    def took_token_in_slot(self, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerStep:
        """Account for the decode token written at :meth:`appends_in_slot`'s position (``key_states`` /
        ``value_states`` [1, H, 1, D]: that token); returns the step ``update`` would have made."""
        bufs = self._recent_buffers
        self._use_recent_buffers(bufs[0], bufs[1], self.recent_k.shape[-2] + 1)
        self.seq_len += 1
        return LayerStep(self, key_states, value_states)

    def shared_windows(self):
        sink_k, bufs = self.window[0], self._recent_buffers
        cap = sink_k.shape[-2]
        if self.sink_k.shape[-2] != cap or (cap and self.sink_k.data_ptr() != sink_k.data_ptr()) or \
                bufs is None or bufs[0] is not self.window[2] or bufs[2] is not self.recent_k:
            return None  # a sink still filling, or windows that did not fit the slot (allocated)
        return self.slot_tensors, self.slot


class RequestKV:
    """One request's cache layers, by model layer index: a :class:`PagedOscarLayer` for each quantized layer (its
    windows in window slot ``slot``), a :class:`~hf_kvint2.window_layer.WindowLayer` for each sliding-window
    layer."""

    def __init__(self, layout: PagedLayout, arena: PageArena, block_ids: list[int], shared: SharedTensors,
                 windows: WindowSlots):
        self.layers = []
        self.slot = windows.take()
        for idx, plan in enumerate(layout.plan):
            if plan.storage == QUANTIZED:
                self.layers.append(PagedOscarLayer(layout.recipes[idx], idx, arena, block_ids, shared, windows,
                                                   self.slot))
            else:
                self.layers.append(WindowLayer(sliding_window=plan.window, storage_dtype=layout.window_dtype))


class Int2PageAllocator(FullAttentionCacheAllocator):
    """The engine's allocator for the quantized layers: blocks of INT2 pages (:mod:`hf_kvint2.serving.pages`).
    Block tables, free lists and sectors are the engine's; no block is shared between requests (a request's codes
    depend on its own key basis) and no dense index is built."""

    supports_block_sharing = False
    supports_block_table = False

    def __init__(self, index: int, layout: PagedLayout, allow_block_sharing: bool):
        self.layout = layout
        self.head_dim, self.num_key_value_heads, self.cache_dtype = layout.head_dim, layout.heads, layout.dtype
        self._before_cache_tensor_init(index=index, layer_indices=layout.quantized_layers,
                                       tokens_per_page=layout.page_tokens, bytes_per_page=layout.bytes_per_page,
                                       allow_block_sharing=False)

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)
        self.arena = PageArena(cache_tensor, self.bytes_per_block, self.layout.page_tokens, self.layout.heads,
                               self.layout.head_dim, self.layout.recipes)

    def get_read_indices(self, request_id, past_length, query_length) -> list[int]:
        return []

    def get_write_indices(self, request_id, past_length, query_length) -> list[int]:
        return []

    def update(self, *args, **kwargs):
        raise RuntimeError("INT2 pages are written by the request's layers (OscarPagedAttentionCache.update).")


class OscarPagedAttentionCache(PagedAttentionCache):
    """The engine's paged cache with the quantized layers in INT2 pages and each request's full-precision windows
    in one of ``layout.window_slots`` slots (see the module docstring)."""

    def __init__(self, *args, layout: PagedLayout, **kwargs):
        self.layout = layout  # read by _create_allocator, which the engine's __init__ calls
        super().__init__(*args, **kwargs)
        self.requests: dict[str, RequestKV] = {}
        self.shared = SharedTensors()
        self.windows = WindowSlots(self.layout, self.device)
        self.peak_requests = 0
        self._batch: list[tuple[str, int, int]] = []  # (request id, past length, query length) of the next forward
        self._packed: list[tuple[RequestKV, int, int]] | None = None  # the forward's requests, token offsets

    def _create_allocator(self, continuous_batching_config, attn_type, index, layer_indices, num_key_value_heads):
        return Int2PageAllocator(index, self.layout, allow_block_sharing=False)

    @property
    def allocator(self) -> Int2PageAllocator:
        return next(iter(self.cache_allocators.values()))

    @property
    def free_window_slots(self) -> int:
        return len(self.windows.free)

    def free_pages(self) -> int:
        """Blocks not held by any request (free blocks of the allocator's sectors and whole free sectors)."""
        allocator = self.allocator
        return self.pool.count_free_blocks(allocator.index) + self.pool.num_free_sectors * allocator.blocks_per_sector

    # ---------------------------------------------------------------- admission and release
    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        new = state.request_id not in self.requests
        if new and self.free_window_slots <= 0:
            return False
        if not super().can_store_request_tokens(state, request_len, dry_run):
            return False
        if new and not dry_run:
            block_ids = self.allocator.block_table[state.request_id]
            self.requests[state.request_id] = RequestKV(self.layout, self.allocator.arena, block_ids, self.shared,
                                                        self.windows)
            self.peak_requests = max(self.peak_requests, len(self.requests))
        return True

    def check_request_fits(self, state) -> None:
        """Refuse a request that no free budget could hold (its prompt and max_new_tokens need more pages than the
        arena has): an error for that request only, where the engine would wait for it forever."""
        tokens = len(state.initial_tokens) + (state.max_new_tokens or 0)
        pages = -(-tokens // self.layout.page_tokens)
        total = self.allocator.num_blocks
        if pages > total:
            raise ValueError(
                f"Request {state.request_id}: {len(state.initial_tokens)} prompt tokens and max_new_tokens="
                f"{state.max_new_tokens} need {pages} INT2 pages of {self.layout.page_tokens} tokens, but the whole "
                f"budget holds {total} pages ({total * self.layout.page_tokens} tokens). Shorten the request or "
                f"raise kv_budget_bytes (by about {(pages - total) * self.allocator.bytes_per_block} bytes).")

    def count_storable_requests(self, list_blocks_needed) -> int:
        return min(super().count_storable_requests(list_blocks_needed), max(self.free_window_slots, 0))

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache)
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.windows.give_back(request.slot)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        for request in self.requests.values():
            self.windows.give_back(request.slot)
        self.requests.clear()

    def prepare_fork_request(self, *args, **kwargs):
        raise NotImplementedError("Forking a request (num_return_sequences > 1 or parallel sampling) is not supported "
                                  "with INT2 pages: run one sequence per request.")

    # ---------------------------------------------------------------- the forward
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        # called once per scheduled request, in the order of the packed row, while the engine prepares a forward
        self._batch.append((request_id, past_length, query_length))
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)

    def _requests_of_forward(self, tokens: int) -> list[tuple[RequestKV, int, int]]:
        """(request layers, first token, tokens) of every request in the forward's packed row: the batch the engine
        prepared last, taken at the forward's first layer."""
        if self._batch:
            packed, start = [], 0
            for request_id, _, n in self._batch:
                packed.append((self.requests[request_id], start, n))
                start += n
            self._packed, self._batch = packed, []
        packed = self._packed
        if packed is None or sum(n for _, _, n in packed) != tokens:
            raise RuntimeError(f"The engine's forward has {tokens} tokens, but the requests it scheduled have "
                               f"{None if packed is None else sum(n for _, _, n in packed)}: this transformers "
                               "version prepares batches differently from the tested ones.")
        return packed

    @property
    def last_forward_had_prompt_tokens(self) -> bool:
        """Whether the last forward held a prompt chunk (a request with more than one query token)."""
        return self._packed is not None and any(n > 1 for _, _, n in self._packed)

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs=None):
        """Store each request's new K/V [1, H, tokens, D] in its layers; return placeholders that carry the packed
        step to the ``"oscar"`` attention."""
        packed = self._requests_of_forward(key_states.shape[2])
        in_slots = self._append_decode_tokens(packed, layer_idx, key_states, value_states)
        parts = []
        for i, (request, start, n) in enumerate(packed):
            step = in_slots.get(i)
            if step is not None:
                parts.append((start, 1, step))
                continue
            layer = request.layers[layer_idx]
            keys, values = layer.update(key_states[:, :, start:start + n], value_states[:, :, start:start + n])
            window = layer.sliding_window if isinstance(layer, WindowLayer) else None
            parts.append((start, n, keys.step if isinstance(keys, DeferredKV) else (keys, values, window)))
        return DeferredKV.pair(PackedSteps(parts, key_states.shape[2]), like=key_states)

    def _append_decode_tokens(self, packed, layer_idx: int, key_states: torch.Tensor,
                              value_states: torch.Tensor) -> dict[int, LayerStep]:
        """Store the forward's decode tokens of quantized layer ``layer_idx`` in one indexed write per K and V into
        the requests' window slots, where that is all storing them takes (:meth:`PagedOscarLayer.appends_in_slot`),
        instead of tens of microseconds of Python per request and layer in each layer's own ``update``. Returns
        {index in ``packed``: the request's step}; the other requests' tokens (prompt chunks, demotions, windows
        still filling) go through their layers' ``update``, as do all of them when the K/V would fail its checks
        there (shapes, dtypes, NaN/Inf: the error is the layer's)."""
        if layer_idx not in self.layout.recipes or key_states.dtype != value_states.dtype or \
                key_states.shape != value_states.shape or key_states.shape[0] != 1 or \
                key_states.shape[1] != self.layout.heads or key_states.shape[3] != self.layout.head_dim:
            return {}
        members = []
        for i, (request, start, n) in enumerate(packed):
            if n == 1:
                layer = request.layers[layer_idx]
                position = layer.appends_in_slot(key_states.dtype)
                if position is not None:
                    members.append((i, layer, start, position))
        if not members or (any(layer.recipe.check_finite for _, layer, _, _ in members) and
                           not all_finite_kv(key_states, value_states)):
            return {}
        slots = torch.tensor([layer.slot for _, layer, _, _ in members], device=key_states.device)
        positions = torch.tensor([p for _, _, _, p in members], device=key_states.device)
        columns = torch.tensor([start for _, _, start, _ in members], device=key_states.device)
        recent_k, recent_v = self.windows.tensors[layer_idx][2:]
        recent_k[slots, :, positions] = key_states[0].index_select(1, columns).transpose(0, 1)
        recent_v[slots, :, positions] = value_states[0].index_select(1, columns).transpose(0, 1)
        return {i: layer.took_token_in_slot(key_states[:, :, start:start + 1], value_states[:, :, start:start + 1])
                for i, layer, start, _ in members}


# The share of the KV budget a forward's widest activations may take by default (max_batch_tokens, below). Measured
# on CPU (SmolLM2, 512 MiB), the process holds 2-3x a forward's live activations at its peak (attention temporaries
# beside them, and what the allocator has not reused): with 3%, serving's RSS grew by 1.06-1.16x the budget.
ACTIVATION_SHARE = 0.03


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Hand the pages of freed heap memory back to the OS (glibc's ``malloc_trim(0)``; a no-op returning False
    elsewhere). A prompt chunk's forward frees tens of MiB of temporaries scattered among live allocations; glibc
    keeps those pages resident, and over a long run the process would hold that much more than the budget."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def default_max_batch_tokens(config, layout: PagedLayout) -> int:
    """Query tokens per forward when the caller sets none: as many as keep one forward's activations (a decoder
    layer's widest live tensors: 4 of the hidden size and 3 of the MLP's, per token, in the model's dtype) within
    ``ACTIVATION_SHARE`` of the KV budget, a multiple of 256 between 256 and 8192 (transformers' default). A memory
    budget for KV means little if each forward of a long prompt chunk adds more than it."""
    text = config.get_text_config()
    item = torch.empty((), dtype=layout.dtype).element_size()
    per_token = item * (4 * text.hidden_size + 3 * getattr(text, "intermediate_size", 4 * text.hidden_size))
    tokens = int(layout.kv_bytes * ACTIVATION_SHARE) // per_token // 256 * 256
    return min(max(tokens, 256), 8192)


class OscarBatchingManager(continuous_api.ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` running the ``"oscar"`` attention over
    :class:`OscarPagedAttentionCache`."""

    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None, *,
                 layout: PagedLayout):
        self.layout = layout
        config = copy.copy(continuous_batching_config)
        config.page_size = layout.page_tokens
        config.num_blocks = layout.num_blocks
        config.max_blocks_per_request = 0  # no block-table decode path: the "oscar" attention reads the pages
        config.allow_block_sharing = False
        if config.max_batch_tokens is None:
            config.max_batch_tokens = default_max_batch_tokens(model.config, layout)
        config.use_async_batching = False  # one batch prepared at a time (the cache reads the batch it prepared)
        config.use_cuda_graph = False
        config.cpu_offload_space = 0  # preempted requests are recomputed: their windows are not in the arena
        num_return = getattr(generation_config, "num_return_sequences", None) or 1
        if num_return > 1:
            raise ValueError(f"num_return_sequences={num_return}: forking a request is not supported with INT2 pages; "
                             "submit the prompt that many times instead.")
        super().__init__(model, generation_config, config, workload_hints)

    def _generation_step(self) -> None:
        super()._generation_step()
        # after a prompt chunk's forward (decode steps free little, and a trim costs ~10 ms)
        if self.batch_processor.cache.last_forward_had_prompt_tokens:
            release_freed_memory()

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        original = model.config._attn_implementation
        if original != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            self._original_attn_impl = original

    def _create_batch_processor(self):
        batch_processor = getattr(self, "batch_processor", None)
        if isinstance(batch_processor, continuous_api.ContinuousBatchProcessor):
            batch_processor.reset()
            return batch_processor
        text_config = self.model.config.get_text_config()
        # The engine groups layers by attention type; every layer is "full" for it: sliding-window layers keep their
        # windows in the requests' layers (accounted in the window slots), not in engine pages.
        engine_config = copy.copy(text_config)
        engine_config.layer_types = ["full_attention"] * text_config.num_hidden_layers
        supports_logits_to_keep = getattr(self.model, "_supports_logits_to_keep", None)
        cache = OscarPagedAttentionCache(
            config=engine_config, continuous_batching_config=self.continuous_batching_config,
            device=self.model.device, distributed_helper=self.distributed_helper, dtype=self.model.dtype,
            model_supports_logits_to_keep=callable(supports_logits_to_keep) and supports_logits_to_keep(),
            layout=self.layout)
        self._use_prefix_sharing = False
        continuous_api.update_cb_config_after_cache_creation(
            cb_config=self.continuous_batching_config, num_blocks=cache.num_blocks,
            max_batch_tokens=cache.max_batch_tokens)
        scheduler_cls = continuous_api.SCHEDULER_MAPPING.get(self.continuous_batching_config.scheduler_type,
                                                             continuous_api.FIFOScheduler)
        scheduler = scheduler_cls(cache=cache, safety_margin=self.continuous_batching_config.safety_margin,
                                  max_requests_per_batch=self.continuous_batching_config.max_requests_per_batch)
        add_waiting_request = scheduler.add_waiting_request

        def add_checked_request(state):  # a request too long for the whole budget fails alone (the others go on)
            cache.check_request_fits(state)
            add_waiting_request(state)

        scheduler.add_waiting_request = add_checked_request
        return continuous_api.ContinuousBatchProcessor(
            cache=cache, config=engine_config, generation_config=self.generation_config,
            continuous_batching_config=self.continuous_batching_config, logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None,
            output_router=self.output_router, background_thread_status=self.background_thread_status,
            model_device=self.model.device, model_dtype=self.model.dtype, scheduler=scheduler,
            distributed_helper=self.distributed_helper)
