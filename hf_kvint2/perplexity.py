"""The chunked teacher-forced decode protocol: a model's loss on token windows, read through each method's own cache
with the ``"oscar"`` attention, as a user runs them.

The quality harness (:mod:`hf_kvint2.evaluation`, ``benchmarks/quality.py``) compares methods with it, and the
calibration checks its narrowed group ranges end to end with it (:mod:`hf_kvint2.calibration.confirm`). A method
(:class:`CacheMethod`) is a factory returning a fresh ``transformers.Cache`` for a model config; caches whose
quantization groups span batch rows (transformers' ``QuantizedCache``) get one cache per row (``batched=False``).
Methods run one after the other, each on all windows at once; the model attends with ``"oscar"`` meanwhile (an
Oscar cache is read through its fused read path, any other cache through SDPA, as ``"oscar"`` does for users).

The prompt (prefill) forward is shared: every cache here attends the fresh keys/values of a first chunk at full
precision (the Oscar layers attend the current chunk at full precision, ``QuantizedCache`` returns its input on the
first update, ``DynamicCache`` is exact), so one full-precision prefill is run and its per-layer K/V are replayed
into each fresh cache with ``cache.update``: the same calls, with the same tensors, the prefill forward would have
made (tests/test_evaluation.py compares the logits that follow with those after a real prefill).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache

from .attention import ATTN_IMPLEMENTATION
from .model_config import layer_types, model_shape


def cache_kwarg(model, cache) -> dict:
    """The cache as the model's forward names it: ``cache=`` from transformers 5.24 (which warns about the old
    name), ``past_key_values=`` before."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


@dataclass
class CacheMethod:
    """A named way of caching K/V. ``make_cache(config)`` returns a fresh cache; ``batched=False`` if its
    quantization groups would mix batch rows (then every row gets its own cache). ``key`` is a short CLI name."""

    key: str
    name: str
    make_cache: Callable[[object], Cache]
    batched: bool = True
    description: str = ""


