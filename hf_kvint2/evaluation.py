"""Quality evaluation of KV caches: chunked teacher-forced decode perplexity, passkey retrieval, greedy agreement.

(Over 400 lines on purpose: one benchmark harness - the compared methods, the stacked cache that batches them and
the protocols that use it - read together by benchmarks/quality.py; nothing in the library imports it.)

Every protocol compares several cache *methods* side by side in one run. A method is a factory returning a fresh
``transformers.Cache`` for a model config. To use the CPU well, all methods run in ONE batched forward per step:
:class:`StackedCache` routes each block of batch rows to its own cache (rows never interact in the model, so each
cache sees exactly what it would see alone). Caches whose quantization groups span batch rows (transformers'
``QuantizedCache``) get one cache per row (``CacheMethod.batched=False``).

The prompt/prefill forward is shared: it attends the fresh keys/values at full precision in every cache here
(our layers attend the current chunk at full precision, ``QuantizedCache`` returns its input on the first update,
``DynamicCache`` is exact), so one full-precision prefill is run and its per-layer K/V are replayed into each fresh
cache with ``cache.update`` - the same calls, with the same tensors, the prefill forward would have made.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from .cache import OscarCache, OscarCacheBase, OscarScaledCache
from .calibration import LayerChoice, calibration_from_choices, settings_from_choices
from .layers import OscarLayer
from .model_config import layer_types, model_shape
from .quant import to_model_dtype
from .recipes import LayerRecipe
from .settings import hadamard_only_recipe, kivi2_recipe, naive_int2_recipe
from .storage import TokenBuffer


def cache_kwarg(model, cache) -> dict:
    """The cache as the model's forward names it: ``cache=`` from transformers 5.24 (which warns about the old
    name), ``past_key_values=`` before."""
    import inspect

    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}

EVAL_TEXT = "emma.txt"  # never the calibration text (prideprejudice.txt)
HAYSTACK_TEXT = "sensesensibility.txt"
CALIBRATION_TEXT = "prideprejudice.txt"


def load_text(name: str) -> str:
    """A text shipped in ``hf_kvint2/data``."""
    if name == CALIBRATION_TEXT:
        raise ValueError(f"{name} is the calibration text; evaluate on {EVAL_TEXT} instead.")
    return resources.files("hf_kvint2.data").joinpath(name).read_text(encoding="utf-8")


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256): lets the pipeline run on a tiny random model with no tokenizer files."""

    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------- methods
@dataclass
class CacheMethod:
    """A named way of caching K/V. ``make_cache(config)`` returns a fresh cache; ``batched=False`` if its
    quantization groups would mix batch rows (then every row gets its own cache). ``key`` is a short CLI name."""

    key: str
    name: str
    make_cache: Callable[[object], Cache]
    batched: bool = True
    description: str = ""


def engine_cache(recipe: LayerRecipe, config) -> OscarCacheBase:
    """A cache of this library's engine with the same recipe in every layer (used for the baselines)."""
    return OscarCacheBase(lambda idx: recipe, config)


def with_key_token_scaling(cache: OscarCacheBase) -> OscarCacheBase:
    """The same cache with OScaR's omni-token key scaling added to every layer's key layout (before first use)."""
    for layer in cache.layers:
        if isinstance(layer, OscarLayer):
            if layer.is_initialized:
                raise ValueError("with_key_token_scaling needs a fresh cache (created with config=, not yet used).")
            layer.recipe = layer.recipe.with_overrides(key=replace(layer.recipe.key, token_scaling=True))
    return cache


