"""One forward of one cache layer as the attention sees it: a step object, and the placeholders that carry it.

transformers calls ``cache.update(k, v, layer_idx)`` and passes what it returns to the attention function. An
Oscar layer's ``update`` wraps the forward in a step (:class:`LayerStep` for the dynamic layers,
:class:`StaticStep` for the static ones) and returns either

* the **portable view** (every token in the original space, body dequantized): ordinary tensors, tagged with the
  layer (``oscar_layer`` attribute, a weak reference) so that the ``"oscar"`` attention can tell the layer it is
  read by ``"oscar"`` (``layer.fused_attention = True``); or, once that flag is set,
* :class:`DeferredKV` placeholders (no storage) that carry the step. The ``"oscar"`` attention calls
  ``step.attend``; any other attention implementation that touches a placeholder gets the portable view, so
  results are right whatever the model's attention implementation is.

Everything the attention needs travels on these objects; there is no module-level state.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.utils import _pytree as pytree
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .backends import select_body_partial
from .quant import to_model_dtype, tracing
from .read_path import attend_segments, step_mask

PORTABLE_PATH_WARNING = (
    "hf_kvint2: this Oscar cache is read through the portable attention path, which dequantizes the layer's whole "
    "INT2 cache at every step (slow). Load the model with attn_implementation=\"oscar\" (or call "
    "model.set_attn_implementation(\"oscar\")) after `import hf_kvint2` for the fused INT2 attention."
)
_portable_warning = {"issued": False}  # warn once per process (a user-facing notice, not state of a computation)


def warn_portable_path_once() -> None:
    if not _portable_warning["issued"]:
        _portable_warning["issued"] = True
        warnings.warn(PORTABLE_PATH_WARNING, UserWarning, stacklevel=3)


def portable_output(layer, keys: torch.Tensor, values: torch.Tensor, body_tokens: int):
    """Return the portable view, tagged with its layer (see the module docstring); warns once if slow. A layer's
    first view goes out before any attention has read it (the "oscar" attention claims the layer when it sees
    the tag), so only a later one shows that another attention implementation reads the cache."""
    if body_tokens and getattr(layer, "portable_views", 0):
        warn_portable_path_once()
    layer.portable_views = getattr(layer, "portable_views", 0) + 1
    keys.oscar_layer = weakref.ref(layer)
    return keys, values


class _Step:
    """What both step kinds share: the portable view made once (``_view``) and released after use, and the
    output of ``update`` (placeholders with ``like``'s batch/heads/dtype, or the tagged portable view)."""

    __slots__ = ()

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The portable view: every token in the original space and the model's dtype (body dequantized)."""
        if self._full is None:
            self._full = self._view()
        return self._full

    def release(self) -> None:
        """Drop the cached portable view (the caller owns the tensors; keep no full-precision history)."""
        self._full = None

    def output(self, like: torch.Tensor):
        """What ``update`` returns: placeholders once the layer is read by ``"oscar"``, else the portable view."""
        if self.layer.fused_attention:
            return DeferredKV.pair(self, like)
        keys, values = self.materialize()
        self.release()
        return portable_output(self.layer, keys, values, self.body_tokens)


class LayerStep(_Step):
    """One forward of one :class:`~hf_kvint2.layers.OscarLayer`.

    Token order: ``sink_k`` (past sink tokens), the first ``body_tokens`` tokens of the layer's INT2 body, then
    ``tail_k`` (past recent tokens followed by the current chunk, all full precision). Tokens of the current chunk
    that were already demoted to the body or stored in the sink are attended from the chunk itself.
    """

    __slots__ = ("__weakref__", "_bodies", "_full", "body_tokens", "chunk_tail", "layer", "sink_k", "sink_v",
                 "stores", "tail_k", "tail_v")

    def __init__(self, layer, key_states: torch.Tensor, value_states: torch.Tensor):
        n_new = key_states.shape[-2]
        past = layer.seq_len - n_new
        n_sink = layer.sink_k.shape[-2]
        self.layer = layer
        if n_sink <= past:  # the whole sink is past (every step after the first chunk): no slice to make
            self.sink_k, self.sink_v = layer.sink_k, layer.sink_v
        else:
            self.sink_k, self.sink_v = layer.sink_k[:, :, :past], layer.sink_v[:, :, :past]
        self.body_tokens = min(max(past - n_sink, 0), layer.body_len)
        recent_past = past - n_sink - layer.body_len
        self.chunk_tail = n_new > layer.recent_k.shape[-2]
        if not self.chunk_tail:  # the chunk is the newest part of the recent window
            self.tail_k, self.tail_v = layer.recent_k, layer.recent_v
        else:  # the chunk overflowed the window, so every recent token is from it
            assert recent_past <= 0, "OscarLayer invariant: an overflowing chunk fills the whole recent window"
            self.tail_k, self.tail_v = key_states, value_states
        self.stores = (layer.key_body, layer.value_body)
        if getattr(layer.key_body, "stays_in_place", False):  # read when (and if) the attention reads it
            self._bodies = None
        else:  # the body as it is now: the attention reads these tensors even if the layer is offloaded meanwhile
            # (transformers' offloading moves a layer to the CPU as soon as its update returns)
            self._bodies = (layer.key_body.read(self.body_tokens), layer.value_body.read(self.body_tokens))
        self._full = None

    def _read_bodies(self):
        if self._bodies is None:
            self._bodies = (self.stores[0].read(self.body_tokens), self.stores[1].read(self.body_tokens))
        return self._bodies

    @property
    def key_body(self):
        """The first ``body_tokens`` of the key body (a :class:`~hf_kvint2.stream.QuantizedBody`)."""
        return self._read_bodies()[0]

    @property
    def value_body(self):
        return self._read_bodies()[1]

    @property
    def seq_len(self) -> int:
        return self.sink_k.shape[-2] + self.body_tokens + self.tail_k.shape[-2]

    def batch_key(self) -> tuple | None:
        """Steps with equal keys can be attended in one call (:func:`decode_batch`): bodies in stores that gather
        several at once (``gather_padded``), the same codecs (rotations, means, layouts) for keys and values, the
        same sink length, dtype and device. None: this step is attended alone."""
        if not hasattr(type(self.stores[0]), "gather_padded"):
            return None
        codecs = [type(self.stores[0])]
        for store in self.stores:
            c = store.codec
            codecs.append((id(c.rotation), id(c.mean), c.layout, c.group, c.scale_dtype, c.shard))
        return (*codecs, self.sink_k.shape[2], self.sink_k.dtype, self.sink_k.device)

    def _view(self):
        if self.chunk_tail and not (self.body_tokens or self.sink_k.shape[-2]):
            return self.tail_k, self.tail_v  # a first chunk longer than the window: the chunk itself, not a copy
        ks, vs = [self.sink_k], [self.sink_v]
        if self.body_tokens:
            dtype = self.sink_k.dtype
            ks.append(to_model_dtype(self.key_body.dequantize(), dtype))
            vs.append(to_model_dtype(self.value_body.dequantize(), dtype))
        ks.append(self.tail_k)
        vs.append(self.tail_v)
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
               is_causal: bool) -> torch.Tensor:
        """Fused attention of ``query`` [B, Hq, Lq, D] over the step, the body read from its codes: the layer's
        segments through :func:`~hf_kvint2.read_path.attend_segments`. ``attention_mask``: the model's mask over the
        step's tokens (SDPA's conventions) or None (then ``is_causal``: the queries are the step's last Lq tokens).
        Returns [B, Hq, Lq, D]."""
        total = self.seq_len
        lq = query.shape[2]
        # With gradients enabled for the query: the differentiable PyTorch body reader (the body's codes are data,
        # with no gradient; README).
        backend = select_body_partial(query.device, differentiable=torch.is_grad_enabled() and query.requires_grad)
        # The body views the update took (not the layer's, which an offloading cache has moved away by now).
        sink = [(self.sink_k, self.sink_v)]
        if attention_mask is None and is_causal and lq > 1:
            # A chunk: the tail's last lq tokens. Every sink, body and earlier window token precedes all of it, so
            # only the chunk over itself is causal, and no [Lq, total] mask is built.
            past = self.tail_k.shape[2] - lq
            return attend_segments(query, sink, self.key_body, self.value_body,
                                   [(self.tail_k[:, :, :past], self.tail_v[:, :, :past])], scaling, backend,
                                   fused_dense=True, own=(self.tail_k[:, :, past:], self.tail_v[:, :, past:]))
        mask = None
        if attention_mask is not None or is_causal:
            mask = step_mask(attention_mask, range(total - lq, total), range(total), query.device)
        return attend_segments(query, sink, self.key_body, self.value_body, [(self.tail_k, self.tail_v)], scaling,
                               backend, mask, fused_dense=True)


