"""INT2 pages: the quantized bodies of many requests in one byte arena, a page of ``page_tokens`` tokens at a time.

The arena is the continuous-batching engine's cache tensor (one flat uint8 tensor). It is cut into blocks; a block
belongs to one request and holds, for every quantized layer, the key and value pages of the same ``page_tokens``
body tokens of that request: packed codes, group scales and offsets, and token norms where the layout has them::

    block = [ layer a: K codes | K scale | K lo | K norm | V codes | V scale | V lo | V norm | layer b: ... ]

A page's tokens are whole quantization groups of one request (``page_tokens`` is a multiple of every layer's
demotion block), so per-channel key groups never mix requests or straddle pages. :class:`PagedBody` is one
request's key or value body of one layer over its blocks: the store an :class:`~hf_kvint2.layers.OscarLayer` writes
demoted tokens into and reads as a :class:`~hf_kvint2.stream.QuantizedBody` (its pages gathered in order), with the
interface of :class:`~hf_kvint2.stream.QuantizedStream`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..quant import QuantizedGroups
from ..recipes import LayerRecipe
from ..stream import QuantizedBody, StreamCodec

# Every region of a block starts at a multiple of this many bytes (the scales are viewed as float16 / float32).
REGION_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // REGION_ALIGN) * REGION_ALIGN


def stream_scale_elements(recipe: LayerRecipe, kind: str, heads: int, head_dim: int, page_tokens: int) -> int:
    """Scale (and offset) elements of one page of a stream: ``page_tokens * head_dim / group`` per head, for per-token
    groups ([tokens, D/G]) and per-channel groups ([tokens/G, D]) alike, so a key basis settled from the data
    (hf_kvint2.key_basis: per-token groups -> per-channel groups of as many tokens) fits the same page."""
    layout = recipe.key if kind == "key" else recipe.value
    return heads * page_tokens * head_dim // layout.group_for(head_dim)


def page_tokens_for(recipes: list[LayerRecipe], head_dim: int, requested: int | None) -> int:
    """Tokens per page: ``requested`` (checked) or the smallest multiple of every layer's demotion block (and of the
    per-channel group a per-token key stream may settle to) that is at least 64."""
    blocks = []
    for r in recipes:
        blocks.append(r.demotion_block)
        if r.key.axis == "token" and r.key_rotation is None:  # may settle to per-channel groups of this many tokens
            blocks.append(r.key.group_for(head_dim))
    unit = math.lcm(*blocks)
    if requested is None:
        return unit * max(1, -(-64 // unit))
    if requested <= 0 or requested % unit:
        raise ValueError(f"page_size={requested} must be a positive multiple of {unit} tokens: a page holds whole "
                         "quantization groups and demotion blocks of one request (the layers' demotion blocks and "
                         "per-channel groups). Use a multiple of it, or leave page_size unset.")
    return requested


@dataclass(frozen=True)
class StreamRegions:
    """Byte offsets inside a block of one stream's page: codes, scale, lo, norm (None without token norms)."""

    codes: int
    scale: int
    lo: int
    norm: int | None
    end: int