def standard_methods(config, calibrated: Callable[[object], OscarCache] | None = None,
                     transformers_backends: tuple[str, ...] = ("hqq", "quanto")) -> list[CacheMethod]:
    """The methods compared in the quality benchmark. ``calibrated(config)`` loads a fresh calibrated OscarCache
    with eager layers; without it the calibrated rows are left out."""
    d = model_shape(config).head_dim
    methods = [
        CacheMethod("fp", "full precision", lambda cfg: DynamicCache(config=cfg), True, "DynamicCache"),
        CacheMethod("oscar_scaled", "OScaR (OscarScaledCache)", lambda cfg: OscarScaledCache(config=cfg), True,
                    "OscarScaledCache() defaults: Hadamard, key token scaling, K per channel/32 tokens, V per token/32,"
                    " sink 64, residual 128 (keys that keep the model basis drop the Hadamard and the token norm)"),
    ]
    if calibrated is not None:
        methods += [
            CacheMethod("oscar", "OSCAR (OscarCache, calibrated)", calibrated, True,
                        "calibrated on Pride and Prejudice: spectral rotations, fitted clips, per-layer layouts"),
            CacheMethod("oscar_token_scaling", "OSCAR calibrated + key token scaling",
                        lambda cfg: with_key_token_scaling(calibrated(cfg)), True,
                        "the calibrated OscarCache with OScaR's omni-token key scaling (a setting neither paper has)"),
        ]
    methods += [
        CacheMethod("hadamard", "Hadamard INT2 (QuaRot-style)", lambda cfg: OscarCache(config=cfg), True,
                    "OscarCache() uncalibrated: Hadamard, clips 0.96/0.92, sink 64, recent 256 (keys that vary very "
                    "unevenly over channels keep the model basis with per-channel groups: hf_kvint2.key_basis)"),
        CacheMethod("hadamard_only", "Hadamard-only INT2 (fixed rotation)",
                    lambda cfg: engine_cache(hadamard_only_recipe(d), cfg), True,
                    "normalised Hadamard on K and V always (no key-basis choice), per-token groups, clips "
                    "0.96/0.92, sink 64, recent 256"),
        CacheMethod("kivi2", "KIVI-2 (this engine)", lambda cfg: engine_cache(kivi2_recipe(d), cfg), True,
                    "no rotation; K per channel/32 tokens, V per token/32 channels, residual 128"),
        CacheMethod("naive", "naive INT2", lambda cfg: engine_cache(naive_int2_recipe(d), cfg), True,
                    "per-token INT2, no rotation, no clip, sink 64, recent 256"),
    ]
    for backend in transformers_backends:
        methods.append(CacheMethod(
            backend, f"transformers QuantizedCache {backend} 2-bit",
            lambda cfg, b=backend: _quantized_cache(b, cfg), False,
            f"transformers QuantizedCache(backend={backend!r}, nbits=2), its defaults otherwise"))
    return methods


def _quantized_cache(backend: str, config) -> Cache:
    from transformers import QuantizedCache

    return QuantizedCache(backend, config, nbits=2)