class PackedSteps:
    """One forward of one layer for several sequences packed along the token axis of one row (transformers'
    continuous batching): ``parts`` = (first token, tokens, what the sequence's layer returned), where that is a
    :class:`LayerStep` (a quantized layer) or ``(keys, values, window)`` (a sliding-window layer's full-precision
    K/V, its window in tokens). Each sequence attends only to its own tokens, causally.

    Decode steps (one query token) of sequences whose streams share their codecs and sink length are attended in
    one call: their bodies and recent windows padded to the longest, the padding masked (:func:`decode_batch`)."""

    __slots__ = ("__weakref__", "parts", "tokens")

    def __init__(self, parts: list, tokens: int):
        self.parts, self.tokens = parts, tokens

    @property
    def seq_len(self) -> int:
        return self.tokens

    def attend(self, module, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [1, Hq, tokens, D] -> [1, Hq, tokens, D]: each sequence's rows over its own step, the body read from
        its codes (:meth:`LayerStep.attend`); while a sequence has no INT2 tokens, or in a sliding-window layer, SDPA
        over its full-precision K/V, as the ``"oscar"`` attention of a cache of one sequence does."""
        outs: list = [None] * len(self.parts)
        batches: dict[tuple, list[int]] = {}
        for i, (start, n, part) in enumerate(self.parts):
            key = part.batch_key() if n == 1 and isinstance(part, LayerStep) and part.body_tokens and \
                not part.chunk_tail else None
            if key is not None:
                batches.setdefault(key, []).append(i)
            else:
                outs[i] = self._attend_one(module, query[:, :, start:start + n], part, scaling)
        for members in batches.values():
            steps = [self.parts[i][2] for i in members]
            q = torch.cat([query[:, :, self.parts[i][0]:self.parts[i][0] + 1] for i in members])
            out = decode_batch(steps, q, scaling) if len(steps) > 1 else steps[0].attend(q, None, scaling, True)
            for j, i in enumerate(members):
                outs[i] = out[j:j + 1]
        return torch.cat(outs, dim=2)

    @staticmethod
    def _attend_one(module, q: torch.Tensor, part, scaling: float) -> torch.Tensor:
        if isinstance(part, LayerStep) and part.body_tokens:
            return part.attend(q, None, scaling, True)
        if isinstance(part, LayerStep):
            (k, v), window = part.materialize(), None
            part.release()
        else:
            k, v, window = part
        n, total = q.shape[2], k.shape[2]
        mask = None
        if n != total or (window is not None and total > window):  # else SDPA's own causal mask is exact
            mask = step_mask(None, range(total - n, total), range(total), q.device, window=window)
            mask = mask.to(q.dtype) if q.dtype != torch.float32 else mask
        out, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, is_causal=mask is None)
        return out.transpose(1, 2)


def _padded(tensors: list[torch.Tensor], length: int, dim: int) -> torch.Tensor:
    """[1, ...] tensors stacked into [len, ...], each zero-padded along ``dim`` to ``length``."""
    first = tensors[0]
    shape = list(first.shape)
    shape[0], shape[dim] = len(tensors), length
    out = first.new_zeros(shape)
    for i, t in enumerate(tensors):
        out[i:i + 1].narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def decode_batch(steps: list[LayerStep], query: torch.Tensor, scaling: float) -> torch.Tensor:
    """One decode step of several sequences in one call of the read path: query [G, Hq, 1, D] (row g: sequence
    g's new token), each sequence's :class:`LayerStep` (the same codecs and sink length: :meth:`LayerStep.batch_key`).
    The bodies are read in their pages where the backend's fused step reads pages (``read_pages``), else come from
    one gather of all their stores' pages (``gather_padded``: stores that stay in place); the sinks and recent
    windows are read where they live (:meth:`~hf_kvint2.layers.OscarLayer.shared_windows`: a
    serving engine's window slots; each row's body and window lengths tell the fused step what to skip) or else
    padded to the longest, the padding masked. Returns [G, Hq, 1, D]."""
    first = steps[0]
    store_type = type(first.stores[0])
    body_tokens = [s.body_tokens for s in steps]
    tail_tokens = [s.tail_k.shape[2] for s in steps]
    stores = [[s.stores[i] for s in steps] for i in (0, 1)]
    backend = select_body_partial(query.device)
    shared = [s.layer.shared_windows() for s in steps]
    gather, read = store_type.gather_padded, None
    if backend.layer_step is not None and all(w is not None and w[0] is shared[0][0] for w in shared) and \
            shared[0][0][2].dtype == torch.float32:
        # the windows where they live (a serving engine's window slots, float32 as the kernel reads them) and, where
        # the backend reads pages, the bodies in their pages: each row reads its own, nothing copied
        read = getattr(store_type, "read_pages", gather) if backend.reads_pages else gather
        bodies = [read(x, body_tokens) for x in stores]
        if backend.serves_layer_step(query, bodies[0]):
            sink_k, sink_v, recent_k, recent_v = shared[0][0]
            return backend.layer_step(query, (sink_k, sink_v), bodies[0], bodies[1], (recent_k, recent_v),
                                      scaling=scaling, window_rows=[row for _, row in shared],
                                      after_tokens=tail_tokens, body_tokens=body_tokens, **backend.options(query))
    if read is not gather:
        bodies = [gather(x, body_tokens) for x in stores]
    # columns: sink (every row's), body (each row's first body_tokens), tail (each row's window)
    n_sink, n_body, n_tail = first.sink_k.shape[2], max(body_tokens), max(tail_tokens)
    col = torch.arange(n_sink + n_body + n_tail, device=query.device)
    body_end = n_sink + torch.tensor(body_tokens, device=query.device)[:, None]
    tail_end = n_sink + n_body + torch.tensor(tail_tokens, device=query.device)[:, None]
    valid = (col < body_end) | ((col >= n_sink + n_body) & (col < tail_end))
    mask = torch.zeros(valid.shape, dtype=torch.float32, device=query.device).masked_fill_(~valid, float("-inf"))
    mask = mask[:, None, None, :]
    sink_k = torch.cat([s.sink_k for s in steps])
    sink_v = torch.cat([s.sink_v for s in steps])
    slots = [s.layer.recent_slots(n_tail) for s in steps]
    if all(slot is not None for slot in slots):  # the windows' own buffers, filler masked: one copy, no zero fill
        tail_k, tail_v = torch.cat([k for k, _ in slots]), torch.cat([v for _, v in slots])
    else:
        tail_k = _padded([s.tail_k for s in steps], n_tail, 2)
        tail_v = _padded([s.tail_v for s in steps], n_tail, 2)
    return attend_segments(query, [(sink_k, sink_v)], bodies[0], bodies[1], [(tail_k, tail_v)], scaling, backend,
                           mask, fused_dense=True)


class StaticStep(_Step):
    """One eager forward of a :class:`~hf_kvint2.static_layer.StaticOscarLayer`: ``attend`` is the layer's own
    fixed-shape attention, ``materialize`` its portable full view (every slot by absolute position)."""

    __slots__ = ("__weakref__", "_full", "body_tokens", "key_states", "layer", "value_states")

    def __init__(self, layer, key_states, value_states, body_tokens: int):
        self.layer, self.key_states, self.value_states = layer, key_states, value_states
        self.body_tokens = body_tokens
        self._full = None

    @property
    def seq_len(self) -> int:
        return self.layer.max_cache_len

    def _view(self):
        return self.layer.full_view(self.key_states, self.value_states)

    def attend(self, query, attention_mask, scaling, is_causal):
        return self.layer.attend(query, self.key_states, self.value_states, attention_mask, scaling)


_METADATA_FUNCS = {
    torch.Tensor.shape.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_floating_point,
    torch.Tensor.__len__, torch.Tensor.element_size, torch.Tensor.numel,
}


# The one-element zero every placeholder of a dtype and device expands (never written: placeholders have no data).
_ZERO_SCALARS: dict[tuple[torch.dtype, torch.device, bool], torch.Tensor] = {}  # (dtype, device, inference mode)


class DeferredKV(torch.Tensor):
    """Zero-storage stand-in for a layer's full K (``which=0``) or V (``which=1``) in one forward.

    It has the shape, dtype and device of the portable view. The ``"oscar"`` attention reads ``.step``; any other
    torch operation on it first materializes the portable view (dequantizing the body), so other attention
    implementations still compute the right thing.
    """

    step: LayerStep | StaticStep
    which: int

    @staticmethod
    def pair(step, like: torch.Tensor) -> tuple[DeferredKV, DeferredKV]:
        """The step's K and V placeholders: ``like``'s batch, heads, head_dim, dtype and device, the step's length."""
        shape = (*like.shape[:2], step.seq_len, like.shape[-1])
        if type(like) is torch.Tensor and not tracing():  # never keep a fake or traced tensor
            key = (like.dtype, like.device, torch.is_inference_mode_enabled())
            zero = _ZERO_SCALARS.get(key)
            if zero is None:
                zero = _ZERO_SCALARS[key] = like.new_zeros(())
        else:
            zero = like.new_zeros(())
        zeros = zero.expand(shape)
        placeholders = []
        for which in (0, 1):
            t = zeros.as_subclass(DeferredKV)  # an alias of its own: K and V are two tensors
            t.step, t.which = step, which
            placeholders.append(t)
        return placeholders[0], placeholders[1]

    def full(self) -> torch.Tensor:
        if self.step.body_tokens:
            warn_portable_path_once()
        return self.step.materialize()[self.which]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_FUNCS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(DeferredKV, lambda t: t.full(), (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self, **kwargs):
        return f"DeferredKV(layer={self.step.layer.layer_idx}, which={'KV'[self.which]}, shape={tuple(self.shape)})"