@dataclass
class PerplexityResult:
    nll_sum: list[float]  # per window
    tokens: list[int]  # scored tokens per window
    bits_per_element: float | None = None  # held by the cache(s) at the end of the windows
    # perplexity by position: (first position, last position + 1, nll sum over windows, tokens) per span
    position_spans: list[tuple[int, int, float, int]] | None = None

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll_sum) / sum(self.tokens))

    @property
    def window_perplexities(self) -> list[float]:
        return [math.exp(s / n) for s, n in zip(self.nll_sum, self.tokens)]

    def summary(self) -> dict:
        w = self.window_perplexities
        mean = sum(w) / len(w)
        std = math.sqrt(sum((x - mean) ** 2 for x in w) / max(len(w) - 1, 1))
        out = {"perplexity": self.perplexity, "scored_tokens": sum(self.tokens), "window_perplexities": w,
               "window_min": min(w), "window_max": max(w), "window_std": std,
               "bits_per_element_at_window_end": self.bits_per_element}
        if self.position_spans:
            out["by_position"] = [{"start": a, "stop": b, "perplexity": math.exp(s / n), "tokens": n}
                                  for a, b, s, n in self.position_spans]
        return out


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` [...] under ``logits`` [..., V], float64."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -logp.double()


def check_protocol(window: int, prefill: int, chunk: int) -> None:
    if not (0 < prefill < window):
        raise ValueError(f"prefill ({prefill}) must be between 1 and window-1 ({window - 1}).")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}.")


# ---------------------------------------------------------------------------------------------------- caches
@contextlib.contextmanager
def oscar_attention(model):
    """Within the block ``model`` attends with ``"oscar"`` (what the caches' users run); its own implementation is
    restored afterwards, also on error."""
    original = model.config._attn_implementation
    if original == ATTN_IMPLEMENTATION:
        yield
        return
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        raise ValueError(f"{type(model).__name__} does not dispatch attention through transformers' "
                         "AttentionInterface, so the caches cannot be read with the \"oscar\" attention.")
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


@torch.no_grad()
def full_precision_prefill(model, ids: torch.Tensor, batch_size: int | None = None, chunk: int | None = None):
    """Run the prompt ``ids`` [B, T] once at full precision. Returns (per-layer [(K, V)], last-position logits [B, V]).

    ``chunk``: feed the prompt in chunks of that many tokens through the ``DynamicCache`` (long prompts of models
    with sliding-window layers: one forward would build dense T x T masks and scores for every layer). A
    sliding-window layer's entry is then ``(K, V, tokens seen)``: its last window, and how many tokens it has seen
    (what :func:`method_caches` restores)."""
    batch_size = batch_size or ids.shape[0]
    chunk = chunk or ids.shape[1]
    kv, logits = None, []
    for start in range(0, ids.shape[0], batch_size):
        cache = DynamicCache(config=model.config)
        rows = ids[start:start + batch_size]
        for pos in range(0, rows.shape[1], chunk):
            out = model(rows[:, pos:pos + chunk], **cache_kwarg(model, cache), use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1].float())
        layer_kv = [(layer.keys, layer.values) + ((layer.cumulative_length,) if getattr(layer, "is_sliding", False)
                                                  and layer.cumulative_length > layer.keys.shape[-2] else ())
                    for layer in cache.layers]
        kv = layer_kv if kv is None else [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]), *a[2:])
                                          for a, b in zip(kv, layer_kv)]
    return kv, torch.cat(logits)


def method_caches(method: CacheMethod, config, rows: int, prefill_kv=None) -> list[tuple[Cache, slice]]:
    """Fresh caches of ``method`` for ``rows`` batch rows (one cache, or one per row if not ``batched``) with the
    rows each holds, each filled with the shared full-precision prefill (the caches' ``update`` calls of that
    forward). An Oscar layer filled so is read by ``"oscar"`` from the next forward on, as after a real prefill."""
    parts = []
    blocks = [slice(0, rows)] if method.batched else [slice(r, r + 1) for r in range(rows)]
    for block in blocks:
        cache = method.make_cache(config)
        for idx, (k, v, *seen) in enumerate(prefill_kv or ()):
            cache.update(k[block], v[block], idx)
            layer = cache.layers[idx]
            if hasattr(layer, "fused_attention"):  # what the "oscar" attention sets when it reads the prefill
                layer.fused_attention = True
            if seen:  # a sliding window filled by a chunked prefill: it has seen more than it holds
                if not getattr(layer, "is_sliding", False) or not hasattr(layer, "cumulative_length"):
                    raise ValueError(f"Layer {idx} was prefilled as a sliding window but {type(layer).__name__}"
                                     " is not one: build the method's cache with config=.")
                layer.cumulative_length = seen[0]
        parts.append((cache, block))
    return parts


def _tensor_bytes(obj) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensor subclasses such as quanto's are flattened)."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(_tensor_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def cache_bits_per_element(cache: Cache, config, batch_size: int) -> float:
    """Bits held per cached K/V element of the model's full-attention layers, from the bytes the cache holds: this
    library's caches report them themselves (``memory_report``); for others every tensor the layers hold (residual
    and quantized states, with their scales and zero points) is counted. Sliding-window layers (Gemma 3: 5 of 6)
    are left out: every method compared here keeps them as transformers' full-precision window, so they would only
    dilute the comparison (their bytes are in ``memory_report()``)."""
    full = [i for i, kind in enumerate(layer_types(config)) if kind == "full_attention"] if config is not None \
        else list(range(len(cache.layers)))
    if hasattr(cache, "memory_report"):
        rows = [row for row in cache.memory_report()["layers"] if row["layer"] in set(full)]
        held, elements = sum(row["total_bytes"] for row in rows), sum(row["elements"] for row in rows)
        if not elements:
            raise ValueError("The cache is empty; fill it before measuring bits per element.")
        return 8 * held / elements
    shape = model_shape(config)
    per_token = 2 * batch_size * shape.num_key_value_heads * shape.head_dim
    total_bytes, elements = 0, 0
    for idx in full:
        layer = cache.layers[idx] if idx < len(cache.layers) else None
        if not getattr(layer, "is_initialized", False):
            continue
        total_bytes += _tensor_bytes([layer.keys, layer.values, getattr(layer, "_quantized_keys", None),
                                      getattr(layer, "_quantized_values", None)])
        elements += per_token * cache.get_seq_length(idx)
    if not elements:
        raise ValueError("The cache is empty; fill it before measuring bits per element.")
    return 8 * total_bytes / elements


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The model's decoder layers in order (``model.get_decoder().layers``), or None where it has no such list."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != model_shape(model.config).num_layers:
        return None
    return layers


class LayerReplay:
    """A method's first decoder layers as one run computed them, replayed into another method's run.

    While :meth:`recording`, every chunk's forward keeps what each of the first ``depth`` layers returned and the
    K/V it stored (its cache's ``update`` calls). While :meth:`replaying` ``n`` layers, those layers do not run:
    each stores the recorded K/V into the cache it is given and returns its recorded output. Where the caches'
    first ``n`` layers have the same recipes as the recorded run's, they end in the same state and layer ``n``
    gets the same input, so the logits are the ones a full run computes, without the cost of its first layers."""

    def __init__(self, layers: torch.nn.ModuleList, depth: int):
        self.layers, self.depth = layers, depth
        self.chunk = 0  # the chunk being run (set by the caller before each forward)
        self.outputs: dict[tuple[int, int], object] = {}
        self.stored: dict[tuple[int, int], list] = {}

    @contextlib.contextmanager
    def recording(self, cache: Cache):
        def update(key, value, layer_idx, *args, **kwargs):
            if layer_idx < self.depth:
                self.stored.setdefault((self.chunk, layer_idx), []).append((key, value, args, kwargs))
            return original_update(key, value, layer_idx, *args, **kwargs)

        def keep_output(idx):
            return lambda module, args, output: self.outputs.__setitem__((self.chunk, idx), output)

        original_update = cache.update
        cache.update = update
        hooks = [layer.register_forward_hook(keep_output(idx)) for idx, layer in enumerate(self.layers[:self.depth])]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            del cache.update

    @contextlib.contextmanager
    def replaying(self, n: int):
        def replay(idx):
            def forward(hidden_states, *args, **kwargs):
                cache = kwargs.get("cache", kwargs.get("past_key_values"))
                for key, value, update_args, update_kwargs in self.stored.get((self.chunk, idx), ()):
                    cache.update(key, value, idx, *update_args, **update_kwargs)
                return self.outputs[self.chunk, idx]
            return forward

        layers = self.layers[:min(n, self.depth)]
        for idx, layer in enumerate(layers):
            layer.forward = replay(idx)
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward


# ---------------------------------------------------------------------------------------------------- perplexity
@torch.no_grad()
def chunked_perplexity(model, windows: torch.Tensor, methods: list[CacheMethod], prefill: int = 512,
                       chunk: int = 32, progress: bool = True, score_every: int = 1,
                       checkpoint: Callable[[dict[str, tuple[int, PerplexityResult]]], None] | None = None,
                       checkpoint_every: int = 64,
                       same_first_layers: Mapping[str, int] | None = None) -> dict[str, PerplexityResult]:
    """Chunked teacher-forced decode perplexity of every method on ``windows`` [W, T].

    Per window: the first ``prefill`` tokens go into a fresh cache in one forward (not scored); the remaining
    tokens are fed in chunks of ``chunk`` through the same cache. Every token predicted in the chunk phase is
    scored, the first one from the prefill's last logit: ``window - prefill`` tokens per window. The perplexity is
    also reported per span of predicted-token positions between powers of two (``[prefill, 1024), [1024, 2048),
    ...``: how quality changes with the context a token is predicted from).

    ``score_every=k`` scores only the predicted positions ``prefill, prefill + k, ...`` (the model computes its
    output head only there: on long windows of a model with a large vocabulary, such as Gemma 3's 262k, the head
    is most of the cost); every token still goes through the caches in the same chunks.

    ``checkpoint(partial)`` is called every ``checkpoint_every`` chunks with ``{method key: (position, result)}``:
    the methods done (position: the window's end) and the one running, over the positions it has scored so far
    (spans up to ``position``; bits/element left out), so that a long run that is stopped keeps what it measured.

    ``same_first_layers={key: n}``: method ``key``'s cache has the same recipes as the first method's in layers
    0 .. n-1, so those layers compute what they computed in the first method's run: they are not run again, only
    fed the K/V that run stored (:class:`LayerReplay`; the same logits, e.g. calibration's check of one layer's
    choice at a time). Batched methods only; a model without a plain list of decoder layers runs them all.
    """
    n_win, window = windows.shape
    check_protocol(window, prefill, chunk)
    if not isinstance(score_every, int) or score_every < 1:
        raise ValueError(f"score_every must be a positive integer, got {score_every!r}.")
    is_scored = torch.zeros(window, dtype=torch.bool)
    is_scored[prefill::score_every] = True
    kv, first_logits = full_precision_prefill(model, windows[:, :prefill])
    first_nll = token_nll(first_logits, windows[:, prefill])
    steps = range(prefill, window, chunk)
    results = {}
    same_first_layers = same_first_layers or {}
    replay = _layer_replay(model, methods, same_first_layers)
    with oscar_attention(model):
        for method in methods:
            caches = method_caches(method, model.config, n_win, kv)
            nll = torch.zeros(n_win, window, dtype=torch.float64)  # by the position of the predicted token
            nll[:, prefill] = first_nll
            if replay is None:
                mode = contextlib.nullcontext()
            elif method is methods[0]:
                mode = replay.recording(caches[0][0])
            else:
                mode = replay.replaying(same_first_layers.get(method.key, 0))
            with mode:
                for done, start in enumerate(tqdm(steps, desc=f"perplexity: {method.name} ({n_win} windows)",
                                                  disable=not progress), 1):
                    if replay is not None:
                        replay.chunk = done
                    stop = min(start + chunk, window)
                    # the logit at chunk index j predicts position start + j + 1 (the last window token predicts
                    # nothing)
                    keep = torch.nonzero(is_scored[start + 1:stop + 1]).flatten()
                    positions = start + 1 + keep
                    extra = {} if score_every == 1 else {"logits_to_keep": keep}
                    for cache, rows in caches:
                        logits = model(windows[rows, start:stop], **cache_kwarg(model, cache), use_cache=True,
                                       **extra).logits
                        if score_every == 1:
                            logits = logits[:, :keep.numel()]
                        nll[rows, positions] = token_nll(logits, windows[rows][:, positions])
                        del logits
                    if checkpoint is not None and done % checkpoint_every == 0 and stop < window:
                        partial = {key: (window, r) for key, r in results.items()}
                        partial[method.key] = (stop + 1, _result(nll, is_scored, prefill, stop + 1))
                        checkpoint(partial)
            bits = [cache_bits_per_element(cache, model.config, rows.stop - rows.start) for cache, rows in caches]
            results[method.key] = _result(nll, is_scored, prefill, window, sum(bits) / len(bits))
            del caches
    return results


def _layer_replay(model, methods: list[CacheMethod], same_first_layers: Mapping[str, int]) -> LayerReplay | None:
    """The :class:`LayerReplay` that ``same_first_layers`` asks for (None: every method runs every layer)."""
    unknown = set(same_first_layers) - {m.key for m in methods[1:]}
    if unknown:
        raise ValueError(f"same_first_layers names {sorted(unknown)}, which are not methods after the first.")
    depth = max(same_first_layers.values(), default=0)
    layers = decoder_layers(model)
    if depth <= 0 or layers is None:
        return None
    if not all(m.batched for m in methods if m is methods[0] or same_first_layers.get(m.key, 0) > 0):
        raise ValueError("same_first_layers needs batched methods (one cache for all windows).")
    return LayerReplay(layers, depth)


def _result(nll: torch.Tensor, is_scored: torch.Tensor, prefill: int, end: int,
            bits: float | None = None) -> PerplexityResult:
    """One method's perplexity over the positions scored before ``end``, and by span between powers of two."""
    n_win = nll.shape[0]
    edges = [prefill] + [2 ** e for e in range(1, end.bit_length()) if prefill < 2 ** e < end] + [end]
    by_span = [(a, b, nll[:, a:b].sum().item(), int(is_scored[a:b].sum()) * n_win)
               for a, b in itertools.pairwise(edges) if b > a]
    return PerplexityResult(nll[:, :end].sum(-1).tolist(), [int(is_scored[:end].sum())] * n_win, bits, by_span)