# ---------------------------------------------------------------------------------------------------- bits
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
    library's caches report them themselves; for others every tensor the layers hold (residual and quantized
    states, with their scales and zero points) is counted. Sliding-window layers (Gemma 3: 5 of 6) are left out:
    every method compared here keeps them as transformers' full-precision window, so they would only dilute the
    comparison (their bytes are in ``memory_report()``)."""
    full = [i for i, kind in enumerate(layer_types(config)) if kind == "full_attention"] if config is not None \
        else list(range(len(cache.layers)))
    if isinstance(cache, OscarCacheBase):
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


def _filled_bits(method: CacheMethod, config, tokens: int, seed: int, dtype: torch.dtype) -> float:
    shape = model_shape(config)
    heads, d = shape.num_key_value_heads, shape.head_dim
    cache = method.make_cache(config)
    gen = torch.Generator().manual_seed(seed)
    for idx in range(shape.num_layers):
        k, v = (torch.randn(1, heads, tokens, d, generator=gen).to(dtype) for _ in range(2))
        cache.update(k, v, idx)
    return cache_bits_per_element(cache, config, 1)


def bits_at_length(method: CacheMethod, config, tokens: int = 131072, probes: tuple[int, int] = (4096, 8192),
                   seed: int = 0, dtype: torch.dtype = torch.float32) -> float:
    """Bits/element of a cache holding ``tokens`` tokens (batch 1) of K/V in ``dtype`` (the model dtype: it sets
    the size of full-precision windows), from caches filled with random K/V in one update per layer (byte counts
    do not depend on the values).

    Beyond the larger probe length the caches are filled at the two ``probes`` lengths and their byte counts
    extrapolated linearly: once the full-precision windows are full, every cache here grows by a fixed number of
    bytes per token (per-token codes, scales and norms; per-block scales for token-grouped layouts, exact at
    block-aligned lengths), so the line through two filled caches is exact and avoids quantizing 128k tokens per
    layer on a CPU.
    """
    if tokens <= probes[1]:
        return _filled_bits(method, config, tokens, seed, dtype)
    t1, t2 = probes
    b1, b2 = (_filled_bits(method, config, t, seed, dtype) * t for t in probes)  # bits per (element per token) * tokens
    return (b1 + (b2 - b1) * (tokens - t1) / (t2 - t1)) / tokens


# ---------------------------------------------------------------------------------------------------- stacking
class _DequantizedBody:
    """The INT2 body of one :class:`OscarLayer` dequantized to the original space and the model dtype, kept across
    chunks and extended by the tokens demoted since the last read.

    The portable view (what a non-``"oscar"`` attention such as SDPA reads) dequantizes and de-rotates the whole body
    at every forward: O(history x head_dim^2) per chunk, most of the cost of a long chunked evaluation. The stored
    codes of a token never change once written (the body only grows here: no crop, no beam reordering), and
    dequantization is per token (per-channel scales cover whole groups of tokens, and the body holds whole groups),
    so the kept tokens are the ones a full dequantization would give, up to the rounding of the de-rotation's
    matrix product over fewer rows. If the layer's stream is replaced (the key basis settled at the first demotion)
    or shrinks, everything is dequantized again."""

    def __init__(self):
        self.streams = (None, None)
        self.keys, self.values = TokenBuffer(2), TokenBuffer(2)

    def read(self, layer: OscarLayer, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``tokens`` body tokens of ``layer``, K and V [B, H, tokens, D] in the model dtype."""
        streams = (layer.key_body, layer.value_body)
        if streams[0] is not self.streams[0] or streams[1] is not self.streams[1] or self.keys.rows > layer.body_len:
            self.streams = streams
            self.keys, self.values = TokenBuffer(2), TokenBuffer(2)
        done = self.keys.rows
        if tokens > done:
            for buf, stream in ((self.keys, streams[0]), (self.values, streams[1])):
                buf.append(to_model_dtype(stream.read(layer.body_len).dequantize(done, layer.body_len), layer.dtype))
        return self.keys.view()[:, :, :tokens], self.values.view()[:, :, :tokens]


