"""INT2 pages: the quantized bodies of many requests in one byte arena, a page of ``page_tokens`` tokens at a time.

The arena is the continuous-batching engine's cache tensor (one flat uint8 tensor). The engine hands out blocks by
id; a block belongs to one request and stands for, in every quantized layer, the key and value pages of the same
``page_tokens`` body tokens of that request: packed codes, group scales and offsets, and token norms where the
layout has them. The arena is laid out by part, not by block, head-major inside each part::

    arena = [ layer a: K codes [H, blocks, page, D/4] | K scale [H, blocks, ...] | K lo | K norm [blocks, page]
              | V codes | ... | layer b: ... ]

so that one request's pages of a part gather into the ``[1, H, tokens, ...]`` tensor the body kernels read with
one copy (``index_select`` over the block axis, then a free view); the Numba kernel's decode steps read them in
place instead, through the requests' page table (:meth:`PagedBody.read_pages`). A page's tokens are whole
quantization groups of one request (``page_tokens`` is a multiple of every layer's demotion block), so per-channel
key groups never mix requests or straddle pages. :class:`PagedBody` is one request's key or value body of one layer over its
blocks: the store an :class:`~hf_kvint2.layers.OscarLayer` writes demoted tokens into and reads as a
:class:`~hf_kvint2.stream.QuantizedBody`, with the interface of :class:`~hf_kvint2.stream.QuantizedStream`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..quant import QuantizedGroups
from ..recipes import LayerRecipe
from ..stream import PagedQuantizedBody, QuantizedBody, StreamCodec

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
class StreamPage:
    """Bytes of one stream's page, by part (``lo`` takes as many as ``scale``), each padded to ``REGION_ALIGN``."""

    codes: int
    scale: int
    norm: int

    @property
    def total(self) -> int:
        return self.codes + 2 * self.scale + self.norm


