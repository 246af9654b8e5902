"""Helpers shared by the CPU speed benchmarks (bench_decode, bench_throughput, bench_prefill, bench_jit).

* :func:`load_model`: the bundled SmolLM2-135M, or ``"synthetic"``: a Llama with SmolLM2-135M's shapes (30 layers,
  hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152) and random weights, with
  ``max_position_embeddings=32768`` so that a 32k context is valid (speed only: quality is not measured with it).
* :func:`make_cache`, :func:`fill_cache`: the caches compared, filled with random K/V (layer 0 in chunks, copied to
  every layer), which is what decode speed depends on; a real 8k x batch prefill takes many minutes on 2 cores.
* :func:`cache_bytes`: bytes of every tensor a cache holds (storages counted once, whole allocations), found by
  walking the cache object: the same measure for every cache class, including transformers' own.
"""

from __future__ import annotations

import copy
import os
import resource

import torch

CACHES = ("dynamic", "hqq", "oscar", "scaled")


def set_threads(threads: int) -> None:
    """One intra-op thread count for torch and the Numba kernel (NUMBA_NUM_THREADS must be set before import)."""
    if threads:
        torch.set_num_threads(threads)
        os.environ.setdefault("NUMBA_NUM_THREADS", str(threads))


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def load_model(name: str, attn_implementation: str):
    if name == "smollm2":
        from hf_kvint2.models import load_smollm2

        model, _ = load_smollm2(torch.float32, attn_implementation=attn_implementation)
        return model
    if name != "synthetic":
        raise ValueError(f"unknown model {name!r}: use smollm2 or synthetic")
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_kvint2  # noqa: F401  (registers "oscar")

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=32768,
                         rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def make_cache(kind: str, config):
    from transformers import DynamicCache, QuantizedCache

    import hf_kvint2

    if kind == "dynamic":
        return DynamicCache(config=config)
    if kind == "hqq":
        return QuantizedCache(backend="hqq", config=config, nbits=2)
    if kind == "oscar":
        return hf_kvint2.OscarCache(config=config)
    if kind == "scaled":
        return hf_kvint2.OscarScaledCache(config=config)
    raise ValueError(f"unknown cache {kind!r}: use one of {CACHES}")


def fill_cache(cache, config, batch: int, context: int, fused: bool, chunk: int = 1024, seed: int = 0) -> None:
    """Random K/V for ``context`` tokens: layer 0 by ``update`` in chunks, then a copy of it in every layer."""
    from hf_kvint2.layers import OscarLayer

    g = torch.Generator().manual_seed(seed)
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, OscarLayer):  # the fill discards update()'s return value: skip building the full view
            layer.fused_attention = True
    with torch.no_grad():
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            cache.update(torch.randn(batch, kv_heads, n, head_dim, generator=g),
                         torch.randn(batch, kv_heads, n, head_dim, generator=g), 0)
        for idx in range(1, config.num_hidden_layers):
            layer = copy.deepcopy(cache.layers[0])
            if hasattr(layer, "layer_idx"):
                layer.layer_idx = idx
            if idx < len(cache.layers):
                cache.layers[idx] = layer
            else:
                cache.layers.append(layer)
    for layer in cache.layers:
        if isinstance(layer, OscarLayer):
            layer.fused_attention = fused


def cache_bytes(cache) -> int:
    """Bytes of all tensor storages reachable from ``cache`` (each storage once, its whole allocation)."""
    seen_storage, seen_obj, total = set(), set(), 0
    stack = [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen_storage and storage.nbytes():
                seen_storage.add(key)
                total += storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, s) for s in obj.__slots__ if hasattr(obj, s))
    return total