class _StackedLayer(CacheLayerMixin):
    """One layer index of a :class:`StackedCache`: forwards each block of batch rows to its own cache."""

    is_sliding = False
    is_compileable = False

    def __init__(self, parts: list[tuple[Cache, slice]], layer_idx: int):
        super().__init__()
        self.parts, self.layer_idx = parts, layer_idx
        self.is_initialized = True
        # transformers builds the attention masks from the cache's per-layer is_sliding and mask sizes: mirror the
        # layer kind of the stacked caches (all the same kind: every method here is built from the model config)
        kinds = {bool(getattr(c.layers[layer_idx], "is_sliding", False)) if layer_idx < len(c.layers) else False
                 for c, _ in parts}
        if len(kinds) > 1:
            raise ValueError(f"Layer {layer_idx} is a sliding-window layer in some of the stacked caches and not in "
                             "others: build every method's cache with config= so that they agree.")
        self.is_sliding = kinds.pop() if kinds else False
        self.bodies = [_DequantizedBody() for _ in parts]

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        outs = [self._update_part(cache, body, key_states[rows], value_states[rows], args, kwargs)
                for (cache, rows), body in zip(self.parts, self.bodies)]
        if len(outs) == 1:
            return outs[0]
        return torch.cat([k for k, _ in outs]), torch.cat([v for _, v in outs])

    def _update_part(self, cache, body, keys, values, args, kwargs):
        """One cache's ``update``; for this library's layers the same portable view (sink, body dequantized, recent
        window and chunk; :meth:`hf_kvint2.steps.LayerStep._view`), with the body dequantized only once per token
        (:class:`_DequantizedBody`) instead of in full at every chunk."""
        layer = cache.layers[self.layer_idx] if self.layer_idx < len(cache.layers) else None
        if not isinstance(layer, OscarLayer):
            return cache.update(keys, values, self.layer_idx, *args, **kwargs)
        layer.fused_attention = True  # update() returns zero-storage placeholders that carry its step
        placeholder, _ = cache.update(keys, values, self.layer_idx, *args, **kwargs)
        step = placeholder.step
        ks, vs = [step.sink_k], [step.sink_v]
        if step.body_tokens:
            bk, bv = body.read(layer, step.body_tokens)
            ks.append(bk)
            vs.append(bv)
        ks.append(step.tail_k)
        vs.append(step.tail_v)
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def get_seq_length(self) -> int:
        return self.parts[0][0].get_seq_length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.parts[0][0].get_mask_sizes(query_length, self.layer_idx)

    def get_max_length(self) -> int:
        return -1


class StackedCache(Cache):
    """Several caches behind one batch: ``parts`` maps consecutive row blocks to caches, in order."""

    def __init__(self, parts: list[tuple[Cache, slice]], num_layers: int):
        self.parts = parts
        super().__init__(layers=[_StackedLayer(parts, i) for i in range(num_layers)])


@torch.no_grad()
def full_precision_prefill(model, ids: torch.Tensor, batch_size: int | None = None, chunk: int | None = None):
    """Run the prompt ``ids`` [B, T] once at full precision. Returns (per-layer [(K, V)], last-position logits [B, V]).

    ``chunk``: feed the prompt in chunks of that many tokens through the ``DynamicCache`` (long prompts of models
    with sliding-window layers: one forward would build dense T x T masks and scores for every layer). A
    sliding-window layer's entry is then ``(K, V, tokens seen)``: its last window, and how many tokens it has seen
    (what :func:`stacked_caches` restores)."""
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


def stacked_caches(methods: list[CacheMethod], config, rows_per_method: int, prefill_kv=None) -> StackedCache:
    """Fresh caches for every method (one per method, or one per row if not ``batched``), stacked method-major,
    each optionally filled with the shared full-precision prefill."""
    parts, start = [], 0
    for method in methods:
        blocks = [slice(start, start + rows_per_method)] if method.batched else \
            [slice(start + r, start + r + 1) for r in range(rows_per_method)]
        for rows in blocks:
            cache = method.make_cache(config)
            if prefill_kv is not None:
                local = slice(rows.start - start, rows.stop - start)
                for idx, (k, v, *seen) in enumerate(prefill_kv):
                    cache.update(k[local], v[local], idx)
                    if seen:  # a sliding window filled by a chunked prefill: it has seen more than it holds
                        layer = cache.layers[idx]
                        if not getattr(layer, "is_sliding", False) or not hasattr(layer, "cumulative_length"):
                            raise ValueError(f"Layer {idx} was prefilled as a sliding window but {type(layer).__name__}"
                                             " is not one: build the method's cache with config=.")
                        layer.cumulative_length = seen[0]
            parts.append((cache, rows))
        start += rows_per_method
    return StackedCache(parts, model_shape(config).num_layers)