def stream_page(recipe: LayerRecipe, kind: str, heads: int, head_dim: int, page_tokens: int) -> StreamPage:
    """The bytes of one page of a layer's ``kind`` ("key" / "value") stream."""
    layout = recipe.key if kind == "key" else recipe.value
    itemsize = torch.empty((), dtype=recipe.scale_dtype).element_size()
    return StreamPage(codes=_aligned(heads * page_tokens * head_dim // 4),
                      scale=_aligned(stream_scale_elements(recipe, kind, heads, head_dim, page_tokens) * itemsize),
                      norm=_aligned(page_tokens * itemsize) if layout.token_scaling else 0)


def layer_page_bytes(recipe: LayerRecipe, heads: int, head_dim: int, page_tokens: int) -> int:
    """Bytes of one layer's key and value pages of ``page_tokens`` tokens."""
    return sum(stream_page(recipe, kind, heads, head_dim, page_tokens).total for kind in ("key", "value"))


class PageArena:
    """Typed views of every quantized layer's stream parts in the engine's byte arena (``cache_tensor``: room for
    ``num_blocks`` blocks of ``bytes_per_block`` bytes, including the engine's unused ones, which the block ids
    count too). ``views[layer_idx, kind]`` = (codes [H, blocks, page, D/4], scale and lo [H, blocks, elements],
    norm [blocks, page] or None)."""

    def __init__(self, cache_tensor: torch.Tensor, bytes_per_block: int, page_tokens: int, heads: int,
                 head_dim: int, recipes: dict[int, LayerRecipe]):
        self.page_tokens, self.heads, self.head_dim = page_tokens, heads, head_dim
        self.num_blocks = nb = cache_tensor.numel() // bytes_per_block
        self.views: dict[tuple[int, str], tuple] = {}
        offset = 0

        def part(nbytes_per_block: int, dtype: torch.dtype) -> torch.Tensor:
            nonlocal offset
            t = cache_tensor[offset:offset + nb * nbytes_per_block].view(dtype)
            offset += nb * nbytes_per_block
            return t

        h, d, p = heads, head_dim, page_tokens
        for idx, recipe in recipes.items():
            for kind in ("key", "value"):
                page = stream_page(recipe, kind, h, d, p)
                n_scale = stream_scale_elements(recipe, kind, h, d, p) // h
                codes = part(page.codes, torch.uint8)[:h * nb * p * d // 4].view(h, nb, p, d // 4)
                scale, lo = (part(page.scale, recipe.scale_dtype)[:h * nb * n_scale].view(h, nb, n_scale)
                             for _ in range(2))
                norm = part(page.norm, recipe.scale_dtype)[:nb * p].view(nb, p) if page.norm else None
                self.views[idx, kind] = (codes, scale, lo, norm)
        if offset > cache_tensor.numel():
            raise ValueError(f"The arena has {cache_tensor.numel()} bytes; its pages need {offset}.")
        self._device = cache_tensor.device
        self._gather_rows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._page_tables: dict[tuple, torch.Tensor] = {}

    def gather_rows(self, ids: tuple[int, ...], requests: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The index tensors of a gather of ``requests`` requests' pages (``ids``: their blocks, request by request,
        as many each): the rows of a part's [H * blocks, page] view in (request, head, page) order, so that the
        gather is the contiguous [G, H, tokens, ...] tensor the kernels read, and the blocks themselves (the token
        norms' rows). Every quantized layer of a step gathers the same pages: the last few are kept."""
        found = self._gather_rows.get(ids)
        if found is None:
            blocks = torch.tensor(ids, dtype=torch.long, device=self._device)
            pages = len(ids) // requests
            rows = (torch.arange(self.heads, device=self._device)[None, :, None] * self.num_blocks
                    + blocks.view(requests, 1, pages)).flatten()
            if len(self._gather_rows) >= 8:
                self._gather_rows.pop(next(iter(self._gather_rows)))
            found = self._gather_rows[ids] = (rows, blocks)
        return found

    def page_table(self, ids: tuple[int, ...], requests: int) -> torch.Tensor:
        """The page table [requests, pages] of ``requests`` requests' blocks (``ids``, request by request, as many
        each) for the kernel that reads pages in place. Every quantized layer of a step reads the same pages: the last
        few tables are kept."""
        found = self._page_tables.get(ids)
        if found is None:
            if len(self._page_tables) >= 8:
                self._page_tables.pop(next(iter(self._page_tables)))
            found = self._page_tables[ids] = torch.tensor(ids, dtype=torch.long).view(requests, -1)
        return found


def _widest_view(rows: torch.Tensor) -> torch.Tensor:
    """A [rows, bytes] tensor's rows as int64 where their bytes allow (a row copy then moves 8 bytes at a time)."""
    nbytes = rows.shape[1] * rows.element_size()
    if nbytes % 8 == 0 and (rows.storage_offset() * rows.element_size()) % 8 == 0 and rows.is_contiguous():
        return rows.view(torch.uint8).view(torch.int64)
    return rows


class PagedBody:
    """One request's INT2 body of one stream (key or value of one layer) in the arena's pages: ``block_ids`` (the
    request's block table, shared with the engine's allocator, which grows it) in token order, ``tokens`` written.

    The interface of :class:`~hf_kvint2.stream.QuantizedStream` that :class:`~hf_kvint2.layers.OscarLayer` uses:
    ``codec``, ``tokens``, ``append``, ``read``, ``truncate``, ``dequantize``, ``buffers``. Its pages stay where they
    are until the request ends, so a step may read them late (``stays_in_place``)."""

    stays_in_place = True

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

    def _scale_rows(self, part: torch.Tensor) -> torch.Tensor:
        """Scale / lo [H, blocks, elements] as rows: [H, blocks, page, D/G] (per-token groups) or
        [H, blocks, page/G, D] (per-channel)."""
        p, d, g = self.arena.page_tokens, self.arena.head_dim, self.codec.group
        if self.codec.layout.axis == "channel":
            return part.view(*part.shape[:2], p // g, d)
        return part.view(*part.shape[:2], p, d // g)

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
        scale, lo = self._scale_rows(self.scale), self._scale_rows(self.lo)
        while t < end:
            page, at = divmod(t, p)
            take = min(p - at, end - t)
            block = self.block_ids[page]
            self.codes[:, block, at:at + take] = q.codes[0, :, done:done + take]
            scale[:, block, at // g:(at + take) // g] = q.scale[0, :, done // g:(done + take) // g]
            lo[:, block, at // g:(at + take) // g] = q.lo[0, :, done // g:(done + take) // g]
            if self.norm is not None:
                self.norm[block, at:at + take] = norm[0, done:done + take]
            t += take
            done += take
        self._tokens = end

    def read(self, tokens: int | None = None) -> QuantizedBody:
        """The first ``tokens`` body tokens (default: all) as a :class:`QuantizedBody`: the request's pages gathered
        in token order with one copy each (INT2 bytes: an eighth of the float32 K/V they stand for)."""
        return self.gather_padded([self], [self._tokens if tokens is None else tokens])

    @staticmethod
    def _padded_block_ids(stores: list[PagedBody], tokens: list[int]) -> tuple[int, ...]:
        """The blocks holding the first ``tokens[g]`` body tokens of each store, request by request, as many for each
        as the longest needs: a request with fewer padded with its own first page (past its tokens: never read)."""
        p = stores[0].arena.page_tokens
        pages = max(1, -(-max(tokens) // p))
        ids = []
        for store, t in zip(stores, tokens):
            own = store.block_ids[:max(1, -(-t // p))]
            ids.extend(own + [own[0]] * (pages - len(own)))
        return tuple(ids)

    @staticmethod
    def read_pages(stores: list[PagedBody], tokens: list[int]) -> PagedQuantizedBody:
        """The first ``tokens[g]`` body tokens of each request's store (one codec) where they are: the arena's pages
        and the requests' page table (:class:`~hf_kvint2.stream.PagedQuantizedBody`), for the kernel that reads
        them in place; nothing is copied."""
        first = stores[0]
        table = first.arena.page_table(PagedBody._padded_block_ids(stores, tokens), len(stores))
        return PagedQuantizedBody(first.codec, first.codes, first._scale_rows(first.scale),
                                  first._scale_rows(first.lo), first.norm, max(tokens), table)

    @staticmethod
    def gather_padded(stores: list[PagedBody], tokens: list[int]) -> QuantizedBody:
        """The first ``tokens[g]`` body tokens of each request's store (one codec) as one :class:`QuantizedBody`
        ``[G, H, T, ...]`` of the longest's tokens: one gather over every request's pages, a request with fewer
        pages padded with its own first page (past its ``tokens[g]``: not attended)."""
        first = stores[0]
        n = max(tokens)
        ids = PagedBody._padded_block_ids(stores, tokens)
        rows, norm_rows = first.arena.gather_rows(ids, len(stores))
        g, heads = len(stores), first.codes.shape[0]

        def gathered(t: torch.Tensor) -> torch.Tensor:  # [H, blocks, rows, cols] -> [G, H, pages * rows, cols]
            flat = t.reshape(heads * t.shape[1], -1)
            wide = _widest_view(flat)  # the same bytes copied 8 at a time where the rows allow
            return wide.index_select(0, rows).view(t.dtype).view(g, heads, -1, t.shape[-1])

        norm = None if first.norm is None else first.norm.index_select(0, norm_rows).view(g, -1)
        return QuantizedBody(first.codec, gathered(first.codes), gathered(first._scale_rows(first.scale)),
                             gathered(first._scale_rows(first.lo)), norm, n)

    def dequantize(self, rotated: bool = False) -> torch.Tensor:
        return self.read().dequantize(rotated=rotated)

    def truncate(self, tokens: int) -> None:
        self._tokens = min(self._tokens, tokens)
