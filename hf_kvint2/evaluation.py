"""Quality evaluation of KV caches: chunked teacher-forced decode perplexity, passkey retrieval, greedy agreement.

Every protocol compares several cache *methods* (:class:`~hf_kvint2.perplexity.CacheMethod`: a factory returning a
fresh ``transformers.Cache`` for a model config) in one run, each through its own cache with the ``"oscar"``
attention, as users run them (:mod:`hf_kvint2.perplexity`: the chunked protocol, the shared full-precision prefill
replayed into each cache, bits/element). The methods: the two public caches, the calibrated ``OscarCache``, and the
baselines as recipes of the same layer (:func:`~hf_kvint2.settings.kivi2_recipe`,
:func:`~hf_kvint2.settings.hadamard_only_recipe`, :func:`~hf_kvint2.settings.naive_int2_recipe`), beside
``DynamicCache`` and transformers' ``QuantizedCache``. ``benchmarks/quality.py`` runs them; nothing in the library
imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.cache_utils import Cache

from .cache import OscarCache, OscarCacheBase, OscarScaledCache
from .layers import OscarLayer
from .model_config import model_shape
from .perplexity import (
    CacheMethod,
    PerplexityResult,
    cache_bits_per_element,
    cache_kwarg,
    check_protocol,
    chunked_perplexity,
    full_precision_prefill,
    method_caches,
    oscar_attention,
    token_nll,
)
from .recipes import LayerRecipe
from .settings import OscarScaledSettings, OscarSettings, hadamard_only_recipe, kivi2_recipe, naive_int2_recipe

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


def describe(recipe: LayerRecipe, head_dim: int) -> str:
    """A recipe's groups, clips and windows in words (the quality benchmark's method descriptions)."""
    def stream(name, layout):
        group = layout.group_for(head_dim)
        words = f"{name} per channel/{group} tokens" if layout.axis == "channel" else f"{name} per token/{group}"
        extras = ([f"clip {layout.clip:g}"] if layout.clip is not None else []) + \
            (["token scaling"] if layout.token_scaling else [])
        return words + (f" ({', '.join(extras)})" if extras else "")

    return (f"{stream('K', recipe.key)}, {stream('V', recipe.value)}, sink {recipe.sink_tokens}, "
            f"recent {recipe.recent_tokens}")


def standard_methods(config, calibrated: Callable[[object], OscarCache] | None = None,
                     transformers_backends: tuple[str, ...] = ("hqq", "quanto")) -> list[CacheMethod]:
    """The methods compared in the quality benchmark. ``calibrated(config)`` loads a fresh calibrated OscarCache
    with eager layers; without it the calibrated rows are left out."""
    d = model_shape(config).head_dim
    methods = [
        CacheMethod("fp", "full precision", lambda cfg: DynamicCache(config=cfg), True, "DynamicCache"),
        CacheMethod("oscar_scaled", "OScaR (OscarScaledCache)", lambda cfg: OscarScaledCache(config=cfg), True,
                    f"OscarScaledCache() defaults: Hadamard, {describe(OscarScaledSettings().recipe(), d)} (keys "
                    "that keep the model basis drop the Hadamard and the token norm)"),
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
                    f"OscarCache() uncalibrated: Hadamard, {describe(OscarSettings().recipe(), d)} (keys that vary "
                    "very unevenly over channels keep the model basis with per-channel groups: hf_kvint2.key_basis)"),
        CacheMethod("hadamard_only", "Hadamard-only INT2 (fixed rotation)",
                    lambda cfg: engine_cache(hadamard_only_recipe(d), cfg), True,
                    f"normalised Hadamard on K and V always (no key-basis choice), {describe(hadamard_only_recipe(d), d)}"),
        CacheMethod("kivi2", "KIVI-2 (this engine)", lambda cfg: engine_cache(kivi2_recipe(d), cfg), True,
                    f"no rotation; {describe(kivi2_recipe(d), d)}"),
        CacheMethod("naive", "naive INT2", lambda cfg: engine_cache(naive_int2_recipe(d), cfg), True,
                    f"no rotation, no clip; {describe(naive_int2_recipe(d), d)}"),
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


@torch.no_grad()
def plain_perplexity(model, windows: torch.Tensor, prefill: int = 512, progress: bool = True) -> PerplexityResult:
    """Reference: one plain forward per window, scoring the same tokens as :func:`chunked_perplexity`."""
    n_win, window = windows.shape
    check_protocol(window, prefill, 1)
    sums, counts = [], []
    for w in tqdm(range(n_win), desc="plain forward", disable=not progress):
        logits = model(windows[w:w + 1], use_cache=False, logits_to_keep=window - prefill + 1).logits[0, :-1]
        sums.append(token_nll(logits, windows[w, prefill:]).sum().item())
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
    first = first_logits.argmax(-1, keepdim=True)
    out = {}
    with oscar_attention(model):
        for method in methods:
            tokens = torch.empty(n, new_tokens, dtype=torch.long)
            for cache, rows in method_caches(method, model.config, n, kv):
                token = first[rows]
                tokens[rows, 0] = token[:, 0]
                for i in tqdm(range(1, new_tokens), desc=f"{desc}: {method.name}", disable=not progress):
                    token = model(token, **cache_kwarg(model, cache), use_cache=True).logits[:, -1].argmax(
                        -1, keepdim=True)
                    tokens[rows, i] = token[:, 0]
            out[method.key] = tokens
    return out


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



__all__ = [
    "CALIBRATION_TEXT", "EVAL_TEXT", "HAYSTACK_TEXT", "PASSKEY_INTRO", "PASSKEY_NEEDLE", "PASSKEY_QUESTION",
    "ByteTokenizer", "CacheMethod", "PasskeyPrompt", "PerplexityResult", "agreement_prompts", "bits_at_length",
    "cache_bits_per_element", "cache_kwarg", "chunked_perplexity", "describe", "encode", "engine_cache",
    "eval_windows", "full_precision_prefill", "greedy_agreement", "greedy_continuations", "load_text",
    "passkey_accuracy", "passkey_prompts", "plain_perplexity", "standard_methods", "with_key_token_scaling",
]