# ---------------------------------------------------------------------------------------------------- perplexity
def eval_windows(token_ids: list[int] | torch.Tensor, num_windows: int, window: int) -> torch.Tensor:
    """``num_windows`` windows of ``window`` tokens at evenly spaced offsets over the text -> [num_windows, window]."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.numel() < window:
        raise ValueError(f"The text has {ids.numel()} tokens, fewer than one window of {window}; use a shorter "
                         "--window or a longer text.")
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}.")
    last = ids.numel() - window
    offsets = [round(i * last / max(num_windows - 1, 1)) for i in range(num_windows)]
    return torch.stack([ids[o:o + window] for o in offsets])


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


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` [...] under ``logits`` [..., V], float64 sums per row."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -logp.double()


def _check_protocol(window: int, prefill: int, chunk: int) -> None:
    if not (0 < prefill < window):
        raise ValueError(f"prefill ({prefill}) must be between 1 and window-1 ({window - 1}).")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}.")


@torch.no_grad()
def chunked_perplexity(model, windows: torch.Tensor, methods: list[CacheMethod], prefill: int = 512,
                       chunk: int = 32, progress: bool = True, score_every: int = 1,
                       checkpoint: Callable[[int, dict[str, PerplexityResult]], None] | None = None,
                       checkpoint_every: int = 64) -> dict[str, PerplexityResult]:
    """Chunked teacher-forced decode perplexity of every method, side by side.

    Per window: the first ``prefill`` tokens go into a fresh cache in one forward (not scored); the remaining
    tokens are fed in chunks of ``chunk`` through the same cache. Every token predicted in the chunk phase is
    scored, the first one from the prefill's last logit: ``window - prefill`` tokens per window. The perplexity is
    also reported per span of predicted-token positions between powers of two (``[prefill, 1024), [1024, 2048),
    ...``: how quality changes with the context a token is predicted from).

    ``score_every=k`` scores only the predicted positions ``prefill, prefill + k, ...`` (the model computes its
    output head only there: on long windows of a model with a large vocabulary, such as Gemma 3's 262k, the head
    is most of the cost); every token still goes through the caches in the same chunks.

    ``checkpoint(position, partial)`` is called every ``checkpoint_every`` chunks with the results over the
    positions scored so far (spans up to ``position``; bits/element left out), so that a long run that is stopped
    keeps what it measured.
    """
    n_win, window = windows.shape
    _check_protocol(window, prefill, chunk)
    if not isinstance(score_every, int) or score_every < 1:
        raise ValueError(f"score_every must be a positive integer, got {score_every!r}.")
    is_scored = torch.zeros(window, dtype=torch.bool)
    is_scored[prefill::score_every] = True
    kv, first_logits = full_precision_prefill(model, windows[:, :prefill])
    cache = stacked_caches(methods, model.config, n_win, kv)
    del kv
    ids = windows.repeat(len(methods), 1)  # method-major rows
    token_nll = torch.zeros(ids.shape[0], window, dtype=torch.float64)  # by the position of the predicted token
    token_nll[:, prefill] = _token_nll(first_logits.repeat(len(methods), 1), ids[:, prefill])
    nll = token_nll[:, prefill].clone()
    counts = torch.ones(ids.shape[0], dtype=torch.long)
    steps = range(prefill, window, chunk)
    for start in tqdm(steps, desc=f"perplexity ({len(methods)} methods x {n_win} windows)", disable=not progress):
        stop = min(start + chunk, window)
        # the logit at chunk index j predicts position start + j + 1 (the last window token predicts nothing)
        keep = torch.nonzero(is_scored[start + 1:stop + 1]).flatten()
        extra = {} if score_every == 1 else {"logits_to_keep": keep}
        logits = model(ids[:, start:stop], **cache_kwarg(model, cache), use_cache=True, **extra).logits
        if score_every == 1:
            logits = logits[:, :keep.numel()]
        positions = start + 1 + keep
        chunk_nll = _token_nll(logits, ids[:, positions])
        token_nll[:, positions] = chunk_nll
        nll += chunk_nll.sum(-1)
        counts += keep.numel()
        del logits
        done = (start - prefill) // chunk + 1
        if checkpoint is not None and done % checkpoint_every == 0 and stop < window:
            checkpoint(stop + 1, _results(methods, n_win, prefill, stop + 1, nll, counts, token_nll, is_scored))
    bits = {}
    for i, method in enumerate(methods):
        rows = slice(i * n_win, (i + 1) * n_win)
        parts = [cache_bits_per_element(c, model.config, r.stop - r.start) for c, r in cache.parts
                 if rows.start <= r.start < rows.stop]
        bits[method.key] = sum(parts) / len(parts)
    return _results(methods, n_win, prefill, window, nll, counts, token_nll, is_scored, bits)


def _results(methods, n_win, prefill, end, nll, counts, token_nll, is_scored, bits=None) -> dict[str, PerplexityResult]:
    """Per method: the perplexity over the positions scored before ``end``, and by span between powers of two."""
    edges = [prefill] + [2 ** e for e in range(1, end.bit_length()) if prefill < 2 ** e < end] + [end]
    results = {}
    for i, method in enumerate(methods):
        rows = slice(i * n_win, (i + 1) * n_win)
        by_span = [(a, b, token_nll[rows, a:b].sum().item(), int(is_scored[a:b].sum()) * n_win)
                   for a, b in itertools.pairwise(edges) if b > a]
        results[method.key] = PerplexityResult(nll[rows].tolist(), counts[rows].tolist(),
                                               None if bits is None else bits[method.key], by_span)
    return results


@torch.no_grad()
def plain_perplexity(model, windows: torch.Tensor, prefill: int = 512, progress: bool = True) -> PerplexityResult:
    """Reference: one plain forward per window, scoring the same tokens as :func:`chunked_perplexity`."""
    n_win, window = windows.shape
    _check_protocol(window, prefill, 1)
    sums, counts = [], []
    for w in tqdm(range(n_win), desc="plain forward", disable=not progress):
        logits = model(windows[w:w + 1], use_cache=False, logits_to_keep=window - prefill + 1).logits[0, :-1]
        sums.append(_token_nll(logits, windows[w, prefill:]).sum().item())
        counts.append(window - prefill)
    return PerplexityResult(sums, counts)


# ---------------------------------------------------------------------------------------------------- decoding
@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, methods: list[CacheMethod], new_tokens: int,
                         progress: bool = True, desc: str = "greedy decode",
                         prefill_chunk: int = 2048) -> dict[str, torch.Tensor]:
    """Greedy tokens [P, new_tokens] per method for prompts [P, T] (one shared full-precision prefill, then
    every method decodes through its own cache). Prompts over 2048 tokens are prefilled one at a time in chunks
    of ``prefill_chunk`` tokens."""
    n = prompts.shape[0]
    long = prompts.shape[1] > 2048
    kv, first_logits = full_precision_prefill(model, prompts, batch_size=1 if long else None,
                                              chunk=prefill_chunk if long else None)
    cache = stacked_caches(methods, model.config, n, kv)
    del kv
    token = first_logits.argmax(-1).repeat(len(methods))[:, None]
    out = [token]
    for _ in tqdm(range(new_tokens - 1), desc=desc, disable=not progress):
        token = model(token, **cache_kwarg(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    tokens = torch.cat(out, dim=1)
    return {m.key: tokens[i * n:(i + 1) * n] for i, m in enumerate(methods)}


def agreement_prompts(token_ids, num_prompts: int = 16, prompt_tokens: int = 512) -> torch.Tensor:
    return eval_windows(token_ids, num_prompts, prompt_tokens)


def greedy_agreement(model, prompts: torch.Tensor, methods: list[CacheMethod], new_tokens: int = 64,
                     reference: str = "fp", progress: bool = True) -> dict[str, dict]:
    """Per method: fraction of the first ``new_tokens`` greedy tokens identical (position by position) to the
    reference method's, and the mean length of the identical prefix."""
    names = [m.key for m in methods]
    if reference not in names:
        raise ValueError(f"The reference method {reference!r} is not among the methods {names}.")
    tokens = greedy_continuations(model, prompts, methods, new_tokens, progress, "greedy agreement")
    ref = tokens[reference]
    out = {}
    for name, t in tokens.items():
        same = t == ref
        prefix = (same.long().cumprod(dim=1)).sum(dim=1).float()
        out[name] = {"agreement": same.float().mean().item(), "mean_identical_prefix": prefix.mean().item(),
                     "prompts": t.shape[0], "new_tokens": new_tokens}
    return out


