"""The quantized body of one of K or V: how tokens are transformed and stored (:class:`StreamCodec`), the growing
store of a dynamic layer (:class:`QuantizedStream`) and the read-only view every reader takes
(:class:`QuantizedBody`).

Write path: original-space tokens -> centre (``- mean``) -> rotate (``@ R``) -> optional omni-token norm ->
row clip -> INT2 groups (:mod:`hf_kvint2.quant`) -> buffers. Read path: a :class:`QuantizedBody` (codes, scales,
offsets, norms, layout, rotation, mean over tensors that may be larger than the tokens in use) goes to a
body-partial backend (:mod:`hf_kvint2.backends`), which works in the rotated space; :meth:`StreamCodec.unrotate`
brings the result back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_kernels, kernels
from .distributed import TensorParallelShard
from .quant import QuantizedGroups, dequantize_int2, quantize_int2
from .recipes import GroupLayout
from .storage import TokenBuffer
from .transforms import check_norms, rotate_tokens, transform_tokens


@dataclass(frozen=True, eq=False)
class StreamCodec:
    """How one stream transforms and (de)quantizes tokens: layout, group actually used, rotation [D, D] (fp32),
    mean [H, D] or None, scale dtype, and the tensor-parallel shard its token norm is summed over (or None)."""

    layout: GroupLayout
    group: int
    rotation: torch.Tensor
    mean: torch.Tensor | None
    scale_dtype: torch.dtype
    shard: TensorParallelShard | None = None

    def transform(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Original-space x [B, H, n, D] -> (rotated, scaled, clipped float32 x, stored norms [B, n] or None)."""
        reduce = None if self.shard is None else self.shard.all_reduce_sum
        return transform_tokens(x, self.rotation, self.mean, clip=self.layout.clip,
                                token_scaling=self.layout.token_scaling, scale_dtype=self.scale_dtype,
                                all_reduce_sum=reduce)

    def quantize(self, x: torch.Tensor, out: tuple | None = None) -> tuple[QuantizedGroups, torch.Tensor | None]:
        """What the stream stores for original-space x [B, H, n, D]: INT2 groups and norms (or None). On CPU,
        per-token groups without token scaling are clipped and quantized by one compiled call
        (:func:`~hf_kvint2.cpu_kernels.quantize_token_groups`, bit-identical to the PyTorch ops), which writes into
        ``out`` = (codes, scale, lo) views if given (only for those layouts: see ``quantizer_supports``)."""
        if cpu_kernels.quantizer_supports(self.layout, x):
            xr = rotate_tokens(x, self.rotation, self.mean)
            return cpu_kernels.quantize_token_groups(xr, self.layout.clip, self.group, self.scale_dtype, out), None
        xt, norm = self.transform(x)
        return quantize_int2(xt, self.layout.axis, self.group, self.scale_dtype, self.layout.range_clip), norm

    def dequantize_groups(self, q: QuantizedGroups, norm: torch.Tensor | None, rotated: bool = False) -> torch.Tensor:
        """Float32 [B, H, T, D] from groups and norms [B, T]: in the transformed space if ``rotated`` (norms
        applied), else original."""
        x = dequantize_int2(q, self.layout.axis, self.group)
        if norm is not None:
            x = x * norm.float()[:, None, :, None]
        return x if rotated else self.unrotate(x)

    def unrotate(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """Rotated-space x [B, H, T, D] back to the original space (``x R^T + mean``). ``groups > 1``: x has one
        row per query head (``H = kv_heads * groups``, query head h reads KV head h // groups), as attention
        outputs do."""
        x = x @ self.rotation.T
        if self.mean is not None:
            x = x + self.mean.repeat_interleave(groups, dim=0)[None, :, None, :]
        return x

    def mean_logits(self, q: torch.Tensor, groups: int) -> torch.Tensor | None:
        """``q . mean`` [B, Hq, L] for queries q [B, Hq, L, D] (keys are stored centred), or None without a mean."""
        if self.mean is None:
            return None
        return (q @ self.mean.repeat_interleave(groups, dim=0).unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True, eq=False)
class _StoredTokens:
    """What every INT2 body holds: its codec, packed codes, group scales and offsets, token norms (or None) and
    the tokens its readers attend; the group layout and size are the codec's."""

    codec: StreamCodec
    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    norm: torch.Tensor | None
    tokens: int

    @property
    def layout(self) -> GroupLayout:
        return self.codec.layout

    @property
    def group(self) -> int:
        return self.codec.group


@dataclass(frozen=True, eq=False)
class QuantizedBody(_StoredTokens):
    """Read-only INT2 tokens ``[0, tokens)`` of one stream: what every body-partial backend reads.

    codes ``[B, H, >= tokens, D/4]`` uint8; scale / lo ``[B, H, rows, D/G]`` (per-token groups) or
    ``[B, H, rows, D]`` (per-channel groups of ``G`` tokens); norm ``[B, >= tokens]`` or None. The tensors may hold
    more rows than ``tokens`` (a dynamic layer's capacity, a static layer's whole body); readers ignore them.
    """

    buffers: tuple[TokenBuffer, ...] | None = None  # codes, scale, lo (, norm): a dynamic stream's, which hold them

    @property
    def heads(self) -> int:
        return self.codes.shape[1]

    def rows_for(self, tokens: int) -> int:
        """Scale rows that cover the first ``tokens`` tokens."""
        return tokens if self.layout.axis == "token" else -(-tokens // self.group)

    def dequantize(self, t0: int = 0, t1: int | None = None, rotated: bool = False) -> torch.Tensor:
        """Float32 tokens ``[t0, t1)`` [B, H, t1 - t0, D] (default: all ``tokens``), rotated (norms applied) or in
        the original space. Per-channel scales cover whole groups of tokens: the aligned span is dequantized."""
        t1 = self.tokens if t1 is None else t1
        g = self.group if self.layout.axis == "channel" else 1
        a0, a1 = (t0 // g) * g, -(-t1 // g) * g
        q = QuantizedGroups(self.codes[:, :, a0:a1], self.scale[:, :, a0 // g:a1 // g], self.lo[:, :, a0 // g:a1 // g])
        norm = None if self.norm is None else self.norm[:, a0:a1]
        return self.codec.dequantize_groups(q, norm, rotated)[:, :, t0 - a0:t1 - a0]



@dataclass(frozen=True, eq=False)
class PagedQuantizedBody(_StoredTokens):
    """Read-only INT2 tokens of several sequences where they are stored: pages of an arena (a serving engine's), each
    sequence's in the order of its row of ``pages``. Read by the Numba kernel in place (no gather of the pages).

    codes ``[H, blocks, page, D/4]`` uint8; scale / lo ``[H, blocks, page, D/G]`` (per-token groups) or
    ``[H, blocks, page/G, D]`` (per-channel groups of ``G`` tokens, whole in a page); norm ``[blocks, page]`` or
    None; pages ``[B, max pages]`` int64: sequence b's token t is row ``t % page`` of block ``pages[b, t // page]``.
    ``tokens``: the longest sequence's (each attends its own, given by the reader's per-row lengths).
    """

    pages: torch.Tensor
    buffers = None  # (as a QuantizedBody read from pages: no dynamic stream's buffers)

    @property
    def heads(self) -> int:
        return self.codes.shape[0]

    @property
    def page_tokens(self) -> int:
        return self.codes.shape[2]


class QuantizedStream:
    """The growing INT2 body of one of K or V in a dynamic layer: packed codes, group scales/offsets and (with
    token scaling) token norms, written by :meth:`append` with its :class:`StreamCodec`."""

    def __init__(self, codec: StreamCodec):
        self.codec = codec
        self.codes, self.scale, self.lo = TokenBuffer(2), TokenBuffer(2), TokenBuffer(2)
        self.norm = TokenBuffer(1) if codec.layout.token_scaling else None
        self._cpu_writer = self._compiled_writer(codec)
        self._last_read: QuantizedBody | None = None  # read()'s last result

    @staticmethod
    def _compiled_writer(codec: StreamCodec) -> cpu_kernels.TokenGroupQuantizer | None:
        """The compiled clip + quantizer of this stream's CPU appends: per-token groups without token scaling, with
        Numba installed (else None)."""
        layout, d = codec.layout, codec.rotation.shape[-1]
        if cpu_kernels.quantizer_serves_layout(layout) and d % codec.group == 0:
            return cpu_kernels.token_group_quantizer(d, codec.group, layout.clip, codec.scale_dtype)
        return None

    def __getstate__(self) -> dict:  # a copy (pickle, deepcopy) looks its compiled writer up again
        return {**self.__dict__, "_cpu_writer": None, "_last_read": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_last_read", None)
        self._cpu_writer = self._compiled_writer(self.codec)

    @property
    def tokens(self) -> int:
        return self.codes.rows

    def buffers(self) -> list[TokenBuffer]:
        return [b for b in (self.codes, self.scale, self.lo, self.norm) if b is not None]

    def append(self, x: torch.Tensor) -> None:
        # The body is data, not part of the autograd graph: no gradient flows through INT2 codes (README).
        x = x.detach()
        writer = self._cpu_writer
        if writer is not None and x.is_cpu and self.codes.data is not None and not torch.compiler.is_compiling():
            # CPU, per-token groups (a decode step's demotion): rotated, then clipped and quantized by the layout's
            # compiled quantizer straight into the buffers' next rows, through their numpy views (made once per
            # buffer). Few Python steps: inside a model's step each costs microseconds.
            n, codes, scale, lo = x.shape[2], self.codes, self.scale, self.lo
            codes.reserve(n)
            scale.reserve(n)
            lo.reserve(n)
            xr = rotate_tokens(x, self.codec.rotation, self.codec.mean)  # a fresh float32 tensor
            writer.write(xr.numpy(), codes.array(), scale.array(), lo.array(), codes.rows)
            codes.rows = scale.rows = lo.rows = codes.rows + n
            return
        if self.codec.shard is None and kernels.kernels_enabled_for(x):  # CUDA: fused Triton transform + pack
            q, norm = kernels.quantize_stream(self.codec, x)
            if norm is not None:
                check_norms(norm, self.codec.scale_dtype)
        else:
            q, norm = self.codec.quantize(x)
        self.codes.append(q.codes)
        self.scale.append(q.scale)
        self.lo.append(q.lo)
        if norm is not None:
            self.norm.append(norm)

    def read(self, tokens: int | None = None) -> QuantizedBody:
        """The first ``tokens`` stored tokens (default: all) as a :class:`QuantizedBody` over the buffers."""
        n = self.tokens if tokens is None else tokens
        last = self._last_read
        # a decode step reads every layer's streams, unchanged since the last step but for a demotion: the last
        # read again while its tokens and buffers are the same (a body is read-only)
        if last is not None and last.tokens == n and last.codes is self.codes.data and \
                last.scale is self.scale.data and last.lo is self.lo.data and \
                (self.norm is None or last.norm is self.norm.data):
            return last
        body = QuantizedBody(self.codec, self.codes.data, self.scale.data, self.lo.data,
                             None if self.norm is None else self.norm.data, n, tuple(self.buffers()))
        self._last_read = body
        return body

    def dequantize(self, rotated: bool = False) -> torch.Tensor:
        """Float32 body [B, H, T, D]: in the transformed space if ``rotated`` (norms applied), else original."""
        q = QuantizedGroups(self.codes.view(), self.scale.view(), self.lo.view())
        return self.codec.dequantize_groups(q, None if self.norm is None else self.norm.view(), rotated)

    def truncate(self, tokens: int) -> None:
        rows = tokens // self.codec.group if self.codec.layout.axis == "channel" else tokens
        self.scale.truncate(rows)
        self.lo.truncate(rows)
        self.codes.truncate(tokens)
        if self.norm is not None:
            self.norm.truncate(tokens)
