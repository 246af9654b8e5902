"""The kernel's two entry points from PyTorch: the body partial (:func:`body_attention`, the ``"numba"`` body
backend) and a dynamic layer's whole attention step (:func:`layer_step_attention`), with the numpy views they pass
(made once per buffer, codec or window where a decode step would otherwise remake them for every layer) and the
split-K choice (:func:`split_tokens`).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref

import numpy as np
import torch

from ..read_path import mask_to_additive
from .bits import SCALE_KINDS
from .ir import LANES
from .jit import NUMBA, first_call, require_numba
from .kernel import Mask, Stream, Windows, make_kernel

# Split-K (split_tokens): the body's tokens are split so that a step has work for every thread the kernel runs with,
# no split under SPLIT_MIN_TOKENS tokens, and no split for more query rows per KV head than SPLIT_MAX_ROWS. A split
# has a fixed cost (a few hundred body tokens' worth: its partial and its part of the merge), so there are as few
# splits as keep the threads busy: on one thread none.
SPLIT_COST_TOKENS = 300
SPLIT_MIN_TOKENS = 2048
SPLIT_MAX_ROWS = 64

_numba_threads = threading.local()  # .count: the Numba thread count this Python thread last set (_run)
_KINDS = {getattr(torch, name): kind for name, kind in SCALE_KINDS.items()}


@functools.lru_cache(maxsize=4096)  # a pure function of its integers, asked once per layer and step
def split_tokens(n: int, rows: int, tasks: int, align: int, threads: int) -> int:
    """Body tokens per parallel task (split-K) for a kernel running on ``threads`` threads, ``tasks`` = batch x KV
    heads: the number of splits per task that makes the step shortest, by a cost model of the body on the threads
    (rounds of parallel tasks, each its tokens plus a split's fixed ``SPLIT_COST_TOKENS``, and the merge's share of
    each split). One thread: no split; 3 KV heads on 2 threads: 2 splits (6 tasks, 3 per thread; 3 splits would
    leave one thread 5 of 9 tasks). None under ``SPLIT_MIN_TOKENS`` tokens, a multiple of ``align`` (the per-channel
    groups); no split for many query rows (a long chunk: its partials would be large). The split sets the summation
    order, so results depend on the thread count in the last bits, as PyTorch's own reductions do."""
    tasks = max(tasks, 1)
    most = min(n // SPLIT_MIN_TOKENS, 2 * -(-threads // tasks))
    if rows > SPLIT_MAX_ROWS or most <= 1:
        return max(n, 1)

    def cost(s: int) -> float:  # in body tokens
        return -(-tasks * s // threads) * (n / s + SPLIT_COST_TOKENS) + -(-tasks // threads) * s * SPLIT_COST_TOKENS

    splits = min(range(1, most + 1), key=cost)
    per_split = -(-n // splits)
    return -(-per_split // align) * align


def kernel_threads() -> int:
    """The threads the kernel runs with: torch's intra-op thread count, at most Numba's pool."""
    if not NUMBA:
        return 1
    import numba

    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def body_attention(q_rot, key_body, value_body, *, scaling, key_mean_logits=None, mask=None, split=None):
    """The body partial over :class:`~hf_kvint2.stream.QuantizedBody` tokens, as
    :func:`hf_kvint2.read_path.body_partial_blocked` computes it: ``(out_rot [B, Hq, Lq, D] fp32, lse [B, Hq, Lq]
    fp32)``. ``split``: body tokens per task (default :func:`split_tokens`; a multiple of the per-channel group
    sizes)."""
    threads = kernel_threads()
    b, hq, lq, d, n, hkv, rows, split = _call_shapes(q_rot, key_body, value_body, split, threads)
    padded = -(-rows // LANES) * LANES
    q = (q_rot.detach().float() * scaling).reshape(b, hkv, rows, d)
    if padded != rows:
        q = torch.cat([q, q.new_zeros(b, hkv, padded - rows, d)], dim=2)
    bias = torch.zeros(b, hkv, padded)
    if key_mean_logits is not None:
        bias[:, :, :rows] = (scaling * key_mean_logits.detach().float()).reshape(b, hkv, rows)
    mask_rows = _mask_rows(mask, b, n)
    out = np.empty((b, hkv, padded, d), np.float32)
    lse = np.empty((b, hkv, padded), np.float32)
    _run(threads, q.contiguous().numpy(), bias.numpy(), padded, _stream(key_body, b), _stream(value_body, b),
         _no_windows(d), Mask(mask_rows.numpy(), 0, lq, _body_lengths(None, b, n)),
         _page_table(key_body, value_body, b, n), n, split, scaling, False, out, lse)
    out_t, lse_t = torch.from_numpy(out), torch.from_numpy(lse)
    if padded != rows:
        out_t, lse_t = out_t[:, :, :rows], lse_t[:, :, :rows]
    return out_t.reshape(b, hq, lq, d), lse_t.reshape(b, hq, lq)


def layer_step_attention(query, before, key_body, value_body, after, *, scaling, mask=None, split=None,
                         window_rows=None, after_tokens=None, body_tokens=None):
    """A whole attention step of a dynamic layer in one compiled call: ``query`` [B, Hq, Lq, D] (original space)
    over the full-precision window ``before`` = ``(k, v)`` [B, Hkv, n0, D] (the sink), the body's tokens and the
    window ``after`` (recent tokens and the current chunk), in that order; ``mask`` bool/additive over all of their
    tokens, broadcastable to [B, 1, Lq, n0 + body + n1], or None. The arithmetic of
    :func:`hf_kvint2.read_path.attend_segments` with :func:`body_attention` (fp32; another summation order), without
    its ~20 small PyTorch ops per layer, which cost more than the body itself at batch 1. Returns [B, Hq, Lq, D] in
    the query's dtype. For decode steps and short chunks (see :func:`serves_layer_step`).

    ``window_rows`` (one int per batch row: a LongTensor [B] or a list, as the per-row values below): the windows
    have rows of their own, W >= B of them (a serving engine's window slots, read in place instead of gathered):
    batch row b reads window row ``window_rows[b]``, of ``after`` its first ``after_tokens`` tokens (an int for every
    row, or one per row: each row's own, the rest not attended, no mask needed). ``body_tokens`` (one per row): the
    body tokens each row holds (its first ones): the kernel skips the others, which a batch of requests of different
    lengths pads its bodies with. A mask's columns are the sink's, the body's and ``after_tokens`` (its largest)
    tokens, and must hide what a row does not hold."""
    threads = kernel_threads()
    b, hq, lq, d, n, hkv, rows, split = _call_shapes(query, key_body, value_body, split, threads)
    (k0, v0), (k1, v1) = before, after
    n0 = k0.shape[2]
    if window_rows is None:
        n1, arrays, window_of = k1.shape[2], (_window_array(k1), _window_array(v1)), _batch_rows(b)
        after_rows = _same_rows(b, n1)
    else:
        arrays, window_of = (_window_array(k1, whole=True), _window_array(v1, whole=True)), \
            _per_row(window_rows, b, min(k0.shape[0], k1.shape[0]) - 1, "window_rows", "a row of the windows")
        if after_tokens is None:
            raise ValueError("window_rows needs after_tokens: the tokens of the windows after the body each row holds.")
        if isinstance(after_tokens, (torch.Tensor, np.ndarray, list, tuple)):
            after_rows = _per_row(after_tokens, b, k1.shape[2], "after_tokens", "the windows' token slots")
            n1 = int(after_rows.max()) if b else 0
        else:
            n1 = int(after_tokens)
            if not 0 <= n1 <= k1.shape[2]:
                raise ValueError(f"after_tokens={n1} must be within the windows' {k1.shape[2]} token slots.")
            after_rows = _same_rows(b, n1)
    q = _float32_array(query).reshape(b, hkv, rows, d)  # a copy only where the query is not contiguous
    mask_rows = _mask_rows(mask, b, n0 + n + n1)
    rot_k, mean_k, _ = _codec_arrays(key_body.codec)
    _, mean_v, rot_v_t = _codec_arrays(value_body.codec)
    windows = Windows(_window_array(k0, whole=True), _window_array(v0, whole=True), *arrays, after_rows, rot_k, mean_k,
                      rot_v_t, mean_v, window_of)
    out = np.empty((b, hkv, rows, d), np.float32)
    lse = np.empty((b, hkv, rows), np.float32)
    lengths = _body_lengths(body_tokens, b, n)
    _run(threads, q, _no_bias(), rows, _stream(key_body, b), _stream(value_body, b), windows,
         Mask(mask_rows.numpy(), n0, lq, lengths), _page_table(key_body, value_body, b, int(lengths.max(initial=0))), n,
         split, scaling, True, out, lse)
    out = torch.from_numpy(out.reshape(b, hq, lq, d))
    return out if query.dtype == torch.float32 else out.to(query.dtype)


@functools.cache
def _batch_rows(b: int) -> np.ndarray:
    """Window rows 0 .. b-1: each batch row reads its own windows (shared: never written)."""
    return np.arange(b, dtype=np.int64)


@functools.lru_cache(maxsize=256)
def _same_rows(b: int, n: int) -> np.ndarray:
    """``n`` for each of ``b`` batch rows (shared: never written)."""
    return np.full(b, n, np.int64)


def _body_lengths(body_tokens: torch.Tensor | None, b: int, n: int) -> np.ndarray:
    """The body tokens of each batch row as the kernel's int64 array: ``n`` for every row, or ``body_tokens``
    (checked: one per row, each 0 .. n)."""
    if body_tokens is None:
        return _same_rows(b, n)
    return _per_row(body_tokens, b, n, "body_tokens", "the body's tokens")


def _per_row(values, b: int, most: int, name: str, what: str) -> np.ndarray:
    """``values`` (one integer per batch row, each 0 .. ``most``: a LongTensor or a sequence of ints) as the kernel's
    int64 array; anything else is refused, naming ``name`` and ``what`` its values count (a value out of range would
    read outside the kernel's arrays)."""
    if isinstance(values, torch.Tensor):
        array = values.detach().to("cpu", torch.int64).contiguous().numpy()
    else:
        array = np.asarray(values, dtype=np.int64)
    if array.shape != (b,) or (b and (int(array.min()) < 0 or int(array.max()) > most)):
        shown = values.tolist() if isinstance(values, torch.Tensor) else values
        raise ValueError(f"{name} must hold one value (0 .. {most}, {what}) for each of the {b} batch rows; got "
                         f"{shown}.")
    return array


def serves_layer_step(query, key_body) -> bool:
    """Whether :func:`layer_step_attention` serves this query: CPU, eager, no gradient, at most
    ``SPLIT_MAX_ROWS`` query rows per KV head (decode steps and short chunks; a long chunk's window is the chunk
    itself, which SDPA's flash kernel attends faster)."""
    rows = query.shape[1] // key_body.heads * query.shape[2]
    return (NUMBA and query.device.type == "cpu" and rows <= SPLIT_MAX_ROWS and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and query.requires_grad))


def _run(threads: int, q, bias, rows: int, keys: Stream, values: Stream, windows: Windows, mask: Mask,
         pages: np.ndarray, n: int, split: int, scaling: float, whole: bool, out: np.ndarray, lse: np.ndarray) -> None:
    """The kernel for this head_dim (compiled or loaded on first use; see :mod:`.kernel` for the arguments) on
    ``threads`` threads (:func:`kernel_threads`)."""
    import numba

    kernel = make_kernel(q.shape[-1])
    torch_threads = torch.get_num_threads()
    # Numba's thread count is per Python thread. Asking Numba for it costs ~10 us a call, so the count this
    # thread last set is remembered instead.
    if getattr(_numba_threads, "count", None) != threads:
        numba.set_num_threads(threads)
        _numba_threads.count = threads
    # the specialisation: head_dim and the scales' array types (int16 bits or float32)
    first_call(("attend", q.shape[-1], keys.scale.dtype, values.scale.dtype), kernel, q, bias, rows, keys, values,
               windows, mask, pages, n, split, np.float32(scaling), whole, out, lse)
    if torch.get_num_threads() != torch_threads:  # both may use the OpenMP runtime: keep torch's setting
        torch.set_num_threads(torch_threads)


def _call_shapes(q, key_body, value_body, split: int | None, threads: int) -> tuple:
    """``(b, hq, lq, d, body tokens, kv heads, query rows per KV head, split)`` of a kernel call; ``split`` checked
    (a positive multiple of the per-channel group sizes) or chosen by :func:`split_tokens` for ``threads``."""
    require_numba()
    b, hq, lq, d = q.shape
    hkv = key_body.heads
    rows = (hq // hkv) * lq
    align = 1
    for body in (key_body, value_body):
        if body.layout.axis == "channel":
            align = math.lcm(align, body.group)
    if split is None:
        split = split_tokens(key_body.tokens, rows, b * hkv, align, threads)
    elif split <= 0 or split % align:
        raise ValueError(f"split={split} must be a positive multiple of the per-channel group size {align}.")
    return b, hq, lq, d, key_body.tokens, hkv, rows, split


_NO_MASK = torch.zeros(0, 0, 1)  # the kernel's "no mask" (zero mask rows; read only)


def _mask_rows(mask, b: int, cols: int) -> torch.Tensor:
    """bool/additive mask broadcastable to [B, 1, Lq, cols] -> fp32 additive [B, Lq or 1, cols] ([0, 0, 1]: none)."""
    if mask is None:
        return _NO_MASK
    add = mask_to_additive(mask.detach())
    if add is None:
        return _NO_MASK
    if add.dim() != 4 or add.shape[1] != 1:
        raise ValueError(f"The body mask must broadcast to [batch, 1, query_len, tokens], got {tuple(add.shape)}.")
    return add.expand(b, 1, add.shape[2], cols).reshape(b, -1, cols).contiguous()


@functools.cache
def _no_pages(batch: int) -> np.ndarray:
    return np.zeros((batch, 0), np.int64)


def _page_table(key_body, value_body, batch: int, tokens: int) -> np.ndarray:
    """The kernel's page table: ``[B, 0]`` for bodies [B, H, tokens, ...]; for bodies read in place from an arena's
    pages (:class:`~hf_kvint2.stream.PagedQuantizedBody`, both streams' the same table), the table, checked (one row
    per batch row, pages for ``tokens`` tokens, every block in the arena: the kernel reads what it names)."""
    pages, value_pages = getattr(key_body, "pages", None), getattr(value_body, "pages", None)
    if pages is None and value_pages is None:
        return _no_pages(batch)
    if pages is None or value_pages is not pages or key_body.page_tokens != value_body.page_tokens:
        raise ValueError("The keys' and values' bodies must be read from the same pages (one page table), or both "
                         "be [B, H, tokens, ...] tensors.")
    table = pages.detach().to("cpu", torch.int64).contiguous().numpy()
    need = -(-tokens // key_body.page_tokens)
    blocks = min(key_body.codes.shape[1], value_body.codes.shape[1])
    if table.ndim != 2 or table.shape[0] != batch or table.shape[1] < need or \
            (need and (int(table[:, :need].min()) < 0 or int(table[:, :need].max()) >= blocks)):
        raise ValueError(f"The page table must be [{batch}, >= {need}] (the batch's rows, pages of "
                         f"{key_body.page_tokens} tokens for {tokens} tokens) of blocks 0 .. {blocks - 1}; got "
                         f"{tuple(table.shape)} with blocks {table.min(initial=0)} .. {table.max(initial=0)}.")
    return table


def _stream(body, batch: int) -> Stream:
    """A :class:`~hf_kvint2.stream.QuantizedBody` as the kernel's record: its tensors as numpy arrays (the
    buffers themselves, with their spare capacity: the kernel reads the rows in use), scales, offsets and norms as
    stored (int16 bits of float16 / bfloat16, or float32); float32 copies if their dtypes differ."""
    scale, lo, norm = body.scale, body.lo, body.norm
    dtype = scale.dtype
    kind = _KINDS.get(dtype, 2)
    if getattr(body, "pages", None) is not None:  # an arena's pages, read in place: never copied
        if lo.dtype != dtype or (norm is not None and norm.dtype != dtype) or (kind == 2 and dtype != torch.float32) or \
                not all(t.is_contiguous() for t in (body.codes, scale, lo, *(() if norm is None else (norm,)))):
            raise ValueError("Pages read in place must be contiguous, their scales, offsets and norms of one dtype.")
        bits = (lambda t: t.numpy()) if kind == 2 else (lambda t: t.view(torch.int16).numpy())
        return Stream(body.codes.numpy(), bits(scale), bits(lo), _no_norm(1, kind) if norm is None else bits(norm),
                      body.layout.axis == "token", body.group, kind)
    buffers = body.buffers
    if buffers is not None and buffers[0].data is body.codes and lo.dtype == dtype and \
            (norm is None or norm.dtype == dtype):
        # the buffers of a dynamic stream, unchanged since the read: their numpy views, made once per buffer
        arrays = [buffers[0].array(), buffers[1].array(), buffers[2].array(),
                  buffers[3].array() if norm is not None else _no_norm(batch, kind)]
    else:
        stored = (scale, lo) if norm is None else (scale, lo, norm)
        if kind == 2 or any(t.dtype != dtype for t in stored):
            kind, converted = 2, [_float32_array(t) for t in stored]
        else:  # the bits of the 16-bit values
            converted = [_contiguous_array(t.view(torch.int16)) for t in stored]
        arrays = [_contiguous_array(body.codes), converted[0], converted[1],
                  converted[2] if norm is not None else _no_norm(batch, kind)]
    return Stream(*arrays, body.layout.axis == "token", body.group, kind)


_CODEC_ARRAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _codec_arrays(codec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rotation, mean or [0, D], rotation transposed) of a :class:`~hf_kvint2.stream.StreamCodec` as numpy arrays,
    made once per codec (a codec never changes; a decode step would otherwise convert them for every layer)."""
    arrays = _CODEC_ARRAYS.get(codec)
    if arrays is None:
        d = codec.rotation.shape[-1]
        mean = np.zeros((0, d), np.float32) if codec.mean is None else _float32_array(codec.mean)
        arrays = (_float32_array(codec.rotation), mean, _float32_array(codec.rotation.T))
        _CODEC_ARRAYS[codec] = arrays
    return arrays


# id(tensor) -> (weak reference to it, its numpy view, offset, strides, shape); by id because a tensor's == is
# elementwise (a WeakKeyDictionary compares its keys with it); an entry leaves with its tensor
_HELD_ARRAYS: dict[int, tuple] = {}


def _forget_held(key: int, ref) -> None:
    entry = _HELD_ARRAYS.get(key)
    if entry is not None and entry[0] is ref:
        del _HELD_ARRAYS[key]


def _window_array(x: torch.Tensor, whole: bool = False) -> np.ndarray:
    """A full-precision window [B, H, n, D] for the kernel as a float32 array: the buffer x is the first n tokens
    of, where it is one (a dynamic layer's recent window, appended in place: no copy of it per step; the kernel reads
    its first n tokens), else x as a C-contiguous float32 array. ``whole``: x itself, never a longer buffer (the
    sink, whose every token the kernel reads). The numpy view of a tensor that stays (a buffer, the sink) is made
    once and kept while the tensor lives: a decode step reads the same 4 windows in every layer."""
    held = x if x._base is None or whole else x._base
    known = _HELD_ARRAYS.get(id(held))
    if known is None or known[0]() is not held:
        if not (held.dtype == torch.float32 and held.dim() == 4 and held.is_contiguous() and not held.requires_grad):
            return _float32_array(x)
        key = id(held)
        ref = weakref.ref(held, lambda r, key=key: _forget_held(key, r))
        known = _HELD_ARRAYS[key] = (ref, held.numpy(), held.storage_offset(), held.stride(), held.shape)
    _, array, offset, stride, shape = known
    # x is the held tensor (whole) or its first tokens: same start, strides, batch, heads and head_dim
    if x.storage_offset() == offset and x.stride() == stride and not x.requires_grad and \
            (x.shape == shape if whole else x.shape[:2] == shape[:2] and x.shape[3] == shape[3]):
        return array
    return _float32_array(x)


def _contiguous_array(x: torch.Tensor) -> np.ndarray:
    return (x if x.is_contiguous() else x.contiguous()).numpy()


def _float32_array(x: torch.Tensor) -> np.ndarray:
    """x as a C-contiguous float32 array (the tensor's own memory when it is one already)."""
    if x.requires_grad:
        x = x.detach()
    return (x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()).numpy()


@functools.cache
def _no_norm(batch: int, kind: int) -> np.ndarray:
    return np.zeros((batch, 0), np.int16 if kind != 2 else np.float32)


@functools.cache
def _no_windows(d: int) -> Windows:
    """The layer step's inputs as zero-size stand-ins, for the body kernel (the same compiled kernel)."""
    window, matrix = np.zeros((1, 1, 0, d), np.float32), np.zeros((d, d), np.float32)
    return Windows(window, window, window, window, _batch_rows(0), matrix, np.zeros((0, d), np.float32), matrix,
                   np.zeros((0, d), np.float32), _batch_rows(0))


@functools.cache
def _no_bias() -> np.ndarray:
    return np.zeros((0, 0, 0), np.float32)