# ---------------------------------------------------------------------------------------------------- passkey
PASSKEY_INTRO = ("Somewhere in the long text below there is a pass key. Read carefully, find the pass key "
                 "and remember it, because you will be asked for it at the end.\n\n")
PASSKEY_NEEDLE = "\n\nImportant: the pass key is {key}. Remember the number {key}. The pass key is {key}.\n\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass
class PasskeyPrompt:
    ids: list[int]
    key: str
    length: int
    depth: float
    needle_position: int = field(default=0)


def passkey_prompts(tokenizer, haystack: str, length: int, depths: list[float], seed: int = 0,
                    key_digits: int = 5) -> list[PasskeyPrompt]:
    """Prompts of exactly ``length`` tokens: intro, Austen haystack, the needle sentence at ``depth`` of the
    haystack, question. One random ``key_digits``-digit key per prompt."""
    gen = torch.Generator().manual_seed(seed * 7919 + length)
    intro, question = encode(tokenizer, PASSKEY_INTRO), encode(tokenizer, PASSKEY_QUESTION)
    hay_ids = encode(tokenizer, haystack)
    prompts = []
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"Passkey depths must be within [0, 1], got {depth}.")
        key = str(int(torch.randint(10 ** (key_digits - 1), 10 ** key_digits, (1,), generator=gen)))
        needle = encode(tokenizer, PASSKEY_NEEDLE.format(key=key))
        n_hay = length - len(intro) - len(needle) - len(question)
        if n_hay < 1 or n_hay > len(hay_ids):
            raise ValueError(f"A passkey prompt of {length} tokens leaves {n_hay} haystack tokens (haystack has "
                             f"{len(hay_ids)}); choose a length between {len(intro) + len(needle) + len(question) + 1}"
                             " and the haystack size.")
        cut = round(depth * n_hay)
        ids = intro + hay_ids[:cut] + needle + hay_ids[cut:n_hay] + question
        prompts.append(PasskeyPrompt(ids, key, length, depth, len(intro) + cut))
    return prompts