def plan_stream(offset: int, recipe: LayerRecipe, kind: str, heads: int, head_dim: int,
                page_tokens: int) -> StreamRegions:
    """The regions of one stream's page starting at byte ``offset`` of a block."""
    layout = recipe.key if kind == "key" else recipe.value
    itemsize = torch.empty((), dtype=recipe.scale_dtype).element_size()
    codes = offset
    scale = codes + _aligned(heads * page_tokens * head_dim // 4)
    lo = scale + _aligned(stream_scale_elements(recipe, kind, heads, head_dim, page_tokens) * itemsize)
    after_lo = lo + (lo - scale)
    norm = after_lo if layout.token_scaling else None
    end = after_lo + (_aligned(page_tokens * itemsize) if layout.token_scaling else 0)
    return StreamRegions(codes, scale, lo, norm, end)


class PageArena:
    """Typed views of the streams' pages in the engine's byte arena (``cache_tensor``, ``bytes_per_block`` bytes a
    block). ``layer_regions[layer_idx]`` = (key regions, value regions) inside a block."""

    def __init__(self, cache_tensor: torch.Tensor, bytes_per_block: int, page_tokens: int, heads: int,
                 head_dim: int, recipes: dict[int, LayerRecipe], layer_regions: dict[int, tuple]):
        self.page_tokens, self.heads, self.head_dim = page_tokens, heads, head_dim
        self.num_blocks = cache_tensor.numel() // bytes_per_block
        self._blocks = cache_tensor[:self.num_blocks * bytes_per_block].view(self.num_blocks, bytes_per_block)
        self.views: dict[tuple[int, str], tuple] = {}
        for idx, regions in layer_regions.items():
            recipe = recipes[idx]
            for kind, reg in zip(("key", "value"), regions):
                self.views[idx, kind] = self._stream_views(recipe, kind, reg)

    def _region(self, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self._blocks[:, start:start + nbytes].view(dtype)

    def _stream_views(self, recipe: LayerRecipe, kind: str, reg: StreamRegions) -> tuple:
        h, d, p = self.heads, self.head_dim, self.page_tokens
        sd = recipe.scale_dtype
        itemsize = torch.empty((), dtype=sd).element_size()
        n_scale = stream_scale_elements(recipe, kind, h, d, p)
        codes = self._region(reg.codes, h * p * d // 4, torch.uint8).view(self.num_blocks, h, p, d // 4)
        scale = self._region(reg.scale, n_scale * itemsize, sd).view(self.num_blocks, h, n_scale // h)
        lo = self._region(reg.lo, n_scale * itemsize, sd).view(self.num_blocks, h, n_scale // h)
        norm = None if reg.norm is None else self._region(reg.norm, p * itemsize, sd)
        return codes, scale, lo, norm


class PagedBody:
    """One request's INT2 body of one stream (key or value of one layer) in the arena's pages: ``block_ids`` (the
    request's block table, shared with the engine's allocator, which grows it) in token order, ``tokens`` written.

    The interface of :class:`~hf_kvint2.stream.QuantizedStream` that :class:`~hf_kvint2.layers.OscarLayer` uses:
    ``codec``, ``tokens``, ``append``, ``read``, ``truncate``, ``dequantize``, ``buffers``."""

    def __init__(self, codec: StreamCodec, arena: PageArena, layer_idx: int, kind: str, block_ids: list[int]):
        self.codec = codec
        self.arena = arena
        self.codes, self.scale, self.lo, norm = arena.views[layer_idx, kind]
        self.norm = norm if codec.layout.token_scaling else None
        self.block_ids = block_ids
        self._tokens = 0

    @property
    def tokens(self) -> int:
        return self._tokens

    def buffers(self) -> list:
        return []  # the pages belong to the engine's arena (accounted there, not per layer)

    def _group(self) -> int:
        return self.codec.group if self.codec.layout.axis == "channel" else 1

    def _scale_rows(self, page: torch.Tensor) -> torch.Tensor:
        """A page's scale / lo [blocks, H, elements] as rows: [blocks, H, page, D/G] (per-token groups) or
        [blocks, H, page/G, D] (per-channel)."""
        p, d, g = self.arena.page_tokens, self.arena.head_dim, self.codec.group
        if self.codec.layout.axis == "channel":
            return page.view(*page.shape[:2], p // g, d)
        return page.view(*page.shape[:2], p, d // g)

    def append(self, x: torch.Tensor) -> None:
        """Quantize original-space tokens x [1, H, n, D] (whole groups) into the next ``n`` token slots."""
        if x.shape[0] != 1:
            raise ValueError(f"A paged body holds one request's tokens; got a batch of {x.shape[0]}.")
        q, norm = self.codec.quantize(x.detach())
        self._write(q, norm, x.shape[2])

    def _write(self, q: QuantizedGroups, norm: torch.Tensor | None, n: int) -> None:
        p, g = self.arena.page_tokens, self._group()
        t, end = self._tokens, self._tokens + n
        if -(-end // p) > len(self.block_ids):
            raise RuntimeError(f"The request's block table holds {len(self.block_ids)} pages of {p} tokens, too few "
                               f"for {end} body tokens: the engine allocated less than the request's length.")
        done = 0
        while t < end:
            page, at = divmod(t, p)
            take = min(p - at, end - t)
            block = self.block_ids[page]
            self.codes[block, :, at:at + take] = q.codes[0, :, done:done + take]
            self._scale_rows(self.scale[block:block + 1])[0, :, at // g:(at + take) // g] = \
                q.scale[0, :, done // g:(done + take) // g]
            self._scale_rows(self.lo[block:block + 1])[0, :, at // g:(at + take) // g] = \
                q.lo[0, :, done // g:(done + take) // g]
            if self.norm is not None:
                self.norm[block, at:at + take] = norm[0, done:done + take]
            t += take
            done += take
        self._tokens = end

    def read(self, tokens: int | None = None) -> QuantizedBody:
        """The first ``tokens`` body tokens (default: all) as a :class:`QuantizedBody`: the request's pages gathered
        in token order (INT2 bytes: an eighth of the float32 K/V they stand for)."""
        n = self._tokens if tokens is None else tokens
        p = self.arena.page_tokens
        pages = max(1, -(-n // p))
        ids = torch.tensor(self.block_ids[:pages], dtype=torch.long, device=self.codes.device)

        def gathered(t: torch.Tensor) -> torch.Tensor:  # [pages, H, rows, cols] -> [1, H, pages * rows, cols]
            t = t.index_select(0, ids)
            return t.transpose(0, 1).reshape(1, t.shape[1], -1, t.shape[-1])

        codes = gathered(self.codes)
        scale = gathered(self._scale_rows(self.scale))
        lo = gathered(self._scale_rows(self.lo))
        norm = None if self.norm is None else self.norm.index_select(0, ids).reshape(1, -1)
        return QuantizedBody(self.codec, codes, scale, lo, norm, n)

    def dequantize(self, rotated: bool = False) -> torch.Tensor:
        return self.read().dequantize(rotated=rotated)

    def truncate(self, tokens: int) -> None:
        self._tokens = min(self._tokens, tokens)