def _answer_correct(text: str, key: str) -> bool:
    digits = "".join(ch if ch.isdigit() else " " for ch in text).split()
    return bool(digits) and digits[0] == key


def passkey_accuracy(model, tokenizer, methods: list[CacheMethod], lengths: list[int], depths: list[float],
                     haystack: str | None = None, seed: int = 0, progress: bool = True) -> dict[str, dict]:
    """Greedy passkey retrieval accuracy per method and prompt length. The prompt is prefilled in one forward (as
    ``generate`` does), then the answer is decoded greedily through each method's cache."""
    haystack = haystack if haystack is not None else load_text(HAYSTACK_TEXT)
    results = {m.key: {"per_length": {}, "answers": []} for m in methods}
    for length in lengths:
        prompts = passkey_prompts(tokenizer, haystack, length, depths, seed)
        ids = torch.tensor([p.ids for p in prompts])
        new_tokens = len(encode(tokenizer, " " + prompts[0].key)) + 2
        tokens = greedy_continuations(model, ids, methods, new_tokens, progress, f"passkey {length} tokens")
        for name, t in tokens.items():
            texts = [tokenizer.decode(row.tolist(), skip_special_tokens=True) for row in t]
            ok = [_answer_correct(text, p.key) for text, p in zip(texts, prompts)]
            results[name]["per_length"][str(length)] = sum(ok) / len(ok)
            results[name]["answers"] += [{"length": length, "depth": p.depth, "key": p.key, "answer": text,
                                          "correct": c} for p, text, c in zip(prompts, texts, ok)]
    for r in results.values():
        accs = list(r["per_length"].values())
        r["mean"] = sum(accs) / len(accs)
    return results


def confirm_range_clips(choices: Sequence[LayerChoice | None], model, held_ids: Sequence[torch.Tensor], *,
                        sink_tokens: int, recent_tokens: int, group_size: int, scale_dtype: torch.dtype,
                        head_dim: int, progress: bool = True) -> tuple[list[LayerChoice | None], dict | None]:
    """Keep each stream's narrowed group range (:attr:`GroupLayout.range_clip`) only where the model's loss on the
    held-back windows says it pays.

    The held-back attention error measures how far each output moves, not which way: narrowing a range saturates a
    group's extreme tokens, a shift of the same sign for every one of them, and where those tokens are what
    attention looks for (Gemma 3's first full-attention layer) the error falls while perplexity rises by several
    percent. So the windows are decoded by the evaluation's chunked protocol (prefill a quarter, chunks of a
    sixteenth) through the whole calibrated cache, once as fitted and once per narrowed stream with that stream's
    full range; a stream keeps its narrowed range only if its full range gives a higher loss. Returns the choices
    and what was measured (None: nothing narrowed). The calibration calls it when given it
    (``OscarCache.calibrate(..., range_clip_check=confirm_range_clips)``; ``calibrate_oscar.py`` does by default).
    """
    streams = [(i, kind) for i, c in enumerate(choices) if c is not None for kind in ("key", "value")
               if getattr(c, kind).layout.range_clip is not None]
    if not streams:
        return list(choices), None

    def widened(drop) -> list[LayerChoice | None]:
        out = list(choices)
        for i, kind in drop:
            c = out[i]
            cand = getattr(c, kind)
            full = replace(cand, layout=replace(cand.layout, range_clip=None))
            size = cand.layout.group_size
            name = f"{kind}:{cand.name}@None" + ("" if size == min(group_size, head_dim) else f"/g{size}")
            out[i] = replace(c, **{kind: full, f"{kind}_error": c.errors.get(name, float("nan"))})
        return out

    def method(name, ch):
        settings = settings_from_choices(ch, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                         group_size=group_size, scale_dtype=scale_dtype)
        calibration = calibration_from_choices(ch)
        return CacheMethod(name, name, lambda cfg: OscarCache(cfg, settings=settings, calibration=calibration))

    variants = {"fitted": list(choices), **{f"{i}:{kind}": widened([(i, kind)]) for i, kind in streams}}
    windows = torch.stack(list(held_ids)).long()
    window = windows.shape[1]
    prefill, chunk = window // 4, max(1, window // 16)
    names, nll = list(variants), {}
    for j in range(0, len(names), 4):  # a few caches side by side: memory stays that of ~4 decodes
        batch = [method(n, variants[n]) for n in names[j:j + 4]]
        results = chunked_perplexity(model, windows, batch, prefill, chunk, progress=progress)
        nll.update({n: math.log(r.perplexity) for n, r in results.items()})
    drop = [(i, kind) for i, kind in streams if nll[f"{i}:{kind}"] < nll["fitted"]]
    report = {"method": "held-back loss (chunked decode: prefill window/4, chunks window/16) of the calibrated "
                        "cache as fitted and with each narrowed stream at its full range",
              "held_back_nll": nll,
              "kept": [f"{i}:{kind}" for i, kind in streams if (i, kind) not in drop],
              "widened": [f"{i}:{kind}" for i, kind in drop]}
    return widened(drop), report
